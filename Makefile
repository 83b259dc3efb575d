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

.PHONY: help test test-fast demo plan bootstrap mcts augment prm gfn ppo eval search bench export-trl prm-bench clean-venv

help:
	@echo "make demo | make test | make plan | make bootstrap mcts augment prm gfn ppo eval search bench export-trl  (CONFIG=$(CONFIG) RUN=$(RUN) ARGS='key=value ...')"

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),) "$(TORCH_SPEC)"
	$(PY) -m pip install $(PIP_C) -e '.[dev]'
	touch $@

$(VENV): $(VENV)/.installed

test: $(VENV)
	$(PY) -m pytest -q

test-fast: $(VENV)
	$(PY) -m pytest -q -m "not slow"

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

bench: $(VENV)
	$(STAGE).bench --config $(CONFIG) run=bench $(ARGS)

demo: $(VENV)
	$(STAGE).demo --config $(CONFIG) run=$(RUN) $(ARGS)

clean-venv:
	rm -rf $(VENV)
