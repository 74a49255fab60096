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
