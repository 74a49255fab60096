# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The checkpoint conformance matrix: a checkpoint of a run that keeps parameters in fp32
(``data_types.keep_in_fp32_modules``) loads with nothing lost, in every stage (ROWS), with every optimizer (COLUMNS),
along every path (PATHS): the same layout, into other lists, from stock DeepSpeed 0.19.8, back to it, and through
ds_to_universal at the same and at other world sizes; the cells of one rank (``*_ws1``) are those the GPU check runs
on one GPU with FusedAdam's CUDA kernel (tools/gpu-check, part 1).

A cell is (row, column, path), its id "row-column-path"; the cells are made from the tables below: DO_NOT_APPLY
leaves out those that do not apply (Muon outside ZeRO-1/2/3, universal checkpoints of ZeRO-0 and of optimizers without
Adam's states, which ds_to_universal does not convert), CANNOT_WORK names
those that cannot work and the refusal they assert instead, FAST is the fast subset (every row, column and path at
least once); the others are nightly.

Every cell that loads checks, on every rank of the loading run (``_Ranks.load``):

- the loading engine's whole state before the load differs from the saved one in every parameter's master and in
  the counters, so an empty difference after it cannot come from a load that did nothing (the scheduler warms up
  from half the lr, not from 0, so that every master moves before the save);
- after the load, the whole-state oracle (``_keep_in_fp32_whole_state.py``) against the saving run's whole state:
  every optimizer state of every parameter (``step`` included), the param groups, the loss scaler, the lr scheduler
  and the counters, exactly; no state tensor shared by two masters; every master's ``step`` is the steps the saving
  optimizer took (in memory here; in every rank's optimizer-state file and in a universal checkpoint's ``step.pt``
  files, or ZeRO-3's ``optimizer_state.pt``, in the test's process); every parameter in the dtype its list asks for,
  holding its master (rounded to bf16 where not kept), a kept sink off the bf16 grid; every buffer its saved value;
- K more steps: where the layouts match (the same list at the same world size) they are the run that never stopped,
  bit for bit (losses and whole state; FusedAdam's CPU build to the last bits of its masters, see
  Continuation.check); elsewhere each master is what its optimizer makes of the loaded state (Continuation.check),
  and for Muon, whose momentum ZeRO applies before the optimizer's step, so that no replay of the step alone
  reproduces it, each master's step advanced by K. After them, every parameter holds its master.

The way back to stock 0.19.8 (``list_to_stock``) is the documented recipe: the series loads the kept checkpoint with
``keep_in_fp32_modules: []`` and saves it again; stock 0.19.8 loads that one (in a process of its own, pristine
0.19.8 on PYTHONPATH): its whole state must be the series' own after the ``[]`` load, and its next K steps (losses
and whole state) the series' own. ``test_stock_loads_a_kept_checkpoint`` records what stock 0.19.8 does with the
kept checkpoint itself (STOCK_DIRECT: it raises, and the docs quote the message, or it loads the whole state).

