# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""pytest configuration for tests/ (run as ``cd tests && pytest unit``, DS_ACCELERATOR=cpu)."""

import os
import sys

# Test modules import the harness as `unit.common`; make that work for every import mode and for the spawned rank
# processes, which inherit sys.path.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# The DistributedTest hooks (world_size cases, running methods on the ranks).
pytest_plugins = ["unit.common"]


def pytest_addoption(parser):
    parser.addoption("--pull-request",
                     type=int,
                     default=None,
                     help="run only the tests of this pull request of patches/series (tests/pull_requests.py)")


def pytest_collection_modifyitems(config, items):
    pull_request = config.getoption("--pull-request")
    if pull_request is None:
        return
    from pull_requests import pull_request_of
    selected = [item for item in items if pull_request_of(item.nodeid) == pull_request]
    config.hook.pytest_deselected(items=[item for item in items if item not in selected])
    items[:] = selected
