#!/usr/bin/env bash
# Behaviour-preservation check for refactors: three short replay runs (default gepo with the E[A]
# diagnostic, gspo + log-normal delay, grpo + token TIS + Weibull delay) on a base revision and on
# the working tree, metrics.jsonl compared row by row with the timing keys (perf/*, hetero/wait_s)
# removed. Usage: scripts/dev/replay_identity.sh [BASE_REV=HEAD~1]   (~4 min on 2 cores)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BASE_REV=${1:-HEAD~1}
PY=$REPO/.venv/bin/python
WORK=$(mktemp -d /tmp/replay-identity.XXXX)
trap 'git -C "$REPO" worktree remove --force "$WORK/base" >/dev/null 2>&1 || true' EXIT
git -C "$REPO" worktree add --detach "$WORK/base" "$BASE_REV" >/dev/null
COMMON=(hetero.mode=replay trainer.total_training_steps=24 trainer.test_freq=8 trainer.save_freq=12
        task.warm_start_steps=210 task.cache_dir="$WORK/cache" task.eval_size=64 task.answer_format=scratchpad
        data.max_response_length=24 trainer.resume_mode=disable)
runs() {  # runs <source tree> <out dir>
  (cd "$1" && export PYTHONPATH="$1" OMP_NUM_THREADS=1
   # the installed verl.plugins entry points name the working tree's modules; a base from before
   # the verl_plugin split registers its losses when the config imports verl_ext.verl_plugin
   if [ -f "$1/verl_ext/verl_plugin.py" ]; then export VERL_USE_EXTERNAL_PLUGINS=none; fi
   "$PY" -m recipe.gepo.main_gepo "${COMMON[@]}" algorithm_preset=gepo task.diagnostics_every=8 \
       task.diagnostics_samples=8 trainer.default_local_dir="$2/gepo" >"$2.gepo.log" 2>&1
   "$PY" -m recipe.gepo.main_gepo "${COMMON[@]}" algorithm_preset=gspo hetero.delay.dist=lognormal \
       hetero.delay.low=1 hetero.delay.high=6 trainer.default_local_dir="$2/gspo_logn" >"$2.gspo.log" 2>&1
   "$PY" -m recipe.gepo.main_gepo "${COMMON[@]}" algorithm_preset=grpo hetero.delay.dist=weibull \
       hetero.delay.low=1 hetero.delay.high=6 algorithm.rollout_correction.rollout_is=token \
       algorithm.rollout_correction.rollout_is_threshold=2.0 trainer.default_local_dir="$2/grpo_tis_weibull" \
       >"$2.grpo.log" 2>&1)
}
runs "$WORK/base" "$WORK/before"
runs "$REPO" "$WORK/after"
"$PY" - "$WORK/before" "$WORK/after" <<'PYEOF'
import json, sys
ok = True
for run in ("gepo", "gspo_logn", "grpo_tis_weibull"):
    def rows(d):
        lines = open(f"{d}/{run}/metrics.jsonl").read().splitlines()
        return [{k: v for k, v in json.loads(l).items() if not (k.startswith("perf/") or k == "hetero/wait_s")} for l in lines]
    before, after = rows(sys.argv[1]), rows(sys.argv[2])
    same = before == after
    ok &= same
    print(f"{run}: {len(before)} vs {len(after)} rows, {'identical' if same else 'DIFFERENT'} (timing keys removed)")
sys.exit(0 if ok else 1)
PYEOF