The saves are shared by the cells of a module (the ``checkpoints`` fixture): one per (row, column, list, world size,
saving DeepSpeed); a universal conversion is added to the save it converts. The model is RouterSinkNet
(``_checkpoint_conformance_run.py``): SinkNet's sinks and norm off the bf16 grid, with a listed router matrix.
"""

import copy
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from unit.checkpoint._checkpoint_conformance_run import K, STEPS, TAG, engine, kept_names, save, save_run, train
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states, check_saved_steps,
                                                       check_steps, check_whole_state, whole_state)
from unit.checkpoint._keep_in_fp32_checkpoint_run import pristine_tree
from unit.common import DistributedTest, _free_port, run_distributed

LIST = "auto"  # the model's list: the sinks, the norm, the router
OTHER_LISTS = (["sink"], ["norm", "router"])

# The zero_optimization (and data_types) section of each row. "zero1_bf16_optimizer" accumulates gradients in fp32 at
# ZeRO-1, for which the engine takes the BF16 optimizer; at ZeRO-0 the engine wraps FusedAdam in FP16_Optimizer and
# a torch optimizer in FP16_UnfusedOptimizer, which step once at initialize (steps_at_initialize: every master's
# step counts it).
ROWS = {
    "zero0": {
        "zero_optimization": {
            "stage": 0
        },
        "steps_at_initialize": 1
    },
    "zero1": {
        "zero_optimization": {
            "stage": 1
        }
    },
    "zero2": {
        "zero_optimization": {
            "stage": 2
        }
    },
    "zero1_bf16_optimizer": {
        "zero_optimization": {
            "stage": 1
        },
        "data_types": {
            "grad_accum_dtype": "fp32"
        }
    },
    "zero3": {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0
        }
    },
    "zero3_offload": {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "cpu"
            }
        }
    },
}

# The optimizer section of each column; "Adam" without torch_adam is DeepSpeed's FusedAdam (its CPU build).
# "steps": every master keeps a step; "last_bits": its masters may differ in their last bits between two processes
# (see Continuation.check); "replay": Continuation.check can replay its steps; a row's name: what it adds to that
# row's zero_optimization (ZeRO-3's Muon needs reduce_scatter off).
COLUMNS = {
    "adamw": {
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-5,
                "torch_adam": True
            }
        },
        "steps": True
    },
    "fused_adam": {
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-5
            }
        },
        "steps": True,
        "last_bits": True
    },
    "sgd": {
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 1e-2,
                "momentum": 0.9
            }
        }
    },
    "muon": {
        "optimizer": {
            "type": "Muon",
            "params": {
                "lr": 1e-5
            }
        },
        "replay": False,
        "zero3": {
            "reduce_scatter": False
        }
    },
}

# Each path: who saves ("series", or "stock": pristine 0.19.8 in a process of its own, which keeps nothing), with
# which list, at which world size; the list and world size of the run that loads; whether through ds_to_universal;
# "to_stock": the way back (the module's docstring).
PATHS = {
    "same": dict(saved=LIST, loaded=LIST),
    "none_to_list": dict(saved=[], loaded=LIST),
    "list_to_none": dict(saved=LIST, loaded=[]),
    "list_to_other": dict(saved=OTHER_LISTS[0], loaded=OTHER_LISTS[1]),
    "stock_to_list": dict(by="stock", saved=[], loaded=LIST),
    "list_to_stock": dict(saved=LIST, loaded=[], to_stock=True),
    "universal": dict(saved=LIST, loaded=LIST, universal=True),
    "universal_2_to_3": dict(saved=LIST, loaded=LIST, universal=True, loaded_ws=3),
    "universal_2_to_1_none": dict(saved=LIST, loaded=[], universal=True, loaded_ws=1),
    "universal_4_to_2_other": dict(saved=OTHER_LISTS[0], loaded=OTHER_LISTS[1], universal=True, saved_ws=4),
    "stock_universal_to_list": dict(by="stock", saved=[], loaded=LIST, universal=True),
    # one rank saves and loads: the cells the GPU check runs on one GPU (tools/gpu-check, part 1), FusedAdam's CUDA
    # kernel among them
    "same_ws1": dict(saved=LIST, loaded=LIST, saved_ws=1),
    "none_to_list_ws1": dict(saved=[], loaded=LIST, saved_ws=1),
}
for _path in PATHS.values():
    _path.setdefault("by", "series")
    _path.setdefault("saved_ws", 2)
    _path.setdefault("loaded_ws", _path["saved_ws"])
    _path.setdefault("universal", False)
    _path.setdefault("to_stock", False)


def _same_layout(path):
    """Whether the loading run holds the saving run's layout: the same list at the same world size."""
    spec = PATHS[path]
    return (spec["by"] == "series" and not spec["to_stock"] and spec["saved"] == spec["loaded"]
            and spec["saved_ws"] == spec["loaded_ws"])  # through ds_to_universal too


_UNIVERSAL = [path for path, spec in PATHS.items() if spec["universal"]]
# The cells that do not apply, left out of the parametrization: (rows, columns, paths), why.
DO_NOT_APPLY = [
    ((("zero0", "zero1_bf16_optimizer", "zero3_offload"), ("muon", ), list(PATHS)),
     "Muon runs at ZeRO-1/2/3 (test_keep_in_fp32_muon.py)"),
    ((("zero0", ), list(COLUMNS), _UNIVERSAL), "ds_to_universal converts ZeRO checkpoints only"),
    ((list(ROWS), ("fused_adam", "sgd", "muon"), ("universal_4_to_2_other", )), "world size 4 on 2 cores: one column"),
    ((list(ROWS), ("sgd", "muon"), ("same_ws1", "none_to_list_ws1")), "one rank: the GPU check's Adam cells"),
    ((list(ROWS), ("sgd", "muon"), _UNIVERSAL),
     "ds_to_universal (as in stock 0.19.8) converts Adam's exp_avg and exp_avg_sq only: SGD's and Muon's momentum "
     "stop it with KeyError: 'exp_avg' (test_universal_converts_adam_states_only)"),
]


