#!/usr/bin/env bash
# The study's fix256 runs (delay_sweep.py --design powered_long) from their fixed checkout, in one
# command: docs/study_data/README.md says why a worktree at aac3566, why these flags and weights.
#
#   scripts/dev/resume_powered_long.sh            set up what is missing, start the sweep in the background
#   scripts/dev/resume_powered_long.sh --plan     the same set-up, then only the sweep's plan (runs left, time)
#   scripts/dev/resume_powered_long.sh --collect  the sweep's rows into docs/study_data/rows_powered.csv and
#                                                 the results command (docs/results.md's tables), nothing run
#
# Set-up, each step only where needed: the worktree (FRONTIER_WT, default /tmp/frontier_wt) and its
# .venv (make install); the pinned weights copied from the package into the worktree's warm-start
# cache (its code predates the shipped copies) and their sha256 checked against the design's pin;
# the rows file (FRONTIER_ROWS, default /tmp/frontier_rows.csv) from docs unless it already extends them.
# A sweep already running is left alone. Runs go to FRONTIER_OUT (default /tmp/heterorl_long), the
# log to FRONTIER_LOG (default /tmp/frontier_long.log).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WT=${FRONTIER_WT:-/tmp/frontier_wt}
ROWS=${FRONTIER_ROWS:-/tmp/frontier_rows.csv}
OUT=${FRONTIER_OUT:-/tmp/heterorl_long}
LOG=${FRONTIER_LOG:-/tmp/frontier_long.log}
DOC_ROWS=$REPO/docs/study_data/rows_powered.csv
COMMIT=aac356643d313eaf18bf6de58cb29a6480c9043c
# the order the design id was made with (the worktree's code predates the default of all fourteen)
ALGOS=(gepo grpo_paper gspo_wide gepo_tr gspo m2po vespo decoupled_ppo gepo_tc gepo_tc_ess grpo_icepop
       grpo_seq_mis grpo_tis grpo_seq_tis)
PY=$REPO/.venv/bin/python
MODE=${1:-run}
case $MODE in run|--plan|--collect) ;; *) echo "usage: $0 [--plan|--collect]  (got '$MODE')" >&2; exit 2 ;; esac
[ -x "$PY" ] || { echo "no $PY: run 'make install' in $REPO first" >&2; exit 1; }

# rows_extend OLD NEW: NEW holds OLD's lines first, in order (both files are append-only)
rows_extend() { [ "$(wc -l <"$2")" -ge "$(wc -l <"$1")" ] && cmp -s "$1" <(head -n "$(wc -l <"$1")" "$2"); }

if [ "$MODE" = --collect ]; then
  [ -f "$ROWS" ] || { echo "no rows file $ROWS" >&2; exit 1; }
  if ! rows_extend "$DOC_ROWS" "$ROWS"; then
    echo "$ROWS does not extend $DOC_ROWS (another start's rows?): nothing copied" >&2; exit 1
  fi
  echo "rows: $(($(wc -l <"$ROWS") - $(wc -l <"$DOC_ROWS"))) new ($(($(wc -l <"$ROWS") - 1)) in all)"
  cp "$ROWS" "$DOC_ROWS"
  # docs/results.md's command (the Makefile's `results`)
  exec nice make -C "$REPO" results
fi

running=$(pgrep -f "delay_sweep.py --design powered_long" || true)
if [ -n "$running" ] && [ "$MODE" = run ]; then
  echo "a powered_long sweep is running already (pid $(echo "$running" | paste -sd " " -)): log $LOG"; exit 0
fi

if [ ! -d "$WT" ]; then
  git -C "$REPO" worktree prune  # a registration left by a worktree whose folder is gone blocks the add
  git -C "$REPO" worktree add --detach "$WT" "$COMMIT"
fi
have=$(git -C "$WT" rev-parse HEAD)
[ "$have" = "$COMMIT" ] || { echo "$WT is at $have, not the study's $COMMIT" >&2; exit 1; }
make -C "$WT" install

# the worktree looks for its warm start in <its root>/.cache/heterorl, under the settings' folder name
read -r W SHIPPED PIN < <("$PY" - "$REPO" "$WT/.cache/heterorl" <<'PYEOF'
import sys
sys.path.insert(0, f"{sys.argv[1]}/scripts")
from sweep.plan import POWERED_LONG, PINNED_WARM_START_STEPS
from verl_ext.data.toy.checkpoints import PINNED_WARM_STARTS, warm_start_folder
folder = warm_start_folder(sys.argv[2], 3, steps=PINNED_WARM_START_STEPS, seed=0, answer_format="scratchpad")
print(folder, PINNED_WARM_STARTS / folder.name, POWERED_LONG["warm_start_sha256"]["long"])
PYEOF
)
sha() { "$PY" -c "import sys; from verl_ext.data.toy.checkpoints import weights_sha256 as h; print(h(sys.argv[1]))" "$1"; }
if [ ! -f "$W/warm_start.json" ] || [ "$(sha "$W")" != "$PIN" ]; then
  rm -rf "$W" && mkdir -p "$(dirname "$W")" && cp -r "$SHIPPED" "$W"
fi
[ "$(sha "$W")" = "$PIN" ] || { echo "$W does not hold the pinned weights $PIN" >&2; exit 1; }
echo "warm start: $W (weights sha256 $PIN)"

if [ ! -f "$ROWS" ] || ! rows_extend "$DOC_ROWS" "$ROWS"; then
  if [ -f "$ROWS" ]; then  # rows the docs do not hold are set aside, never overwritten
    mv "$ROWS" "$ROWS.replaced.$(date +%s)" && echo "$ROWS does not extend $DOC_ROWS: set aside as $ROWS.replaced.*"
  fi
  cp "$DOC_ROWS" "$ROWS"
fi
echo "rows: $ROWS ($(($(wc -l <"$ROWS") - 1)) rows)"

LRS=()
for a in "${ALGOS[@]}"; do LRS+=("$a=5e-5"); done
SWEEP=(-m research.study.delay_sweep --design powered_long --algos "${ALGOS[@]}" --lrs "${LRS[@]}"
       --out "$OUT" --rows "$ROWS" --workers 2)
cd "$WT"
if [ "$MODE" = --plan ]; then
  exec .venv/bin/python "${SWEEP[@]}" --plan-only
fi
OMP_NUM_THREADS=1 nohup setsid nice -n 10 .venv/bin/python "${SWEEP[@]}" >"$LOG" 2>&1 &
echo "sweep started (pid $!): log $LOG; collect its rows with $0 --collect"
