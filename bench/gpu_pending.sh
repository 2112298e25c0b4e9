#!/usr/bin/env bash
# The GPU work not yet measured, most needed first, in one call that ends by END seconds (default 570):
#   1  the two CUDA tests not yet seen to pass on a GPU: the fused master AdamW's (tests/train/test_master_adamw.py)
#      and the fp32 fla KDA layer against its twin (test_kda_layer_fla_paths_equal_torch_cuda), fla at one
#      autotune config, at most 170 s                                                  -> OUT/tests.log
#   2  bench/train_default_gpu.sh parts a and e: the bench's best step and the peer, then the default `k3 train`
#      step with the fused master AdamW and with torch's beside it (~190 s)            -> OUT/results.json, a.log, de.log
#   3  part c, the QB ablation (4 arms x 2,000 steps), with what is left if over 90 s  -> OUT/c.log, c_arms.json
# The serving rows have their own call: bench/serve_gpu.sh OUT.
#
#   source .devcache/env.sh && bash bench/gpu_pending.sh "$OUT" [END]
#   bash bench/gpu_pending.sh OUT END --dry-run     # the logic on the CPU (tests skip without CUDA; debug shapes)
set -u
OUT=${1:?give the output folder}
END=${2:-570}
DRY=${3:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
left() { echo $((END - SECONDS)); }

TESTS_S=$(( $(left) < 170 ? $(left) : 170 ))
K3_AUTOTUNE_CONFIGS=1 timeout --kill-after=5 "$TESTS_S" python -m pytest -v -p no:cacheprovider \
  tests/train/test_master_adamw.py tests/ops/test_kda_layer_ops.py::test_kda_layer_fla_paths_equal_torch_cuda \
  > "$OUT/tests.log" 2>&1
echo "=== tests: rc $? at ${SECONDS} s (limit ${TESTS_S} s)" >> "$OUT/tests.log"

if [ "$(left)" -gt 120 ]; then
  K3_TRAIN_PARTS="a e" K3_TRAIN_BUDGET_S=$(( $(left) < 190 ? $(left) : 190 )) \
    bash bench/train_default_gpu.sh "$OUT" $DRY
fi
if [ "$(left)" -gt 90 ]; then
  K3_TRAIN_PARTS="c" K3_TRAIN_C_S=$(( $(left) - 5 )) bash bench/train_default_gpu.sh "$OUT" $DRY
fi
echo "gpu_pending: done at ${SECONDS} s of ${END}" | tee -a "$OUT/tests.log"