def _applies(row, column, path):
    return not any(row in rows and column in columns and path in paths for (rows, columns, paths), _ in DO_NOT_APPLY)


# The cells that cannot work, and what each rank raises instead: (rows, columns, paths), (exception, a pattern of its
# message, the way out it must name). ZeRO-1/2 hold Muon's momentum as whole parameters (those of the rank's
# partition), not laid out as the fp32 partition: a load into other flat groups refuses to move it.
_LAYOUT_CHANGES = [p for p, spec in PATHS.items() if not spec["universal"] and not _same_layout(p)]
CANNOT_WORK = [
    ((("zero1", "zero2"), ("muon", ), _LAYOUT_CHANGES),
     (ValueError, r"'momentum_buffer' .* not laid out as the partition", "keep_in_fp32_modules it was saved with")),
]


def _refusal(row, column, path):
    for (rows, columns, paths), refusal in CANNOT_WORK:
        if row in rows and column in columns and path in paths:
            return refusal
    return None


# The fast subset: every row, column and path at least once (the rest is nightly).
FAST = {
    ("zero0", "adamw", "stock_to_list"),
    ("zero1", "sgd", "none_to_list"),
    ("zero2", "fused_adam", "universal_2_to_1_none"),
    ("zero2", "muon", "list_to_other"),
    ("zero2", "adamw", "stock_to_list"),
    ("zero2", "adamw", "stock_universal_to_list"),
    ("zero1_bf16_optimizer", "fused_adam", "same"),
    ("zero1_bf16_optimizer", "adamw", "stock_to_list"),
    ("zero1_bf16_optimizer", "adamw", "universal_4_to_2_other"),
    ("zero3", "adamw", "list_to_stock"),
    ("zero3", "fused_adam", "universal_2_to_3"),
    ("zero3", "adamw", "stock_to_list"),
    ("zero3_offload", "sgd", "list_to_none"),
    ("zero3_offload", "adamw", "universal"),
    ("zero3", "adamw", "list_to_other"),
}

# What stock 0.19.8 does when it loads a checkpoint of a run that kept the model's list, per (row, column) recorded
# (each row with torch's AdamW, ZeRO-0 with each of its wrappers): the type and the start of the message of the
# exception it raises on every rank, or None where it loads the whole state as saved (FP16_UnfusedOptimizer, whose
# masters are per parameter; it then trains the listed parameters in bf16, as it always did).
_GROUP_SIZE = ("ValueError", "loaded state dict contains a parameter group that doesn't match the size of optimizer's "
               "group")
_ALIGNMENT = ("RuntimeError", "The ZeRO checkpoint parameter-alignment layout does not match the current "
              "zero_optimization.parameter_alignment setting. Load with the setting used to save the checkpoint, or "
              "disable optimizer-state loading for a module-only warm start.")
STOCK_DIRECT = {
    ("zero0", "adamw"): None,
    ("zero0", "sgd"): None,
    ("zero0", "fused_adam"): _GROUP_SIZE,
    ("zero1", "adamw"): _ALIGNMENT,
    ("zero2", "adamw"): _ALIGNMENT,
    ("zero1_bf16_optimizer", "adamw"): _GROUP_SIZE,
    ("zero3", "adamw"): _GROUP_SIZE,
    ("zero3_offload", "adamw"): _GROUP_SIZE,
}


def _cells():
    for row in ROWS:
        for column in COLUMNS:
            for path in PATHS:
                if not _applies(row, column, path):
                    continue
                marks = () if (row, column, path) in FAST else pytest.mark.nightly
                yield pytest.param(row, column, path, id=f"{row}-{column}-{path}", marks=marks)


def cell_config(row, column, keep, universal=False):
    """The DeepSpeed config of ``row`` and ``column`` keeping ``keep`` ("auto": no keep_in_fp32_modules), with a
    scheduler (its state and the initial_lr it adds to each param group are part of what a load restores) that warms
    up from half the column's lr (not from 0: every master moves from the first step on)."""
    lr = COLUMNS[column]["optimizer"]["params"]["lr"]
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": lr / 2, "warmup_max_lr": lr, "warmup_num_steps": 10}}
    zero = dict(copy.deepcopy(ROWS[row]["zero_optimization"]), **COLUMNS[column].get(row, {}))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": copy.deepcopy(COLUMNS[column]["optimizer"]),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's SGD under ZeRO
        "bf16": {
            "enabled": True
        },
        "scheduler": scheduler,
    }
    data_types = copy.deepcopy(ROWS[row].get("data_types", {}))
    if keep != "auto":
        data_types["keep_in_fp32_modules"] = keep
    if data_types:
        config["data_types"] = data_types
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def _optimizer_steps(row):
    """The steps the saving run's optimizer took: STEPS, and those it takes at initialize."""
    return STEPS + ROWS[row].get("steps_at_initialize", 0)


