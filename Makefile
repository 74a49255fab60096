# The project's commands. README.md says which to run; tools/ holds what they do.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export DS_ACCELERATOR ?= cpu
# A tag for the wheel's version: deepspeed-0.19.8+$(TAG).
TAG ?= keepfp32

.PHONY: setup refresh check test test-prs test-all test-pristine test-upstream gpu-check gpu-kit gpu-rehearse wheel demo bench study results clean

setup:
	@tools/setup

refresh:
	@tools/refresh

check:
	@tools/check

test: setup
	@tools/test $(ARGS)

# Each pull request's tests on its own tree (build/pr/N: pristine 0.19.8, the pull requests it applies on, itself).
test-prs: setup
	@set -e; for n in $$(grep -c '^# Pull request' patches/series | xargs seq); do tools/test --pr $$n $(ARGS); done

test-all: setup
	@tools/test --all $(ARGS)

test-pristine: setup
	@tools/test --pristine $(ARGS)

# Upstream DeepSpeed's own tests against stock 0.19.8 and the series (UPSTREAM=path to a DeepSpeed tests/ tree).
test-upstream: setup
	@tools/test-upstream $(ARGS)

# The GPU check (CUDA when present; DS_ACCELERATOR=cpu runs it on the CPU, as CI does in its short form).
gpu-check: setup
	@tools/gpu-check $(ARGS)

# What the GPU machine (no network) installs from: build/gpu-kit; carry it there and run `bash tools/gpu-run`.
gpu-kit: setup
	@tools/gpu-kit

# tools/gpu-run here as the GPU machine runs it: offline, from the tracked files and the kit, on the CPU (CI).
gpu-rehearse: gpu-kit
	@tools/gpu-rehearse $(ARGS)

wheel: setup
	@tools/wheel $(TAG)

demo: setup
	@$(PY) examples/demo.py $(ARGS)

bench: setup
	@$(PY) benchmarks/run.py $(ARGS)

study: setup
	@$(PY) benchmarks/accuracy_study.py $(ARGS)

# Rerun every figure of docs/results.md on the dev tree and rewrite the page (ARGS: parts, e.g. "compare memory").
results: setup
	@$(PY) tools/results $(ARGS)

clean:
	rm -rf build/pristine dist out
