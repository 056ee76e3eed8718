#!/usr/bin/env bash
# GEPO on verl's own trainer (hetero.engine=verl), on a CPU-only machine, with a real pretrained LM:
# SmolLM2-135M-Instruct on the easiest GSM8K problems, FSDP2 learner over gloo, one hf_cpu sampler,
# weights delayed on their way to it (configs/verl_preset/cpu_smollm2_math.yaml underneath;
# docs/scale-out.md "A real pretrained LM"). ~15 GB of memory, start-up ~1.5 min, ~1.5 min a step
# on 2 cores. The model is converted once (~30 s) on first use, or ahead with
# `python -m verl_ext.data.smollm2`.
#   bash recipe/gepo/run_cpu_smollm2.sh [hydra overrides ...]
# Edit the variables below (or set them in the environment); extra arguments are hydra overrides
# and win over everything. A copy of this recipe folder runs its own code (README "Copy and edit").
set -euo pipefail

# this recipe: its folder, the repository root above it, and its package name (recipe.<folder>)
RECIPE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$RECIPE_DIR/../.." && pwd)
RECIPE=recipe.$(basename "$RECIPE_DIR")
# the interpreter with the project installed (default: the repository's .venv, else python3)
PYTHON=${PYTHON:-$( [[ -x "$REPO_ROOT/.venv/bin/python" ]] && echo "$REPO_ROOT/.venv/bin/python" || echo python3 )}

# ---- model and data
# local HF folder; empty = SmolLM2-135M-Instruct (task.model), converted under .cache/heterorl
MODEL_PATH=${MODEL_PATH:-}
# parquet files in verl's RL format; empty = the easy GSM8K problems of the task: section,
# written under .cache/heterorl/verl_math
TRAIN_FILES=${TRAIN_FILES:-}
VAL_FILES=${VAL_FILES:-}

# ---- batch, group and lengths
# prompts per learner step (= parameter_sync_step x PPO_MINI_BATCH_SIZE)
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-4}
# G: responses per prompt (the group GEPO's denominator is taken over)
N_RESP_PER_PROMPT=${N_RESP_PER_PROMPT:-4}
# prompts per optimizer step
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-4}
# sequences per forward/backward on one learner rank (one group: logits are 330 MB)
MICRO_BATCH_PER_GPU=${MICRO_BATCH_PER_GPU:-4}
# token budgets of prompt (the one-shot chat prompt) and response
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-256}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-160}
# sampling temperature (measured: the most boxed answers at 0.5; research/study/smollm2_signal.py)
TEMPERATURE=${TEMPERATURE:-0.5}

# ---- algorithm
# loss preset: gepo | grpo | gspo | dr_grpo | ... (recipe/gepo/config/algorithm_preset/)
ALGORITHM=${ALGORITHM:-gepo}
# PPO clip range; empty = the preset's own (gepo: 0.2 / 0.2)
CLIP_RATIO_LOW=${CLIP_RATIO_LOW:-}
CLIP_RATIO_HIGH=${CLIP_RATIO_HIGH:-}
# learning rate
LR=${LR:-1e-5}

# ---- heterogeneity: the weights reach the sampler after a delay drawn per version (seconds)
# delay model: none | constant | uniform | lognormal | weibull (hetero.delay.*)
DELAY_DIST=${DELAY_DIST:-lognormal}
# lognormal: the (1-c)/2 and 1-(1-c)/2 quantiles and clip bounds, in seconds
DELAY_LOW=${DELAY_LOW:-1.0}
DELAY_HIGH=${DELAY_HIGH:-8.0}
# staleness bound: the learner at version v trains only on groups from versions >= v - MAX_DELAY
MAX_DELAY=${MAX_DELAY:-8}
# delayed weight versions the learner holds as snapshots until their release
KEEP_WEIGHT_VERSIONS=${KEEP_WEIGHT_VERSIONS:-4}
# root seed of the delay draws
SEED=${SEED:-0}

# ---- nodes and (logical) GPUs: on a CPU each "GPU" is one rank or sampler replica
LEARNER_NNODES=${LEARNER_NNODES:-1}
LEARNER_GPUS_PER_NODE=${LEARNER_GPUS_PER_NODE:-1}
SAMPLER_NNODES=${SAMPLER_NNODES:-1}
SAMPLER_GPUS_PER_NODE=${SAMPLER_GPUS_PER_NODE:-1}

# ---- run length, logging and output
TOTAL_STEPS=${TOTAL_STEPS:-30}
# evaluate / checkpoint every k steps (-1: never)
TEST_FREQ=${TEST_FREQ:--1}
SAVE_FREQ=${SAVE_FREQ:-5}
# verl Tracking backends, e.g. '[console,tensorboard]'
LOGGER=${LOGGER:-[console]}
PROJECT_NAME=${PROJECT_NAME:-heterorl}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-cpu_smollm2_${ALGORITHM}}
# metrics.jsonl, report.md, curves.png, checkpoints (relative paths: under the repository root)
RUN_DIR=${RUN_DIR:-runs/$EXPERIMENT_NAME}

# overrides given only when set (empty: the preset's value)
optional=()
if [[ -n "$CLIP_RATIO_LOW" ]]; then optional+=("actor_rollout_ref.actor.clip_ratio_low=$CLIP_RATIO_LOW"); fi
if [[ -n "$CLIP_RATIO_HIGH" ]]; then optional+=("actor_rollout_ref.actor.clip_ratio_high=$CLIP_RATIO_HIGH"); fi

cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this recipe, also in Ray's worker processes
exec "$PYTHON" -m "$RECIPE.main_gepo" --config-dir configs +verl_preset=cpu_smollm2_math \
    hetero.engine=verl \
    "algorithm_preset=$ALGORITHM" \
    "actor_rollout_ref.model.path=$MODEL_PATH" \
    "data.train_files=$TRAIN_FILES" \
    "data.val_files=$VAL_FILES" \
    "data.train_batch_size=$TRAIN_BATCH_SIZE" \
    "data.max_prompt_length=$MAX_PROMPT_LENGTH" \
    "data.max_response_length=$MAX_RESPONSE_LENGTH" \
    "actor_rollout_ref.rollout.n=$N_RESP_PER_PROMPT" \
    "actor_rollout_ref.rollout.temperature=$TEMPERATURE" \
    "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE" \
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH_PER_GPU" \
    "actor_rollout_ref.actor.optim.lr=$LR" \
    "hetero.delay.dist=$DELAY_DIST" \
    "hetero.delay.low=$DELAY_LOW" \
    "hetero.delay.high=$DELAY_HIGH" \
    "hetero.max_delay=$MAX_DELAY" \
    "hetero.keep_weight_versions=$KEEP_WEIGHT_VERSIONS" \
    "hetero.seed=$SEED" \
    "trainer.nnodes=$LEARNER_NNODES" \
    "trainer.n_gpus_per_node=$LEARNER_GPUS_PER_NODE" \
    "actor_rollout_ref.rollout.nnodes=$SAMPLER_NNODES" \
    "actor_rollout_ref.rollout.n_gpus_per_node=$SAMPLER_GPUS_PER_NODE" \
    "trainer.total_training_steps=$TOTAL_STEPS" \
    "trainer.test_freq=$TEST_FREQ" \
    "trainer.save_freq=$SAVE_FREQ" \
    "trainer.logger=$LOGGER" \
    "trainer.project_name=$PROJECT_NAME" \
    "trainer.experiment_name=$EXPERIMENT_NAME" \
    "trainer.default_local_dir=$RUN_DIR" \
    "${optional[@]}" "$@"
