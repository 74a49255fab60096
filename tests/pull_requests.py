# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which pull request of patches/series each test belongs to, so that each pull request's tests run on its own tree
(pristine 0.19.8 with only the pull requests it applies on, and itself): ``pytest --pull-request N`` selects them,
``tools/test --pr N`` builds that tree and runs them there.

A test file belongs to the pull request that adds it (FILES). The files that run every stage (a case per stage)
belong to the ZeRO-3 pull request, and each later pull request adds its stage's cases: a case whose id names a
stage (STAGES) belongs to that stage's pull request. A few tests of a file test another pull request's change
(TESTS, by the start of their node id)."""

import re

ZERO3, PEFT, PARAM_OFFLOAD, ZERO12, BF16_OPTIMIZER, NO_ZERO, HPZ, NVME_OFFLOAD, MUON, FUSED_ADAM = 3, 4, 5, 6, 7, 8, 9, 10, 11, 12

FILES = {
    "unit/checkpoint/test_convert_checkpoint.py": 1,
    "unit/runtime/zero/test_zero_hp_links.py": 2,
    "unit/ops/adam/test_fused_adam_steps.py": FUSED_ADAM,
    "unit/v1/half_precision/test_keep_in_fp32_modules.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_neighbours.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_transformers.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_zero3_load.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_offload_states.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_features.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_stages.py": ZERO3,
    "unit/checkpoint/test_keep_in_fp32_checkpoints.py": ZERO3,
    "unit/checkpoint/test_keep_in_fp32_resume.py": ZERO3,
    "unit/checkpoint/test_keep_in_fp32_zero3_remap.py": ZERO3,
    "unit/checkpoint/test_keep_in_fp32_read_own_share.py": ZERO12,
    "unit/checkpoint/test_checkpoint_conformance.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_trainer.py": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_peft.py": PEFT,
    "unit/v1/half_precision/test_keep_in_fp32_param_offload.py": PARAM_OFFLOAD,
    "unit/v1/half_precision/test_keep_in_fp32_zero12.py": ZERO12,
    "unit/v1/half_precision/test_keep_in_fp32_zero0.py": NO_ZERO,
    "unit/v1/half_precision/test_keep_in_fp32_zeropp.py": HPZ,
    "unit/v1/half_precision/test_keep_in_fp32_nvme.py": NVME_OFFLOAD,
    "unit/v1/half_precision/test_keep_in_fp32_muon.py": MUON,
}

# The stage a case's id starts with (its first "-"-separated part), in the order they are tried.
STAGES = [
    (r"(zero1_)?bf16_optimizer", BF16_OPTIMIZER),
    (r"zero0", NO_ZERO),
    (r"zero3_offload", PARAM_OFFLOAD),
    (r"zero[12]", ZERO12),
    (r"zero3", ZERO3),
]

# The files that hold cases of several pull requests (by stage, or in TESTS): each pull request from the one they
# belong to on runs them.
MIXED = [
    "unit/runtime/zero/test_zero_hp_links.py",
    "unit/v1/half_precision/test_keep_in_fp32_modules.py",
    "unit/v1/half_precision/test_keep_in_fp32_features.py",
    "unit/v1/half_precision/test_keep_in_fp32_stages.py",
    "unit/checkpoint/test_keep_in_fp32_checkpoints.py",
    "unit/checkpoint/test_keep_in_fp32_resume.py",
    "unit/checkpoint/test_checkpoint_conformance.py",
    "unit/v1/half_precision/test_keep_in_fp32_trainer.py",
]

TESTS = {
    # the conformance matrix's Muon column: its ZeRO-1/2/3 cells test the Muon pull request (which applies on those
    # of the stages); its other cells go by their row (STAGES). FusedAdam's cells of ZeRO-0/1/2 and the BF16
    # optimizer need FusedAdam's steps per parameter (pull request 12), on which those rows' pull requests apply.
    "unit/checkpoint/test_checkpoint_conformance.py::TestCheckpointConformance::test_cell[zero1-muon-": MUON,
    "unit/checkpoint/test_checkpoint_conformance.py::TestCheckpointConformance::test_cell[zero2-muon-": MUON,
    "unit/checkpoint/test_checkpoint_conformance.py::TestCheckpointConformance::test_cell[zero3-muon-": MUON,
    # cases whose id names no stage
    "unit/v1/half_precision/test_keep_in_fp32_peft.py::TestLoraOnListedRouter::test_base_layer_kept_and_exported_exactly[2]":
    ZERO12,
    "unit/checkpoint/test_keep_in_fp32_checkpoints.py::TestUniversalResumeReadsOwnShare": ZERO12,
    "unit/checkpoint/test_keep_in_fp32_checkpoints.py::TestUpgradeFromPristineRoundRobin": ZERO12,
    # the stock bug that pull request 3 fixes first: kept sub-groups reach it by default
    "unit/runtime/zero/test_zero_hp_links.py::TestZeRO3UniversalStepPerSubGroup": ZERO3,
    "unit/v1/half_precision/test_keep_in_fp32_zero0.py::TestBf16OptimizerCrossLayout": BF16_OPTIMIZER,
    # the rows of the engine's feature table that the ZeRO-1/2 and the no-ZeRO pull requests add
    "unit/v1/half_precision/test_keep_in_fp32_features.py::TestFeaturesThatRoundKeptParams::test_explicit_list_is_refused_naming_both_ways_out[elastic_checkpoint]":
    ZERO12,
    "unit/v1/half_precision/test_keep_in_fp32_features.py::TestFeaturesThatRoundKeptParams::test_auto_trains_as_before_with_one_warning[elastic_checkpoint]":
    ZERO12,
    "unit/v1/half_precision/test_keep_in_fp32_features.py::TestKeptExpertParams": ZERO12,
    "unit/v1/half_precision/test_keep_in_fp32_modules.py::TestBadInput::test_whether_parameters_are_kept_is_decided_at_initialize":
    NO_ZERO,
    "unit/v1/half_precision/test_keep_in_fp32_features.py::TestFeaturesThatRoundKeptParams::test_explicit_list_is_refused_naming_both_ways_out[legacy_fusion without ZeRO]":
    NO_ZERO,
    "unit/v1/half_precision/test_keep_in_fp32_features.py::TestFeaturesThatRoundKeptParams::test_auto_trains_as_before_with_one_warning[legacy_fusion without ZeRO]":
    NO_ZERO,
    "unit/v1/half_precision/test_keep_in_fp32_features.py::TestFeaturesThatRoundKeptParams::test_explicit_list_is_refused_naming_both_ways_out[FusedLamb without ZeRO]":
    NO_ZERO,
    "unit/v1/half_precision/test_keep_in_fp32_features.py::TestFeaturesThatRoundKeptParams::test_auto_trains_as_before_with_one_warning[FusedLamb without ZeRO]":
    NO_ZERO,
}


def pull_request_of(nodeid):
    """The pull request the test ``nodeid`` (relative to tests/) belongs to, or None (the harness's own tests)."""
    for prefix, pull_request in TESTS.items():
        if nodeid.startswith(prefix):
            return pull_request
    path = nodeid.split("::")[0]
    if path not in FILES:
        return None
    case = re.search(r"\[([^\]]*)\]$", nodeid)
    if case:
        first = case.group(1).split("-")[0]
        for stage, pull_request in STAGES:
            if re.match(stage, first):
                return pull_request
    return FILES[path]


def files_of(pull_request):
    """The test files that hold tests of ``pull_request`` (its own, and the files of several pull requests)."""
    return [path for path, owner in FILES.items() if owner == pull_request or (path in MIXED and owner < pull_request)]
