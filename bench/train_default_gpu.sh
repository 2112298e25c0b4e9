#!/usr/bin/env bash
# The default `k3 train --device cuda` measured in one call on one H100 (about 9 minutes), every part under its
# own timeout, everything logged into files under OUT (10 files: results.json, a_bench_train.json, a.log, b.log,
# b_metrics.jsonl, c.log, c_arms.json, de.log, and the profiles of the bench's best step and of the CLI's,
# train_profile_k3-small-graphed-step.txt and b_profile.txt), results in OUT/results.json after each
# part (bench/train_default_gpu.py says what each part measures).
#
#   source .devcache/env.sh; bash bench/train_default_gpu.sh "$OUT"
#   bash bench/train_default_gpu.sh OUT --dry-run      # the script's logic on the CPU, debug preset, tiny shapes
#
# Budget (seconds; estimates from BENCHMARKS.md, H100, kernel cache on; ~8 s of imports in each process):
#   a   65  bench/train.py k3-small-graphed-step (the bench's best, bf16 weights; one more step profiled) and the
#           transformers + fla peer at 4 x 4096, 6 timed steps each (first steps ~3 / 7.0 s, steps 147 / 261 ms, builds ~5 s): ~35 s
#   b  215  the default Trainer, `small` 4 x 4096, 1,000 steps: tokenizer + data ~10 s, first step ~25 s (24.9 s
#           measured, capture included), 1,000 steps at an expected ~155-165 ms (192.5 ms before bf16 parameters):
#           ~200 s; it stops at its budget with the steps it ran (TORCH_LOGS=recompiles into b.log)
#   c  210  QB ablation, 4 arms x 2,000 steps, `small` cut to 4 layers (0.41B parameters, 3 MoE layers) at 4 x 512
#           (the earlier ablation's row shape, whose kernels the cache holds): ~45 s an arm, 2,000 steps at an
#           estimated 12-18 ms (the 8-layer ablation's 44 ms/step read the device every step, with twice the
#           layers) plus ~10 s of set-up and capture; each arm gets an equal share of what is left and reports the
#           steps it ran, equal tokens being the steps every arm finished
#   d   55  pytest -v tests/train/test_master_adamw.py on the GPU (the fused master AdamW against its twin)
#   e  rest the default with the fused master AdamW (K3_MASTER_ADAMW=triton), then the matched Kimi-Linear config
#           through the default path, 40 steps each, only if more than 30 s of the 555 are left
# Every timeout is hard, so the call ends by ~545 s whatever happens.
#
# K3_TRAIN_PARTS picks parts (default "a b c d e"); K3_TRAIN_BUDGET_S is the total e may fill up to (default 555),
# for a call that runs something else first (K3_TRAIN_C_S: part c's limit, default 210):  K3_TRAIN_PARTS="a b d e" K3_TRAIN_BUDGET_S=380 bash ... OUT
set -u
OUT=${1:?give the output folder}
PARTS=" ${K3_TRAIN_PARTS:-a b c d e} "
TOTAL=${K3_TRAIN_BUDGET_S:-555}
want() { [[ "$PARTS" == *" $1 "* ]]; }
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
  ARGS=(); B_STEPS=(--steps 1000); C_STEPS=(--steps 2000 --layers 4); E_STEPS=(--steps 40)
  TA=65; TB=${K3_TRAIN_B_S:-215}; TC=${K3_TRAIN_C_S:-210}; TD=55; TE=0  # e: set below from what is left
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
if ! want a; then
  :
elif [ "$DRY" = "--dry-run" ]; then
  echo "dry run: part a (bench/train.py) needs CUDA; skipped" >> "$OUT/a.log"
else
  part a $TA a.log python bench/train.py --variants k3-small-graphed-step peer --steps 6 \
    --out "$OUT/a_bench_train.json" --profile "$OUT" --profile-variants k3-small-graphed-step
fi

