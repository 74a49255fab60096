# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A small harness for multi-process tests on the CPU (DS_ACCELERATOR=cpu, gloo).

Subclass ``DistributedTest``; each of its test methods then runs on every rank, each rank in a fresh process
forked from a server that has imported torch, deepspeed and transformers (multiprocessing's 'forkserver'), after
``deepspeed.init_distributed`` has set up the process group::

    class TestAllReduce(DistributedTest):
        world_size = [1, 2]      # an int, or a list: one test case per size, ids like [world_size=2]
        timeout = 120            # seconds for the whole run (DS_TEST_TIMEOUT in the environment overrides)

        @pytest.mark.parametrize("value", [1.0, 2.5])
        def test_sum(self, value, tmp_path):
            ...                  # self.world_size is the size of this case

Arguments of a test method (parametrize values, fixtures such as ``tmpdir`` and ``tmp_path``) are resolved in the
pytest process and pickled to the ranks, so all ranks share the same temporary folder; setup_method and fixtures
run in the pytest process. A method may also take ``@pytest.mark.parametrize("world_size", [...])`` itself, which
replaces the class's sizes.

Rank processes see RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE (the CPU accelerator's device count), MASTER_ADDR and
MASTER_PORT (a free port per test); after the method they meet at a barrier and destroy the process group. A failure
on any rank fails the test with that rank's traceback. A run that outlives the timeout is killed and fails, with the
ranks' stacks in the captured stderr. ``pytest.skip`` on the ranks skips the test. The ranks' stdout and stderr go
to pytest's capture, shown with a failure.

The pytest hooks at the bottom are registered by tests/conftest.py (``pytest_plugins``), or with ``-p unit.common``.
"""

import faulthandler
import glob
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

import pytest

TIMEOUT_ENV = "DS_TEST_TIMEOUT"
PORT_ATTEMPTS = 3  # a run whose rendezvous port was taken in the meantime is started again on another
START_METHOD_ENV = "DS_TEST_START_METHOD"  # "spawn" starts every rank afresh (tools/gpu-check does on CUDA)
GRACE_AFTER_FAILURE = 5  # seconds the other ranks get to finish once one rank has failed


class DistributedTest:
    """Base class: every test method runs on ``world_size`` ranks in fresh processes."""
    world_size = 2
    timeout = 600
    backend = "gloo"


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(payload, rank, world_size, port, backend, conn):
    """Entry point of a rank process: set up the environment and process group, run the method, report."""
    os.setpgrp()  # own process group, so the parent can kill anything this rank starts
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before killing a hang
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # several ranks share few cores
    try:
        cls, name, kwargs = pickle.loads(payload)  # imports the test module here, after the environment is set
        import deepspeed
        import deepspeed.comm as dist
        deepspeed.init_distributed(dist_backend=backend)
        instance = cls()
        instance.world_size = world_size
        try:
            getattr(instance, name)(**kwargs)
            outcome, text = "passed", None
        except pytest.skip.Exception as e:
            outcome, text = "skipped", e.msg
        dist.barrier()
        dist.destroy_process_group()
        report = (outcome, time.time(), text)
    except BaseException:
        report = ("failed", time.time(), traceback.format_exc())
    conn.send(report)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown, which takes seconds once torch and deepspeed are loaded


def _stop(procs, wait_s=0, dump_stacks=False):
    """Give the ranks ``wait_s`` seconds to exit, then kill them (and whatever they started)."""
    end = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0, end - time.monotonic()))
    for rank, p in enumerate(procs):
        if dump_stacks and p.is_alive():
            print(f"---------- stacks of rank {rank} (pid {p.pid}) ----------", file=sys.stderr, flush=True)
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.5)
    for p in procs:
        if p.is_alive():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet in its own process group
                pass
            p.kill()
            p.join(10)


def _remove_shm_buffers(port):
    """Remove the shared-memory buffers of DeepSpeed's CPU comm op for the run on ``port``.

    The op creates one per rank in /dev/shm and never removes it (66 MiB each): a suite of a hundred runs would fill
    /dev/shm.
    """
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _context():
    """Start ranks from a fork server that has imported torch, deepspeed and transformers once.

    A rank then starts in well under a second instead of re-importing them (5-8 s of CPU per rank); the server
    is started with this process's sys.path and environment, and imports nothing that starts threads.
    $DS_TEST_START_METHOD=spawn starts each rank afresh instead (for an accelerator other than the CPU's, which a
    rank must choose before deepspeed is imported).
    """
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    ctx = multiprocessing.get_context(method)
    if method != "forkserver":
        return ctx
    ctx.set_forkserver_preload([
        "torch", "deepspeed", "deepspeed.comm", "transformers", "transformers.modeling_utils"
    ])
    return ctx


def _launch(ctx, payload, cls, world_size, timeout, label):
    """Start the ranks on a free port and collect their reports: (reports by rank, ranks that never reported, s)."""
    port = _free_port()
    procs, readers = [], {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(payload, rank, world_size, port, cls.backend, writer),
                            name=f"{label}[rank {rank}]")
            p.start()
            writer.close()  # our copy: the reader sees EOF if the rank dies without reporting
            procs.append(p)
            readers[reader] = rank

        start = time.monotonic()
        deadline = start + timeout
        reports = {}  # rank -> (outcome, time, traceback or skip message)
        while len(reports) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for reader in wait(list(readers), timeout=remaining):
                rank = readers.pop(reader)
                try:
                    reports[rank] = reader.recv()
                except EOFError:
                    procs[rank].join(5)
                    reports[rank] = ("failed", time.time(),
                                     f"rank process exited with code {procs[rank].exitcode} without reporting "
                                     "(see the captured stderr)")
                if reports[rank][0] == "failed":  # the others may now wait for it forever: give them a moment
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
        elapsed = time.monotonic() - start
        missing = sorted(set(range(world_size)) - set(reports))
        _stop(procs, wait_s=0 if missing else 10, dump_stacks=bool(missing))
    finally:
        _stop(procs)
        _remove_shm_buffers(port)
    return reports, missing, elapsed


def run_distributed(cls, name, world_size, kwargs=None, timeout=None, label=None):
    """Run ``cls().<name>(**kwargs)`` on ``world_size`` ranks; ``pytest.fail`` if a rank fails or time runs out.

    ``timeout`` (seconds) defaults to $DS_TEST_TIMEOUT, else ``cls.timeout``. ``pytest.skip`` on the ranks skips.
    """
    kwargs = kwargs or {}
    label = label or f"{cls.__name__}.{name}"
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV) or cls.timeout)
    for key, value in kwargs.items():
        try:
            pickle.dumps(value)
            error = None
        except Exception as e:
            error = e
        if error is not None:
            pytest.fail(f"{label}: argument {key!r} cannot be pickled for the rank processes: {error!r}",
                        pytrace=False)
    payload = pickle.dumps((cls, name, kwargs))

    ctx = _context()
    for attempt in range(PORT_ATTEMPTS):
        reports, missing, elapsed = _launch(ctx, payload, cls, world_size, timeout, label)
        # the free port _free_port found was taken before rank 0 bound it (tests run side by side): again, elsewhere
        if not any(outcome == "failed" and ("EADDRINUSE" in text or "Address already in use" in text)
                   for outcome, _, text in reports.values()):
            break
        print(f"{label}: its rendezvous port was taken before rank 0 bound it; starting it again", file=sys.stderr)

    failed = sorted((t, rank, text) for rank, (outcome, t, text) in reports.items() if outcome == "failed")
    skipped = {rank: text for rank, (outcome, _, text) in reports.items() if outcome == "skipped"}
    if not failed and not missing:
        if skipped:
            pytest.skip(f"skipped on ranks {sorted(skipped)}: {next(iter(skipped.values()))}")
        return
    lines = [f"{label} (world_size={world_size}) failed:"]
    for i, (_, rank, text) in enumerate(failed):  # in the order the failures happened
        first = " first" if i == 0 and len(failed) > 1 else ""
        lines += [f"---------- rank {rank} failed{first} ----------", text.rstrip()]
    if missing and failed:
        lines.append(f"---------- ranks {missing} were still running {GRACE_AFTER_FAILURE} s after the failure; "
                     "killed, their stacks are in the captured stderr ----------")
    elif missing:
        lines.append(f"---------- timed out after {elapsed:.0f} s (timeout={timeout:g} s, set by the class's "
                     f"`timeout` or ${TIMEOUT_ENV}); ranks {missing} killed, their stacks are in the captured "
                     "stderr ----------")
    pytest.fail("\n".join(lines), pytrace=False)


def _is_distributed(cls):
    return isinstance(cls, type) and issubclass(cls, DistributedTest)


def _parametrizes_world_size(definition):
    for mark in definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "world_size" in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    """A list as the class's ``world_size`` makes one case per size."""
    sizes = getattr(metafunc.cls, "world_size", None)
    if not _is_distributed(metafunc.cls) or isinstance(sizes, int) or _parametrizes_world_size(metafunc.definition):
        return
    if "world_size" not in metafunc.fixturenames:
        metafunc.fixturenames.append("world_size")
    metafunc.parametrize("world_size", list(sizes), ids=[f"world_size={n}" for n in sizes])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run the methods of DistributedTest classes on the ranks instead of in the pytest process."""
    cls = pyfuncitem.cls
    if not _is_distributed(cls):
        return None
    params = getattr(pyfuncitem, "callspec", None)
    params = params.params if params is not None else {}
    world_size = params.get("world_size", cls.world_size)
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_distributed(cls, pyfuncitem.originalname, world_size, kwargs, label=pyfuncitem.nodeid)
    return True