def _check_differs(fresh, saved):
    """The whole state before the load differs from ``saved`` in every parameter's master and in the counters."""
    same = [
        name for name, entry in saved["params"].items()
        if torch.equal(fresh["params"][name]["states"]["master"], entry["states"]["master"])
    ]
    assert not same, f"before the load, the masters of {same} are already the saved ones: the check cannot tell"
    assert fresh["counters"] != saved["counters"], fresh["counters"]


def _gathered(param):
    import deepspeed
    with deepspeed.zero.GatheredParameters([param]):
        return param.data.detach().cpu().clone()


def _check_buffers(model_engine, saved, kept):
    """Every buffer holds its ``saved`` value (in its dtype: fp32 where ``kept`` names it; the engine leaves an fp32
    buffer that no list names in fp32 too, as test_keep_in_fp32_stages.py's checks say)."""
    for name, buf in model_engine.module.named_buffers():
        assert buf.dtype == torch.float32 or name not in kept, f"{name} is {buf.dtype}, expected torch.float32"
        assert torch.equal(buf.cpu(), saved[name].to(buf.dtype)), f"{name} does not hold its saved value"


def _check_params_hold_masters(model_engine, state, kept, what):
    """Every parameter in fp32 where ``kept`` names it (its ZeRO-3 partition too), else in bf16, holding its master
    (of ``state``, a whole_state) in that dtype; a kept sink off the bf16 grid (else the check shows nothing)."""
    for name, param in model_engine.module.named_parameters():
        want = torch.float32 if name in kept else torch.bfloat16
        stored = getattr(param, "ds_tensor", param)
        assert stored.dtype == want, f"{what}: {name} is stored in {stored.dtype}, expected {want}"
        value = _gathered(param)
        master = state["params"][name]["states"]["master"]
        assert value.dtype == want and torch.equal(value, master.to(want)), \
            f"{what}: {name} ({value.dtype}) does not hold its master{' rounded' if want != torch.float32 else ''}"
    if "attn.sinks" in kept:
        sinks = state["params"]["attn.sinks"]["states"]["master"]
        assert not torch.equal(sinks, sinks.bfloat16().float()), f"{what}: the sinks are on the bf16 grid"


def _reference(directory):
    return torch.load(os.path.join(directory, "reference.pt"), weights_only=False)


class _Ranks(DistributedTest):
    """What the ranks of the series' runs do (run by run_distributed from the tests and fixtures below)."""
    timeout = 300

    def save(self, config, out):
        save_run(config, out)

    def load(self, row, column, path, src, out):
        """Load ``src``'s checkpoint as ``path`` does and check it (the module's docstring)."""
        import deepspeed.comm as dist
        spec = PATHS[path]
        loaded_keep = spec["loaded"]
        config = cell_config(row, column, loaded_keep, universal=spec["universal"])
        reference = _reference(src)
        saved = reference["whole_state"]
        model_engine = engine(config)
        _check_differs(whole_state(model_engine), saved)
        refusal = _refusal(row, column, path)
        if refusal is not None:  # raised on every rank (each one runs this), naming a way out
            error, pattern, way_out = refusal
            with pytest.raises(error, match=pattern) as info:
                model_engine.load_checkpoint(os.path.join(src, "ckpt"))
            assert way_out in str(info.value), str(info.value)
            return
        load_path, _ = model_engine.load_checkpoint(os.path.join(src, "ckpt"))
        assert load_path is not None, "nothing was loaded"
        assert (f"{TAG}_universal" in load_path) == spec["universal"], load_path
        kept = kept_names(loaded_keep)
        steps = _optimizer_steps(row)
        state = whole_state(model_engine)
        check_whole_state(state, saved)
        check_masters_own_their_states(model_engine)
        check_steps(model_engine, steps, COLUMNS[column].get("steps", False))
        _check_params_hold_masters(model_engine, state, kept, "after the load")
        _check_buffers(model_engine, reference["buffers"], kept)
        if path == "list_to_stock":  # the way back: save again, and record the next steps for stock 0.19.8's
            save(model_engine, os.path.join(out, "ckpt"))
            losses = train(model_engine, K, first_step=STEPS)
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, losses)
            record = {"whole_state": state, "next_losses": every_rank, "next_whole_state": whole_state(model_engine)}
            if dist.get_rank() == 0:
                torch.save(record, os.path.join(out, "series.pt"))
            return
        last_bits = COLUMNS[column].get("last_bits", False)
        if _same_layout(path):
            # the run that never stopped, bit for bit (FusedAdam's CPU build: its masters to the last bits, and so
            # its losses)
            losses = train(model_engine, K, first_step=STEPS)
            want = reference["next_losses"][dist.get_rank()]
            assert losses == want or last_bits and losses == pytest.approx(want, rel=1e-5), (losses, want)
            after = whole_state(model_engine)
            check_whole_state(after, reference["next_whole_state"], f"{K} more steps", last_bits)
        elif COLUMNS[column].get("replay", True):
            continuation = Continuation(model_engine)
            losses = train(model_engine, K, first_step=STEPS)
            continuation.check(K)
            after = whole_state(model_engine)
        else:
            losses = train(model_engine, K, first_step=STEPS)
            check_steps(model_engine, steps + K, False)
            after = whole_state(model_engine)
        assert all(torch.isfinite(torch.tensor(losses))), losses
        check_masters_own_their_states(model_engine)
        _check_params_hold_masters(model_engine, after, kept, f"{K} steps after the load")


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_checkpoint_conformance_run.py")


