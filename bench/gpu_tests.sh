#!/usr/bin/env bash
# The CUDA-touching tests on one GPU, in chunks that each end inside a 10-minute call.
#
#   bash bench/gpu_tests.sh OUT 1/4     chunk 1 of 4: OUT/chunk-1-of-4.{log,xml,summary}
#   bash bench/gpu_tests.sh --list 4    the files of each of 4 chunks
#
# From the project's root. Sources .devcache/env.sh when it is there (fla's wheels and the compiled-kernel cache,
# kernels autotuned over 4 configs): without it the first chunk spends minutes compiling fla's kernels.
# Each chunk is one pytest run, stopped with SIGINT at K3_GPU_TEST_BUDGET seconds (default 540) so pytest still
# writes its junit file and summary; no test may take over K3_GPU_TEST_TIMEOUT seconds (default 300). The log
# streams one line per test (-v), so a chunk cut short still shows what ran. Exit status: pytest's (5: the
# chunk had no tests), 124 when the budget ran out.
# Tests check results, not speed: fla's autotuned kernels compile one config each (K3_AUTOTUNE_CONFIGS=1: the
# first, which a cache built with any N holds, and no timing runs); K3_GPU_TEST_AUTOTUNE_CONFIGS=N compiles N.
# K3_GPU_TEST_WORKERS=N (default 1) spreads the chunk's files over N pytest-xdist workers sharing the GPU (most of a
# chunk's time is kernel compilation on the host, which parallelises); it needs pytest-xdist importable, e.g. its
# wheel and execnet's beside fla's in .whl/.
set -u

# Heaviest first (fla compiles, whole models, training steps), then the rest: dealt round-robin to the chunks.
FILES=(
  tests/ops/test_kda.py
  tests/ops/test_kda_layer_ops.py
  tests/ops/test_kda_training_options.py
  tests/layers/test_kda_inplace_state.py
  tests/train/test_graphed_step.py
  tests/train/test_trainer.py
  tests/infer/test_engine_cuda.py
  tests/layers/test_fused_weights.py
  tests/ops/test_training_kernels_model.py
  tests/train/test_training_step_kernels.py
  tests/ops/test_fla_ops.py
  tests/ops/test_mla_decode_triton.py
  tests/ops/test_moe_triton.py
  tests/ops/test_short_conv_triton.py
  tests/ops/test_glu_triton.py
  tests/ops/test_qb_triton.py
  tests/ops/test_attn_res_triton.py
  tests/ops/test_rms_norm_triton.py
  tests/ops/test_vector_grads_triton.py
  tests/ops/test_route_weights_triton.py
  tests/ops/test_rms_norm_gated_triton.py
  tests/train/test_adamw_triton.py
  tests/train/test_master_adamw.py
  tests/ops/test_linear_ce.py
  tests/ops/test_moe_expert_order.py
  tests/ops/test_route_triton.py
  tests/ops/test_packed_attention.py
  tests/ops/test_moe_combine.py
  tests/ops/test_conv_step_triton.py
  tests/ops/test_linear_triton.py
  tests/ops/test_attn_res_accumulate.py
  tests/ops/test_moe_ops.py
  tests/ops/test_router_logits.py
  tests/layers/test_glu_compiled.py
  tests/infer/test_engine_kernels.py
  tests/infer/test_decode_inputs_host.py
  tests/vision/test_attention_cuda.py
  tests/train/test_train_bench_batches.py
  tests/ops/test_autotune_limit.py
  tests/test_kernels.py
  tests/test_cli_careless_input.py
)

chunk_files() {  # chunk_files I N: the files of chunk I of N
  local index=$1 count=$2 position
  for position in "${!FILES[@]}"; do
    if (( position % count == index - 1 )); then echo "${FILES[$position]}"; fi
  done
}

usage() {
  echo "usage: bash bench/gpu_tests.sh OUT I/N   (chunk I of N, 1 <= I <= N)" >&2
  echo "       bash bench/gpu_tests.sh --list N" >&2
  exit 2
}

if [[ ${1:-} == --list ]]; then
  [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage
  for ((i = 1; i <= $2; i++)); do echo "chunk $i/$2:"; chunk_files "$i" "$2" | sed 's/^/  /'; done
  exit 0
fi
[[ $# -eq 2 && $2 =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] || usage
index=${BASH_REMATCH[1]} count=${BASH_REMATCH[2]}
(( index <= count )) || usage
out=$1
mkdir -p "$out" || exit 2
name="chunk-$index-of-$count"
budget=${K3_GPU_TEST_BUDGET:-540}
per_test=${K3_GPU_TEST_TIMEOUT:-300}

if [[ -f .devcache/env.sh ]]; then
  # shellcheck disable=SC1091
  source .devcache/env.sh || exit 1
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
# Over the cache's N (4): autotuning over 4, three fp32 KDA-layer tests ran past 240 s in fla's backward (one H100).
export K3_AUTOTUNE_CONFIGS=${K3_GPU_TEST_AUTOTUNE_CONFIGS:-1}

mapfile -t files < <(chunk_files "$index" "$count")
{
  echo "chunk $index/$count: ${files[*]}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
  echo "K3_AUTOTUNE_CONFIGS=$K3_AUTOTUNE_CONFIGS"
} > "$out/$name.summary" 2>&1

start=$(date +%s)
workers=${K3_GPU_TEST_WORKERS:-1}
parallel=()
if (( workers > 1 )); then
  if python -c "import xdist" 2>/dev/null; then
    parallel=(-n "$workers" --dist loadfile)
  else
    echo "K3_GPU_TEST_WORKERS=$workers but pytest-xdist is not importable: one process" >> "$out/$name.summary"
  fi
fi
timeout -s INT -k 30 "$budget" python -m pytest -v -ra -p no:cacheprovider --timeout "$per_test" \
  ${parallel[@]+"${parallel[@]}"} --junitxml "$out/$name.xml" "${files[@]}" > "$out/$name.log" 2>&1
status=$?
{
  echo "exit $status, $(( $(date +%s) - start )) s (budget $budget s)"
  grep -E "^(FAILED|ERROR)|^=+ .*(passed|failed|error|skipped).* =+$" "$out/$name.log"
} >> "$out/$name.summary"
cat "$out/$name.summary"
exit "$status"
