#!/usr/bin/env bash
# The default `k3 train --device cuda` measured in one call on one H100 (about 9 minutes), every part under its
# own timeout, everything logged into files under OUT (8 files: results.json, a_bench_train.json, a.log, b.log,
# b_metrics.jsonl, c.log, c_arms.json, de.log), results in OUT/results.json after each
# part (bench/train_default_gpu.py says what each part measures).
#
#   source .devcache/env.sh; bash bench/train_default_gpu.sh "$OUT"
#   bash bench/train_default_gpu.sh OUT --dry-run      # the script's logic on the CPU, debug preset, tiny shapes
#
# Budget (seconds; estimates from BENCHMARKS.md, H100, kernel cache on):
#   a   75  bench/train.py peer, k3-matched-graphed-step, k3-small-graphed-step at 4 x 4096, 6 timed steps each
#           (first steps 7.0 / 3.0 / ~3 s; steps 261 / 100 / 147 ms; builds and imports ~30 s)
#   b  205  the default Trainer, `small` 4 x 4096, 1,000 steps at ~150-190 ms (150-190 s) after a ~25 s first
#           step; stops at its budget with the steps it ran (TORCH_LOGS=recompiles into b.log)
#   c  190  QB ablation, 4 arms x 2,000 steps, `small` cut to 4 layers at 4 x 512 (~40 s an arm: 2,000 steps at
#           an estimated 12-20 ms, the 8-layer ablation's 44 ms/step having had a host sync per step and twice the
#           layers; each arm gets an equal share of what is left, and reports the steps it ran)
#   d   60  pytest tests/train/test_graphed_step.py on the GPU (the debug preset's graph captures)
#   e  rest the previous default (fp32 weights under autocast) and the matched config through the default path
# Total 530 s + e; every timeout is hard, so the call ends by ~540 s whatever happens.
set -u
OUT=${1:?give the output folder}
DRY=${2:-}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/k3_train_default.XXXXXX)
PY=bench/train_default_gpu.py
export PYTHONUNBUFFERED=1
START=$SECONDS
if [ "$DRY" = "--dry-run" ]; then
  ARGS=(--dry-run); B_STEPS=(--steps 25); C_STEPS=(--steps 12 --eval-every 6 --seq 32 --batch 2 --corpus-mb 0.3)
  E_STEPS=(--steps 12); TA=1; TB=240; TC=240; TD=120; TE=120
else
  ARGS=(); B_STEPS=(--steps 1000); C_STEPS=(--steps 2000 --layers 4); E_STEPS=(--steps 60)
  TA=75; TB=205; TC=190; TD=60; TE=0  # e: set below from what is left
fi
merge() {  # merge KEY JSON: OUT/results.json[KEY] = JSON (plain python: no torch import, no seconds lost)
  python - "$OUT/results.json" "$1" "$2" <<'PY'
import json, os, sys
path, key, value = sys.argv[1:]
results = json.load(open(path)) if os.path.isfile(path) else {}
results[key] = json.loads(value)
with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=1)
os.replace(path + ".tmp", path)
PY
}
part() {  # part NAME SECONDS LOG COMMAND...: runs COMMAND under its timeout, appends to LOG, records rc + seconds
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS
  echo "=== part $name (timeout ${limit}s) at $((SECONDS - START)) s: $*" >> "$OUT/$log"
  timeout --kill-after=5 "$limit" "$@" >> "$OUT/$log" 2>&1
  local rc=$?
  echo "=== part $name: rc $rc after $((SECONDS - t0)) s" >> "$OUT/$log"
  merge "part_${name}_run" "{\"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"timeout_s\": $limit}" >> "$OUT/$log" 2>&1
}

# a: the bench's best variant and its baselines (bench/train.py writes OUT/a_bench_train.json as it goes)
if [ "$DRY" = "--dry-run" ]; then
  echo "dry run: part a (bench/train.py) needs CUDA; skipped" >> "$OUT/a.log"
else
  part a $TA a.log python bench/train.py --variants peer k3-matched-graphed-step k3-small-graphed-step --steps 6 \
    --out "$OUT/a_bench_train.json"
fi

# b: the default CLI step, 1,000 steps; recompiles after step 3 counted from TORCH_LOGS
TORCH_LOGS=recompiles part b $TB b.log python $PY b "$OUT" "$WORK" "${B_STEPS[@]}" --budget-s $((TB - 15)) "${ARGS[@]}"
RECOMPILES=$(awk '/K3-MARK: step 3 done/{after=1; next} after && /Recompiling function/{n++} END{print n+0}' "$OUT/b.log")
merge b_recompile_lines_after_step_3 "$RECOMPILES" >> "$OUT/b.log" 2>&1
echo "recompiles logged after step 3: $RECOMPILES" >> "$OUT/b.log"

# c: the QB ablation
part c $TC c.log python $PY c "$OUT" "$WORK" "${C_STEPS[@]}" --budget-s $((TC - 20)) "${ARGS[@]}"

# d: the graphed step's tests on the GPU
if [ "$DRY" = "--dry-run" ]; then
  part d $TD de.log python -m pytest -q -x -p no:cacheprovider tests/train/test_graphed_step.py -k refused
else
  part d $TD de.log python -m pytest -q -x -p no:cacheprovider tests/train/test_graphed_step.py
fi

# e: what is left of the budget (540 s in all)
[ "$DRY" = "--dry-run" ] || TE=$((540 - (SECONDS - START)))
if [ "$TE" -gt 30 ]; then
  part e $TE de.log python $PY e "$OUT" "$WORK" "${E_STEPS[@]}" --budget-s $((TE - 10)) "${ARGS[@]}"
fi
echo "all parts done in $((SECONDS - START)) s; results in $OUT/results.json" | tee -a "$OUT/de.log"
rm -rf "$WORK"