# b: the default CLI step, 1,000 steps; recompiles after step 3 counted from TORCH_LOGS
if want b; then
  TORCH_LOGS=recompiles part b $TB b.log python $PY b "$OUT" "$WORK" "${B_STEPS[@]}" --budget-s $((TB - 25)) --profile ${ARGS[@]+"${ARGS[@]}"}
  RECOMPILES=$(awk '/K3-MARK: step 3 done/{after=1; next} after && /Recompiling function/{n++} END{print n+0}' "$OUT/b.log")
  merge b_recompile_lines_after_step_3 "$RECOMPILES" >> "$OUT/b.log" 2>&1
  echo "recompiles logged after step 3: $RECOMPILES" >> "$OUT/b.log"
fi

# c: the QB ablation (with the previous default's weights if the default failed in part b: an error, not a timeout)
B_RC=0
want b && B_RC=$(awk '/=== part b: rc/{rc=$5} END{print rc+0}' "$OUT/b.log")
C_WEIGHTS=()
if [ "$B_RC" != 0 ] && [ "$B_RC" != 124 ] && [ "$B_RC" != 137 ]; then
  C_WEIGHTS=(--master-weights fp32-autocast)
  echo "part b failed (rc $B_RC): the ablation runs fp32 weights under autocast" >> "$OUT/c.log"
fi
want c && part c $TC c.log python $PY c "$OUT" "$WORK" "${C_STEPS[@]}" ${C_WEIGHTS[@]+"${C_WEIGHTS[@]}"} --budget-s $((TC - 20)) ${ARGS[@]+"${ARGS[@]}"}

# d: the graphed step's tests on the GPU
if ! want d; then
  :
elif [ "$DRY" = "--dry-run" ]; then
  part d $TD de.log python -m pytest -q -x -p no:cacheprovider tests/train/test_graphed_step.py -v -k refused
else
  # the graphed step's tests run with the other CUDA tests (bench/gpu_tests.sh); here the fused master AdamW's,
  # whose kernel part e times through the Trainer
  part d $TD de.log python -m pytest -q -v -p no:cacheprovider tests/train/test_master_adamw.py
fi

# e: what is left of the budget (540 s in all)
[ "$DRY" = "--dry-run" ] || TE=$((TOTAL - (SECONDS - START)))
if want e && [ "$TE" -gt 30 ]; then
  part e $TE de.log python $PY e "$OUT" "$WORK" "${E_STEPS[@]}" --budget-s $((TE - 10)) ${ARGS[@]+"${ARGS[@]}"}
fi
# The targets' ratios from what the parts wrote (plain python: read, divide, write)
python - "$OUT" >> "$OUT/de.log" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
results = json.load(open(os.path.join(out, "results.json")))
bench_path = os.path.join(out, "a_bench_train.json")
bench = json.load(open(bench_path))["results"] if os.path.isfile(bench_path) else {}
cli = results.get("b_default_cli", {}).get("overall_after_step_10", {})
best = bench.get("k3-small-graphed-step", {}).get("step_ms")
peer = bench.get("peer", {}).get("tokens_per_s")
matched = results.get("e_extra", {}).get("matched_default", {}).get("tokens_per_s")
targets = {"cli_p50_ms": cli.get("p50_ms"), "bench_best_ms": best,
           "cli_over_bench_best": cli["p50_ms"] / best if cli.get("p50_ms") and best else None,
           "target_cli_over_bench_best": 1.1,
           "cli_mfu": results.get("b_default_cli", {}).get("mfu"), "target_mfu": 0.30,
           "matched_default_over_peer": matched / peer if matched and peer else None, "target_matched_over_peer": 2.0,
           "first_step_s": results.get("b_default_cli", {}).get("first_step_s"), "target_first_step_s": 30}
results["targets"] = targets
with open(os.path.join(out, "results.json.tmp"), "w") as f:
    json.dump(results, f, indent=1)
os.replace(os.path.join(out, "results.json.tmp"), os.path.join(out, "results.json"))
print("targets:", json.dumps(targets))
PY
echo "all parts done in $((SECONDS - START)) s; results in $OUT/results.json" | tee -a "$OUT/de.log"
rm -rf "$WORK"