def _stock(mode, out, world_size, config, *args, name=None):
    """Run _checkpoint_conformance_run.py's ``mode`` with pristine DeepSpeed 0.19.8 on ``world_size`` ranks
    (torch.distributed.run, gloo), in ``out``; returns its output."""
    tree = pristine_tree()
    config_file = os.path.join(out, f"{name or mode}.json")
    with open(config_file, "w") as f:
        json.dump(config, f)
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world_size), OMP_NUM_THREADS="1", PYTHONPATH=tree)
    # the pristine tree's own cache of its JIT-built ops: <repo>/build/pristine -> <repo>/build/torch_extensions/...
    repo = os.path.dirname(os.path.dirname(tree))
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(repo, "build", "torch_extensions", "pristine")
    port = _free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
        str(world_size), "--master_addr", "127.0.0.1", "--master_port",
        str(port), SCRIPT, mode,
        str(out), "--config", config_file, *args
    ]
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    finally:
        # DeepSpeed's CPU comm op leaves a shared-memory buffer per rank (66 MiB each)
        for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
    output = f"{' '.join(command)}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"stock 0.19.8's {mode} failed:\n{output}"
    assert f"from {os.path.join(tree, 'deepspeed', '__init__.py')}" in result.stdout, output
    return output


class _Checkpoints:
    """The saves of a module, made on first use: one per (row, column, list, world size, saving DeepSpeed)."""

    def __init__(self, factory):
        self.factory = factory
        self.made = {}

    def get(self, row, column, keep, world_size, by, universal=False):
        key = (row, column, json.dumps(keep), world_size, by)
        if key not in self.made:
            keep_id = "list" if keep == LIST else "-".join(keep) or "none"
            out = str(self.factory.mktemp(f"{by}-{row}-{column}-{keep_id}-ws{world_size}"))
            config = cell_config(row, column, keep)
            if by == "stock":
                _stock("save", out, world_size, config)
            else:
                run_distributed(_Ranks, "save", world_size, dict(config=config, out=out), label=f"save {key}")
            reference = _reference(out)
            assert reference["world_size"] == world_size
            import deepspeed
            ours = os.path.dirname(deepspeed.__file__)
            want = os.path.join(pristine_tree(), "deepspeed") if by == "stock" else ours
            assert os.path.dirname(os.path.abspath(reference["deepspeed_file"])) == want, reference["deepspeed_file"]
            check_saved_steps(os.path.join(out, "ckpt", TAG), _optimizer_steps(row),
                              COLUMNS[column].get("steps", False))
            self.made[key] = out
        out = self.made[key]
        if universal and not os.path.exists(os.path.join(out, "ckpt", "latest_universal")):
            from unit.checkpoint._keep_in_fp32_checkpoint_run import to_universal
            to_universal(os.path.join(out, "ckpt"), TAG)
            check_saved_steps(os.path.join(out, "ckpt", f"{TAG}_universal"), _optimizer_steps(row),
                              COLUMNS[column].get("steps", False))
        return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory)


