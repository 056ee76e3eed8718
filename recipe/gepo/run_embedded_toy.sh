#!/usr/bin/env bash
# GEPO on the embedded engine (hetero.engine=embedded), on a CPU: the project's ~1M-parameter toy Llama
# on 3-digit addition, one learner and sampler actors on Ray whose weights arrive after a delay
# (async mode), or the deterministic stale-buffer emulation in one process (MODE=replay).
# The same run as `make demo`, with every knob in sight; no GPU, no verl worker.
#   bash recipe/gepo/run_embedded_toy.sh [hydra overrides ...]
# Edit the variables below (or set them in the environment); extra arguments are hydra overrides
# and win over everything. A copy of this recipe folder runs its own code (README "Copy and edit").
set -euo pipefail

# this recipe: its folder, the repository root above it, and its package name (recipe.<folder>)
RECIPE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$RECIPE_DIR/../.." && pwd)
RECIPE=recipe.$(basename "$RECIPE_DIR")
# the interpreter with the project installed (default: the repository's .venv, else python3)
PYTHON=${PYTHON:-$( [[ -x "$REPO_ROOT/.venv/bin/python" ]] && echo "$REPO_ROOT/.venv/bin/python" || echo python3 )}

# ---- model and data (the embedded engine's data come from the task: section)
# local HF folder; empty = the toy task's pinned warm start (cached under .cache/heterorl)
MODEL_PATH=${MODEL_PATH:-}
# toy_addition operand digits (the pinned warm start is for 3)
DIGITS=${DIGITS:-3}
# held-out prompts per evaluation
EVAL_SIZE=${EVAL_SIZE:-256}

# ---- batch, group and lengths
# prompts per learner step (one full-batch update per step)
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-8}
# G: responses per prompt (the group GEPO's denominator is taken over)
N_RESP_PER_PROMPT=${N_RESP_PER_PROMPT:-8}
# response token budget (toy answers: 3-4 digits + </s>)
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-8}
# sampling temperature
TEMPERATURE=${TEMPERATURE:-1.0}

# ---- algorithm
# loss preset: gepo | grpo | gspo | dr_grpo | ... (recipe/gepo/config/algorithm_preset/)
ALGORITHM=${ALGORITHM:-gepo}
# PPO clip range; empty = the preset's own (gepo: 0.2 / 0.2)
CLIP_RATIO_LOW=${CLIP_RATIO_LOW:-}
CLIP_RATIO_HIGH=${CLIP_RATIO_HIGH:-}
# learning rate
LR=${LR:-1e-4}

# ---- heterogeneity
# async: real sampler actors on Ray; replay: deterministic emulation in one process
MODE=${MODE:-async}
# sampler actors (async)
NUM_SAMPLERS=${NUM_SAMPLERS:-2}
# delay model: none | constant | uniform | lognormal | weibull (hetero.delay.*); units: seconds in
# async mode, learner steps in replay mode
DELAY_DIST=${DELAY_DIST:-lognormal}
DELAY_LOW=${DELAY_LOW:-1.0}
DELAY_HIGH=${DELAY_HIGH:-8.0}
# staleness bound: the learner at version v trains only on groups from versions >= v - MAX_DELAY
MAX_DELAY=${MAX_DELAY:-8}
# root seed: model init, data order, delay draws
SEED=${SEED:-0}

# ---- run length, logging and output
TOTAL_STEPS=${TOTAL_STEPS:-100}
# evaluate / checkpoint every k steps (and before/after training / at the end)
TEST_FREQ=${TEST_FREQ:-20}
SAVE_FREQ=${SAVE_FREQ:-50}
# verl Tracking backends besides metrics.jsonl, e.g. '[console,tensorboard]'
LOGGER=${LOGGER:-[]}
PROJECT_NAME=${PROJECT_NAME:-heterorl}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-embedded_toy_${ALGORITHM}_${MODE}}
# metrics.jsonl, report.md, curves.png, checkpoints (relative paths: under the repository root)
RUN_DIR=${RUN_DIR:-runs/$EXPERIMENT_NAME}

# overrides given only when set (empty: the preset's value)
optional=()
if [[ -n "$CLIP_RATIO_LOW" ]]; then optional+=("actor_rollout_ref.actor.clip_ratio_low=$CLIP_RATIO_LOW"); fi
if [[ -n "$CLIP_RATIO_HIGH" ]]; then optional+=("actor_rollout_ref.actor.clip_ratio_high=$CLIP_RATIO_HIGH"); fi
# the number of samplers is an async-mode option (replay refuses it)
if [[ "$MODE" == async ]]; then optional+=("hetero.num_samplers=$NUM_SAMPLERS"); fi

cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this recipe, also in Ray's worker processes
exec "$PYTHON" -m "$RECIPE.main_gepo" \
    hetero.engine=embedded \
    "hetero.mode=$MODE" \
    "algorithm_preset=$ALGORITHM" \
    "actor_rollout_ref.model.path=$MODEL_PATH" \
    "task.digits=$DIGITS" \
    "task.eval_size=$EVAL_SIZE" \
    "data.train_batch_size=$TRAIN_BATCH_SIZE" \
    "data.max_response_length=$MAX_RESPONSE_LENGTH" \
    "actor_rollout_ref.rollout.n=$N_RESP_PER_PROMPT" \
    "actor_rollout_ref.rollout.temperature=$TEMPERATURE" \
    "actor_rollout_ref.actor.optim.lr=$LR" \
    "hetero.delay.dist=$DELAY_DIST" \
    "hetero.delay.low=$DELAY_LOW" \
    "hetero.delay.high=$DELAY_HIGH" \
    "hetero.max_delay=$MAX_DELAY" \
    "hetero.seed=$SEED" \
    "trainer.total_training_steps=$TOTAL_STEPS" \
    "trainer.test_freq=$TEST_FREQ" \
    "trainer.save_freq=$SAVE_FREQ" \
    "trainer.logger=$LOGGER" \
    "trainer.project_name=$PROJECT_NAME" \
    "trainer.experiment_name=$EXPERIMENT_NAME" \
    "trainer.default_local_dir=$RUN_DIR" \
    "${optional[@]}" "$@"
