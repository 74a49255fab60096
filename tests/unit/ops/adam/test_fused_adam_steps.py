# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""DeepSpeed's FusedAdam counts the steps of each parameter in its own state, as torch's Adam does: every parameter
that gets a gradient advances its ``state['step']`` once a step and is updated with that count, whatever other
parameters and dtypes its param group holds (DeepSpeed 0.19.8 advanced only the state of the param group's last
parameter, once per dtype, and updated every parameter with it). Run on the accelerator's build of the op (its CPU
build on the CPU)."""

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import FusedAdam
from deepspeed.ops.op_builder import FusedAdamBuilder

if not deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME]:
    pytest.skip("FusedAdam is not compatible with this accelerator", allow_module_level=True)

LR = 1e-2


def _params(dtypes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    device = get_accelerator().device_name()
    # values well inside each dtype's grid, so that bf16 and fp16 show an update of a tenth of LR
    return [
        torch.nn.Parameter((1e-2 * torch.randn(16, generator=generator)).to(device=device, dtype=dtype))
        for dtype in dtypes
    ]


def _grads(params, step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator).to(p) for p in params]


def _reference(initial, grads_per_step):
    """Each parameter, from its ``initial`` value, stepped alone by torch's Adam in fp32 (AdamW without weight decay
    is Adam) with the gradients it got: None in a step where it had none."""
    result = []
    for index, value in enumerate(initial):
        copy = torch.nn.Parameter(value.float().cpu().clone())
        optimizer = torch.optim.AdamW([copy], lr=LR, weight_decay=0.0)
        for grads in grads_per_step:
            if grads[index] is None:
                continue
            copy.grad = grads[index].float().cpu()
            optimizer.step()
        result.append((copy.detach(), optimizer.state[copy]["step"].item()))
    return result


def _run(params, grads_per_step, saved=None):
    """A FusedAdam over ``params`` (loading ``saved``, a state_dict, where given) stepped with the gradients."""
    optimizer = FusedAdam(params, lr=LR, weight_decay=0.0)
    if saved is not None:
        optimizer.load_state_dict(saved)
    for grads in grads_per_step:
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
    return optimizer


def _check(initial, params, optimizer, grads_per_step):
    for index, (param, (want, steps)) in enumerate(zip(params, _reference(initial, grads_per_step))):
        assert optimizer.state[param]["step"] == steps, \
            f"parameter {index} ({param.dtype}): step {optimizer.state[param]['step']}, it took {steps}"
        tolerance = dict(rtol=1e-5, atol=1e-7) if param.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(param.detach().float().cpu(), want, **tolerance)


@pytest.mark.parametrize("dtypes", [
    [torch.float32] * 3,
    [torch.bfloat16, torch.float32, torch.float32],
    [torch.float16, torch.bfloat16, torch.float32],
],
                         ids=["fp32", "bf16+fp32", "fp16+bf16+fp32"])
def test_each_parameter_counts_its_steps(dtypes):
    """Three steps of a param group of several parameters, of one dtype or several: each parameter's step is 3 and
    its value is Adam's with its own count (0.19.8: steps [0, 0, 3] for one dtype, [0, 0, 6] for two)."""
    params = _params(dtypes)
    grads_per_step = [_grads(params, step) for step in range(3)]
    initial = [p.detach().clone() for p in params]
    optimizer = _run(params, grads_per_step)
    _check(initial, params, optimizer, grads_per_step)


def test_parameter_without_gradient_keeps_its_count():
    """A parameter without a gradient in the first step takes one step less, and is updated with its own count
    (0.19.8 updated it with the last parameter's)."""
    params = _params([torch.float32] * 3)
    grads_per_step = [_grads(params, step) for step in range(3)]
    grads_per_step[0][0] = None
    initial = [p.detach().clone() for p in params]
    optimizer = _run(params, grads_per_step)
    _check(initial, params, optimizer, grads_per_step)


def test_state_dict_keeps_each_count():
    """The saved state holds each parameter's count (``step`` an int, as before), and a new optimizer loading it
    continues as the one that saved it."""
    params = _params([torch.float32] * 3)
    grads_per_step = [_grads(params, step) for step in range(4)]
    grads_per_step[0][1] = None
    initial = [p.detach().clone() for p in params]
    optimizer = _run(params, grads_per_step[:2])
    saved = optimizer.state_dict()
    assert [saved["state"][index]["step"] for index in range(3)] == [2, 1, 2]
    assert all(type(state["step"]) is int for state in saved["state"].values())
    _check(initial, params, _run(params, grads_per_step[2:], saved), grads_per_step)


def test_one_launch_per_dtype():
    """Parameters that took as many steps are updated in one launch per dtype, as before."""
    params = _params([torch.bfloat16, torch.float32, torch.bfloat16, torch.float32])
    optimizer = FusedAdam(params, lr=LR, weight_decay=0.0)
    launches = []
    kernel = optimizer.multi_tensor_adam

    def counting(*args):
        launches.append(args)
        return kernel(*args)

    optimizer.multi_tensor_adam = counting
    for step in range(2):
        for param, grad in zip(params, _grads(params, step)):
            param.grad = grad
        optimizer.step()
    assert len(launches) == 4, f"{len(launches)} launches in 2 steps of 2 dtypes"


def test_state_saved_by_the_group_counter_resumes():
    """A state saved when FusedAdam counted a param group's steps in its last parameter only (the others at 0)
    resumes with the group's count for every parameter, as that version updated them: after 2 more steps each
    parameter's step is 4 and its value Adam's over the 4 steps."""
    params = _params([torch.float32] * 3)
    grads_per_step = [_grads(params, step) for step in range(4)]
    initial = [p.detach().clone() for p in params]
    optimizer = _run(params, grads_per_step[:2])
    saved = optimizer.state_dict()
    for index in range(2):  # as DeepSpeed 0.19.8's FusedAdam saved it
        saved["state"][index]["step"] = 0
    _check(initial, params, _run(params, grads_per_step[2:], saved), grads_per_step)