def _stock_record(out, name, world_size):
    """What stock 0.19.8's load_run recorded: (the exception of each rank or None, rank 0's record or None)."""
    errors = []
    for rank in range(world_size):
        path = os.path.join(out, f"{name}.rank{rank}.pt")
        errors.append(torch.load(path, weights_only=False)["error"] if os.path.exists(path) else "no record")
    record = os.path.join(out, f"{name}.pt")
    return errors, torch.load(record, weights_only=False) if os.path.exists(record) else None


class TestCheckpointConformance:
    """Each cell of the matrix (the module's docstring); the ranks run in _Ranks, the stock side in a process of its
    own."""

    @pytest.mark.parametrize("row, column, path", list(_cells()))
    def test_cell(self, row, column, path, checkpoints, tmp_path):
        spec = PATHS[path]
        src = checkpoints.get(row, column, spec["saved"], spec["saved_ws"], spec["by"], spec["universal"])
        out = str(tmp_path)
        run_distributed(_Ranks,
                        "load",
                        spec["loaded_ws"],
                        dict(row=row, column=column, path=path, src=src, out=out),
                        label=f"{row}-{column}-{path}")
        if not spec["to_stock"] or _refusal(row, column, path) is not None:
            return
        # the way back: the series' checkpoint after its [] load, which stock 0.19.8 now loads
        check_saved_steps(os.path.join(out, "ckpt", TAG), _optimizer_steps(row), COLUMNS[column].get("steps", False))
        series = torch.load(os.path.join(out, "series.pt"), weights_only=False)
        output = _stock("load", out, 2, cell_config(row, column, []), "--ckpt", os.path.join(out, "ckpt"), "--name",
                        "stock")
        errors, stock = _stock_record(out, "stock", 2)
        assert errors == [None, None], f"stock 0.19.8 did not load the series' [] checkpoint: {errors}\n{output}"
        check_whole_state(stock["whole_state"], series["whole_state"], "stock 0.19.8's load")
        assert stock["next_losses"] == series["next_losses"], (stock["next_losses"], series["next_losses"])
        check_whole_state(stock["next_whole_state"], series["next_whole_state"], f"stock 0.19.8's {K} more steps")


# nightly: what stock 0.19.8 does does not change (the way back, list_to_stock, is in the fast subset)
@pytest.mark.nightly
@pytest.mark.parametrize("row, column",
                         [pytest.param(row, column, id=f"{row}-{column}") for row, column in STOCK_DIRECT])
def test_stock_loads_a_kept_checkpoint(row, column, checkpoints):
    """What stock 0.19.8 does with a checkpoint of a run that kept the model's list (STOCK_DIRECT, which the docs
    quote): it raises on every rank, or it loads the whole state as saved (then trains the listed parameters in bf16,
    as it always did). The way back is list_to_stock's recipe."""
    src = checkpoints.get(row, column, LIST, 2, "series")
    output = _stock("load", src, 2, cell_config(row, column, LIST), "--ckpt", os.path.join(src, "ckpt"), "--name",
                    "stock_direct")
    errors, record = _stock_record(src, "stock_direct", 2)
    raised = [error and (error["type"], error["message"]) for error in errors]
    print(f"stock 0.19.8 loading a kept {row}-{column} checkpoint: {raised}")
    want = STOCK_DIRECT[row, column]
    if want is None:
        assert errors == [None, None], f"stock 0.19.8 raised: {errors}\n{output}"
        check_whole_state(record["whole_state"], _reference(src)["whole_state"], "stock 0.19.8's load")
        return
    want_type, want_start = want
    for rank, error in enumerate(errors):
        assert isinstance(error, dict), f"rank {rank}: stock 0.19.8 raised nothing ({error}):\n{output}"
        assert error["type"] == want_type and error["message"].startswith(want_start), \
            f"rank {rank}: stock 0.19.8 raised {error['type']}: {error['message']}\n{error['traceback']}"


# nightly: ds_to_universal is stock 0.19.8's; the day it converts every optimizer state, this fails and the universal
# cells of SGD and Muon join the matrix (DO_NOT_APPLY)
@pytest.mark.nightly
def test_universal_converts_adam_states_only(checkpoints):
    """ds_to_universal stops at a ZeRO-2 checkpoint of SGD with momentum (KeyError: 'exp_avg'), as in stock 0.19.8."""
    with pytest.raises(KeyError, match="exp_avg"):
        checkpoints.get("zero2", "sgd", LIST, 2, "series", True)
