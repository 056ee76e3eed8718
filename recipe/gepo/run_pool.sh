#!/usr/bin/env bash
# One sampler pool for a verl-engine learner fed through an exchange (hetero.engine=verl
# hetero.transport=fs): verl's rollout servers, reward loop and agent loop in this machine's own Ray
# cluster, weights in and signed rollout groups out through EXCHANGE_URL (README, "Samplers in
# another data centre"; docs/scale-out.md, "Sampler pools in other clusters").
#   EXCHANGE_URL=/shared/run42 bash recipe/gepo/run_pool.sh [the learner's hydra overrides ...]
# Give it the learner's own overrides (algorithm, delay, seed, max_delay, data): the pool draws its
# prompts, delays and staleness waits from them. It stops when the learner ends.
set -euo pipefail

# this recipe: its folder, the repository root above it, and its package name (recipe.<folder>)
RECIPE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$RECIPE_DIR/../.." && pwd)
RECIPE=recipe.$(basename "$RECIPE_DIR")
# the interpreter with the project installed (default: the repository's .venv, else python3)
PYTHON=${PYTHON:-$( [[ -x "$REPO_ROOT/.venv/bin/python" ]] && echo "$REPO_ROOT/.venv/bin/python" || echo python3 )}

# ---- where the learner is
# the learner's hetero.transport_url: a folder both reach, or s3://... (required)
EXCHANGE_URL=${EXCHANGE_URL:-}
# the learner's cluster preset (configs/verl_preset/); its rollout back end generates here
PRESET=${PRESET:-cpu_toy}

# ---- this pool
# its index in [1, 64): picks its prompt stream and delay stream; its key is pool-INDEX's
INDEX=${INDEX:-32}
# its signing key, made here on first use; the learner's operator enrols the printed public key
KEY_FILE=${KEY_FILE:-$HOME/.heterorl/keys/pool-$INDEX.key}
# emulate slower hardware: generation takes SPEED_FACTOR times as long (>= 1)
SPEED_FACTOR=${SPEED_FACTOR:-1.0}
# stop after this many batches (empty: at the learner's stop marker)
MAX_BATCHES=${MAX_BATCHES:-}

if [[ -z "$EXCHANGE_URL" ]]; then
    echo "error: EXCHANGE_URL is empty: give the learner's hetero.transport_url" >&2
    exit 2
fi
if [[ ! -f "$KEY_FILE" ]]; then
    mkdir -p "$(dirname "$KEY_FILE")"
    public=$("$PYTHON" -m verl_ext.trust.signing keygen "$KEY_FILE" "pool-$INDEX")
    echo "made $KEY_FILE; the learner's operator enrols it:" >&2
    echo "  python -m verl_ext.trust.signing enrol <hetero.trust.enrolment_file> pool-$INDEX $public" >&2
fi
optional=()
if [[ -n "$MAX_BATCHES" ]]; then optional+=(--max-batches "$MAX_BATCHES"); fi

cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this recipe, also in Ray's worker processes
exec "$PYTHON" -m "$RECIPE.pool" --index "$INDEX" --key "$KEY_FILE" --speed-factor "$SPEED_FACTOR" \
    "${optional[@]}" "+verl_preset=$PRESET" "hetero.transport_url=$EXCHANGE_URL" "$@"
