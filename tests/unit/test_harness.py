# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tests of the DistributedTest harness in unit/common.py.

The classes here run on the ranks directly; the failure and timeout cases run in a nested pytest on a generated test
file, whose outcome is checked from outside (those inner tests are meant to fail).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestRanks(DistributedTest):
    world_size = [1, 2]

    def test_environment_and_all_reduce(self):
        n, rank = dist.get_world_size(), dist.get_rank()
        assert n == self.world_size
        assert rank == int(os.environ["RANK"]) == int(os.environ["LOCAL_RANK"])
        assert os.environ["WORLD_SIZE"] == os.environ["LOCAL_SIZE"] == str(n)
        assert os.environ["DS_ACCELERATOR"] == "cpu"
        # the CPU and gloo, unless tools/gpu-check's plugin started the ranks on CUDA with NCCL
        device = os.environ.get("GPU_CHECK_ACCELERATOR", "cpu")
        accelerator = get_accelerator()
        assert accelerator.device_name() == device
        if device == "cpu":
            assert accelerator.device_count() == n
        else:
            assert accelerator.device_count() >= n
        assert torch.distributed.get_backend() == {"cpu": "gloo", "cuda": "nccl"}[device]
        t = torch.tensor([rank + 1.0, 10.0], device=accelerator.current_device_name())
        dist.all_reduce(t)
        assert t.tolist() == [n * (n + 1) / 2, 10.0 * n]

    @pytest.mark.parametrize("world_size", [1])
    def test_method_overrides_world_size(self, world_size):
        assert dist.get_world_size() == world_size == self.world_size == 1


class TestParametrizeAndTmpdir(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("value", [7, "seven"])
    def test_arguments_reach_all_ranks(self, value, tmpdir, tmp_path):
        rank = dist.get_rank()
        assert value in (7, "seven")
        assert str(tmpdir) == str(tmp_path)
        tmpdir.join(f"rank{rank}.txt").write(f"{value!r} {tmp_path}")
        dist.barrier()
        # Both ranks wrote into the one folder the pytest process created.
        assert sorted(os.listdir(tmp_path)) == ["rank0.txt", "rank1.txt"]
        assert {(tmp_path / f).read_text() for f in os.listdir(tmp_path)} == {f"{value!r} {tmp_path}"}


INNER_TESTS = '''
import os
import time

import pytest
import deepspeed.comm as dist
from unit.common import DistributedTest

PID_DIR = {pid_dir!r}


class TestInnerPasses(DistributedTest):
    world_size = [1, 2]

    def test_passes(self):
        assert dist.get_world_size() == self.world_size


class TestInnerRankOneFails(DistributedTest):
    world_size = 2

    def test_rank_one_fails(self):
        print(f"stdout of rank {{dist.get_rank()}}")
        x = dist.get_rank()
        assert x != 1, "INNER-FAILURE on rank one"


class TestInnerHangs(DistributedTest):
    world_size = 2
    timeout = 15

    def test_hangs(self):
        with open(os.path.join(PID_DIR, f"pid{{dist.get_rank()}}"), "w") as f:
            f.write(str(os.getpid()))
        if dist.get_rank() == 1:
            time.sleep(3600)  # rank 0 waits for it at the closing barrier


class TestInnerSkips(DistributedTest):
    world_size = 1

    def test_skips(self):
        pytest.skip("INNER-SKIP")


class TestInnerUnpicklable(DistributedTest):

    def test_takes_request(self, request):
        pass
'''


@pytest.fixture(scope="module")
def inner_run(tmp_path_factory):
    """Run pytest on a generated file of distributed tests that pass, fail, hang; return (returncode, output)."""
    work = tmp_path_factory.mktemp("inner")
    pid_dir = work / "pids"
    pid_dir.mkdir()
    (work / "test_inner.py").write_text(INNER_TESTS.format(pid_dir=str(pid_dir)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))
    env.pop("DS_TEST_TIMEOUT", None)
    cmd = [
        sys.executable, "-m", "pytest", "-v", "-p", "unit.common", "--noconftest", "-p", "no:cacheprovider",
        f"--basetemp={work / 'basetemp'}", "test_inner.py"
    ]
    proc = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout, pid_dir


def _section(output, test_name):
    """The failure report of one inner test."""
    start = output.index(f"_ {test_name} _")
    end = output.find("\n_____", start + 1)
    return output[start:end if end != -1 else None]


def test_inner_outcomes(inner_run):
    returncode, output, _ = inner_run
    assert returncode == 1, output
    expected = {
        "TestInnerPasses::test_passes[world_size=1]": "PASSED",
        "TestInnerPasses::test_passes[world_size=2]": "PASSED",
        "TestInnerRankOneFails::test_rank_one_fails": "FAILED",
        "TestInnerHangs::test_hangs": "FAILED",
        "TestInnerSkips::test_skips": "SKIPPED",
        "TestInnerUnpicklable::test_takes_request": "FAILED",
    }
    for test, outcome in expected.items():
        assert f"test_inner.py::{test} {outcome}" in output, output
    assert "3 failed, 2 passed, 1 skipped in" in output, output


def test_failure_on_one_rank_is_reported(inner_run):
    _, output, _ = inner_run
    report = _section(output, "TestInnerRankOneFails.test_rank_one_fails")
    assert "rank 1 failed" in report, report
    assert "Traceback (most recent call last):" in report, report
    assert 'assert x != 1, "INNER-FAILURE on rank one"' in report, report
    assert "AssertionError: INNER-FAILURE on rank one" in report, report
    if "rank 0 failed" in report:  # rank 0 fails too, at the closing barrier, once rank 1 is gone
        assert "rank 1 failed first" in report and report.index("rank 1") < report.index("rank 0"), report
    assert "stdout of rank 1" in report, report  # the ranks' output is shown with the failure


def test_hang_is_a_timeout_failure(inner_run):
    _, output, pid_dir = inner_run
    report = _section(output, "TestInnerHangs.test_hangs")
    assert "timed out after" in report and "timeout=15 s" in report, report
    assert "ranks [0, 1] killed" in report or "ranks [1] killed" in report, report
    pids = [int((pid_dir / f"pid{rank}").read_text()) for rank in range(2)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_unpicklable_argument_is_reported(inner_run):
    _, output, _ = inner_run
    report = _section(output, "TestInnerUnpicklable.test_takes_request")
    assert "argument 'request' cannot be pickled" in report, report


def test_a_port_taken_before_rank_0_binds_it_is_replaced(monkeypatch):
    """The free port the harness finds can be taken by another test process before rank 0 binds it (tests run side
    by side, as tools/gpu-check runs them): the run is started again on another port."""
    import socket
    from unit import common
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        free_port = common._free_port
        monkeypatch.setattr(common, "_free_port", lambda: ports.pop() if ports else free_port())
        common.run_distributed(TestRanks, "test_environment_and_all_reduce", 2)
        assert not ports, "the taken port was not tried"
