#!/usr/bin/env bash
# The GPU work not yet measured, most needed first. Each step runs only if the seconds it needs are left before
# END (default 570), so a short window still yields the first steps; name steps to pick them (default: all).
#   tests    the CUDA tests not yet seen to pass: the engine's (padded prefill against prefill apart; next turns'
#            tails after prefix hits, their first turns saving states inside a forward; CUDA-graph decode) and
#            packed attention's flash varlen; fla at one autotune config
#                                                                              needs 60, limit 150  -> tests.log
#   prefill  bench/engine_prefill.py on `small`: 8 prompts of 1,024 tokens and of mixed lengths through the engine
#            against one plain forward, padded and apart; one prompt (a request's TTFT); a fresh engine's first
#            prompts after its warm-up; profiles of each, with host-time tables      needs 170  -> prefill.{json,log}
#   serve    bench/serve_gpu.sh's probe + serve parts (the serving table)      needs 300            -> serve/
#   compiled the serving table's completion levels and engine baselines with the compiled decode step
#            (K3_COMPILE_DECODE=1, off by default: its compile time at start-up was the reason), the server's warm-up
#            compiling before ready                                                  needs 480  -> compiled/
#   long     bench/serve_gpu.sh's run + eval + serve1m parts (1M context)      needs 310            -> long/
#   flat     bench/train_default_gpu.sh part b: the default step over 1,000 steps (p50/p99 per 100)
#                                                                              needs 295            -> b.log
#   qb       bench/train_default_gpu.sh part c: the QB ablation, 4 arms x 2,000 steps
#                                                                              needs 240            -> c.log
#   rweights bench/train.py's best step with the switches as they are, then --kernels route_weights=triton (the
#            router's gate weights as 2 kernels: 210 launches fewer a step by bench/launch_census.py), then
#            vector_grads=triton (its row loop now tiled; the loop made the step 4.5% slower)
#                                                                              needs 235   -> rweights_*.{json,log}
#   kdaopts  fla's KDA options for training (k3.ops.kda.training_options, off until measured): bench/kda.py at
#            `small`'s shape (the op with its intermediates kept, with chunks of 32, both; their peak memory), the
#            exactness check (bench/gpu_check.py kda_options), then bench/train.py's best step in arms
#            K3_KDAOPTS_ARMS (default "default kda_keep=1 kda_chunk=32")
#                                                                              needs 300  -> kdaopts/
#   varlen   the packed documents' attention in training as flash varlen (K3_PACKED_ATTENTION, off by default until
#            measured): tests/ops/test_packed_attention.py's CUDA tests, then the default `k3 train` step (part b of
#            bench/train_default_gpu.py, 150 steps) with torch's masked attention and with varlen
#                                                                              needs 240  -> varlen_*.log, varlen_*/
#   traffic  bench/prefix_traffic.py on `small`: rounds of chat-like prompts sharing a system prompt, prefix cache on
#            against off (hits, tokens skipped, prefill forwards, time)              needs 60   -> traffic.{json,log}
#   steps    bench/serve.py's completion levels (both engine modes, no chat) with the engine in process at the
#            default step budget and at 8,192 and 32,768 tokens (--engine-step-tokens)    needs 230  -> steps/
#   first    bench/first_request.py on `small`: a fresh server's first requests, stacks sampled in the server
#                                                                              needs 70   -> first.{json,log}
#   decode   bench/decode.py at batch 1, 16 and 64 (1K context): the graph step against its memory floor, profiles
#                                                                              needs 60   -> decode.*
#   etests   the engine's CUDA tests one at a time with launches blocking and a thread dump at a time limit, then
#            packed attention's (K3_ETESTS names the engine tests, K3_ETEST_S their limit, K3_ETESTS_PACKED=0 skips
#            packed attention's, K3_ETEST_BLOCKING=0 launches asynchronously: compiling and autotuning a cold
#            kernel cache with blocking launches outlasted 50 s)                                               needs 40   -> etests_*.log
#   overlap  the serving table's engine-process rows (k3 serve's CUDA default) with the engine baselines, without
#            then with --overlap-steps (decode steps launched before the previous step's tokens are read;
#            K3_OVERLAP_ARMS="on off" reverses the order: the first arm compiles what the kernel cache lacks)
#                                                                              needs 250  -> overlap/
#   gather   bench/serve.py, engine process, C=16 and 64, in arms K3_GATHER_ARMS (default "1:0 auto:0 auto:10",
#            client processes:EngineConfig.gather_prompts_ms): one client process against one per 16 streams (one
#            fell behind parsing C=64's tokens on a CPU), then a burst's prompts held while more arrive, so that
#            they share prefill forwards; the table's "prefill forwards" column counts them  needs 230 -> gather/
#   fresh    bench/serve.py, engine process only (k3 serve's CUDA default): a fresh server's first request (its
#            own warm-up requests on, the client warmed on a stub), then C=1 and C=16      needs 150  -> fresh/
#   cache    the kernel cache as it is now, in 9 MiB xz parts under OUT/cache/ (put them in .devcache/ as tc.a?
#            in place of the old ones: the next call's first step then compiles nothing new)   needs 40
# The server steps need the serving wheels: run `bash bench/gpu_wheels.sh` here before the call (they go in .whl/
# with fla's; the GPU image has no FastAPI). A call brings back only a few files from OUT, so write to a folder of
# the machine's and pack it into one archive (and the steps so far are packed into the machine's return folder after
# each step; OUT/kernels_new.tar.xz holds the kernels it compiled: `bash bench/kernel_cache_merge.sh` adds them to
# .devcache/). Three calls cover what is open (steps run in this file's order), most decisive first:
#   one client process against one per 16 streams, then gathered prompts on top (k3 serve at C=64 against the
#   engine in process: the target is 90%, 85% with one client process):
#   source .devcache/env.sh && bash bench/gpu_pending.sh /tmp/r2 345 gather; tar czf "$OUT/r2.tgz" -C /tmp r2
#   the engine's CUDA tests, given time to compile (at 50, 80 and 170 s the overlapped-steps test was still
#   compiling Triton kernels on a cold cache):
#   source .devcache/env.sh && K3_ETESTS="overlapped_steps prompt_tails_from padded_prefill_equals" K3_ETEST_S=150 \
#     K3_ETEST_BLOCKING=0 K3_ETESTS_PACKED=0 bash bench/gpu_pending.sh /tmp/r1 560 etests; tar czf $OUT/r1.tgz -C /tmp r1
#   the training step's untimed levers (#51): fla's KDA options, then varlen attention for packed documents:
#   source .devcache/env.sh && bash bench/gpu_pending.sh /tmp/r3 560 kdaopts varlen; tar czf "$OUT/r3.tgz" -C /tmp r3
# and, time left, `traffic`, `flat qb` or `long rweights` (measured on 2026-12-07: re-runs).
# (the whole kernel cache after a day's compiles was 58 MB in xz: more than a call can carry beside the tree and
# .whl/, so `cache` is for a fresh, smaller cache)
#   bash bench/gpu_pending.sh OUT 570 --dry-run [STEPS...]   # the logic on the CPU (debug shapes, CUDA tests skip)
set -u
# Where the GPU machine's run collects what comes back ($OUT there, before this script names its own folder OUT):
# after every step the folder so far is packed there, so a run cut short at its time limit still returns its logs.
RETURN_DIR=${OUT:-}
OUT=${1:?give the output folder}
END=${2:-570}
shift 2 2>/dev/null || shift $#
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY=--dry-run; shift; fi
STEPS=" ${*:-tests varlen prefill serve compiled long rweights kdaopts flat qb traffic steps first decode etests overlap gather fresh} "
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
KCACHE=${K3_KCACHE:-/tmp/kcache}  # where .devcache/env.sh restored the kernel cache
STARTED=$(mktemp)  # what the cache gains after this (its restored files keep their archived times) is new
left() { echo $((END - SECONDS)); }
log() {
  echo "gpu_pending: $* at ${SECONDS} s of ${END}" | tee -a "$OUT/pending.log"
  if [ -n "$RETURN_DIR" ] && [ -d "$RETURN_DIR" ] && [ "$RETURN_DIR" != "$OUT" ]; then
    tar czf "$RETURN_DIR/pending_so_far.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" 2>/dev/null || true
  fi
}
# run NAME NEEDS: true if the step was asked for and NEEDS seconds are left; says why not otherwise
run() {
  [[ "$STEPS" == *" $1 "* ]] || return 1
  if [ "$(left)" -lt "$2" ]; then log "$1 skipped: needs $2 s, $(left) left"; return 1; fi
  log "$1 starts"
}

if run tests 60; then
  limit=$(( $(left) < 150 ? $(left) : 150 ))
  K3_AUTOTUNE_CONFIGS=1 timeout -s INT --kill-after=5 "$limit" python -m pytest -v -p no:cacheprovider \
    -p no:timeout -o faulthandler_timeout=$(( limit - 10 )) \
    tests/infer/test_engine_cuda.py tests/ops/test_packed_attention.py \
    > "$OUT/tests.log" 2>&1
  log "tests: rc $? (limit ${limit} s)"
fi
if run prefill 170; then
  if [ -n "$DRY" ]; then
    timeout 110 python bench/engine_prefill.py --preset debug --prompt 128 --repeats 1 --out "$OUT/prefill.json" \
      > "$OUT/prefill.log" 2>&1
  else
    timeout 160 python bench/engine_prefill.py --preset small --profile "$OUT/prefill_profile" \
      --out "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
  fi
  log "prefill: rc $?"
fi
SERVE_MODE=()
[ -n "$DRY" ] && SERVE_MODE=(--cpu-check)
if run serve 300; then  # 206-233 s on one H100
  K3_SERVE_PARTS="probe serve" bash bench/serve_gpu.sh "$OUT/serve" "${SERVE_MODE[@]}"
  log "serve done"
fi
if run compiled 480; then
  mkdir -p "$OUT/compiled"
  if [ -n "$DRY" ]; then
    log "compiled: the compiled decode step needs CUDA; skipped"
  else
    K3_COMPILE_DECODE=1 timeout --kill-after=10 $(( $(left) - 10 )) python bench/serve.py --preset small \
      --skip transformers --engine-modes process --out "$OUT/compiled/serve.json" > "$OUT/compiled/serve.log" 2>&1
    log "compiled: rc $?"
  fi
fi
if run long 310; then
  K3_SERVE_PARTS="run eval serve1m" bash bench/serve_gpu.sh "$OUT/long" "${SERVE_MODE[@]}"
  log "long done"
fi
if run rweights 235; then
  if [ -n "$DRY" ]; then
    log "rweights: bench/train.py needs CUDA; skipped"
  else
    for switch in default route_weights=triton vector_grads=triton; do
      name=${switch%%=*}
      kernels=(); [ "$switch" != default ] && kernels=(--kernels "$switch")
      timeout --kill-after=5 75 python bench/train.py --variants k3-small-graphed-step --steps 6 \
        ${kernels[@]+"${kernels[@]}"} --out "$OUT/rweights_$name.json" > "$OUT/rweights_$name.log" 2>&1
      log "rweights $switch: rc $?"
    done
  fi
fi
if run kdaopts 300; then  # fla's KDA training options: the op, its exactness, the step in arms
  mkdir -p "$OUT/kdaopts"
  if [ -n "$DRY" ]; then
    timeout 120 python bench/gpu_check.py --device cpu --checks kda_options > "$OUT/kdaopts/check.log" 2>&1
    log "kdaopts check (CPU twins): rc $?; bench/kda.py and bench/train.py need CUDA"
  else
    timeout --kill-after=5 100 python bench/kda.py --shapes 4x4096 --heads 8 --dim 128 --hidden 1024 \
      --out "$OUT/kdaopts/kda.json" > "$OUT/kdaopts/kda.log" 2>&1
    log "kdaopts kda.py: rc $?"
    timeout --kill-after=5 60 python bench/gpu_check.py --checks kda_chunk kda_options \
      --out "$OUT/kdaopts/check.json" > "$OUT/kdaopts/check.log" 2>&1
    log "kdaopts check: rc $?"
    timeout --kill-after=5 40 python -m pytest -v -p no:cacheprovider tests/ops/test_kda_training_options.py \
      > "$OUT/kdaopts/tests.log" 2>&1
    log "kdaopts tests: rc $?"
    for switch in ${K3_KDAOPTS_ARMS:-default kda_keep=1 kda_chunk=32}; do
      [ "$(left)" -lt 70 ] && { log "kdaopts $switch skipped: $(left) s left"; continue; }
      name=${switch//[=,]/_}
      kernels=(); [ "$switch" != default ] && kernels=(--kernels "$switch")
      timeout --kill-after=5 75 python bench/train.py --variants k3-small-graphed-step --steps 6 \
        ${kernels[@]+"${kernels[@]}"} --out "$OUT/kdaopts/train_$name.json" > "$OUT/kdaopts/train_$name.log" 2>&1
      log "kdaopts step $switch: rc $?"
    done
  fi
fi
if run flat 295; then  # 1,000 steps: ~60 s of set-up and first step, 150 ms a step, the profile
  K3_TRAIN_PARTS="b" K3_TRAIN_B_S=280 bash bench/train_default_gpu.sh "$OUT" $DRY
  log "flat done"
fi
if run qb 240; then  # 4 arms of 2,000 steps: the first (published QB, compiling) took 47 s for 1,750
  K3_TRAIN_PARTS="c" K3_TRAIN_C_S=$(( $(left) - 5 )) bash bench/train_default_gpu.sh "$OUT" $DRY
  log "qb done"
fi
if run varlen 240; then  # the packed documents' attention as flash varlen: its CUDA tests, then the default step
  # with and without it (K3_PACKED_ATTENTION), 150 steps each
  timeout -s INT --kill-after=5 70 python -m pytest -v -p no:cacheprovider tests/ops/test_packed_attention.py \
    > "$OUT/varlen_tests.log" 2>&1
  log "varlen tests: rc $?"
  for choice in torch varlen; do
    work=$(mktemp -d /tmp/k3_varlen.XXXXXX)
    if [ -n "$DRY" ]; then  # varlen needs CUDA: auto (the twin here) checks the rest
      K3_PACKED_ATTENTION=${choice/varlen/auto} timeout 60 python bench/train_default_gpu.py b "$OUT/varlen_$choice" "$work" \
        --dry-run --steps 12 --budget-s 40 > "$OUT/varlen_$choice.log" 2>&1
    else
      K3_PACKED_ATTENTION=$choice timeout --kill-after=5 80 python bench/train_default_gpu.py b "$OUT/varlen_$choice" \
        "$work" --steps 150 --budget-s 70 > "$OUT/varlen_$choice.log" 2>&1
    fi
    log "varlen $choice: rc $?"
    rm -rf "$work"
  done
fi
if run traffic 60; then  # chat-like traffic with and without the prefix cache (small, bf16)
  if [ -n "$DRY" ]; then
    timeout 50 python bench/prefix_traffic.py --rounds 2 --prompts 8 --batch 4 --out "$OUT/traffic.json" \
      > "$OUT/traffic.log" 2>&1
  else
    timeout 55 python bench/prefix_traffic.py --preset small --out "$OUT/traffic.json" > "$OUT/traffic.log" 2>&1
  fi
  log "traffic: rc $?"
fi
if run steps 230; then  # the serving table's completion levels; the engine in process at three step budgets
  mkdir -p "$OUT/steps"
  if [ -n "$DRY" ]; then
    timeout 200 python bench/serve.py --preset debug --concurrency 1 4 --skip transformers \
      --engine-step-tokens 256 --out "$OUT/steps/serve.json" > "$OUT/steps/serve.log" 2>&1
  else
    timeout --kill-after=10 $(( $(left) < 300 ? $(left) - 10 : 290 )) python bench/serve.py --preset small \
      --skip transformers --engine-modes in-process process --engine-step-tokens 8192 32768 \
      --out "$OUT/steps/serve.json" > "$OUT/steps/serve.log" 2>&1
  fi
  log "steps: rc $?"
fi
if run first 70; then  # where a fresh server's first request spends its time (stacks sampled in the server)
  if [ -n "$DRY" ]; then
    timeout 100 python bench/first_request.py --preset tiny --prompt 128 --requests 2 --out "$OUT/first.json" \
      > "$OUT/first.log" 2>&1
  else
    timeout 90 python bench/first_request.py --preset small --out "$OUT/first.json" > "$OUT/first.log" 2>&1
  fi
  log "first: rc $?"
fi
if run decode 60; then  # the decode graph's step at batch 1, 16 and 64 against its memory floor, with profiles
  if [ -n "$DRY" ]; then
    log "decode: bench/decode.py needs CUDA; skipped"
  else
    timeout 90 python bench/decode.py --models k3-small --cases 1x1024 16x1024 64x1024 --new 32 \
      --profile "$OUT/decode_profile" --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
    log "decode: rc $?"
  fi
fi
# A hang inside a launch holds the interpreter, so pytest-timeout's dump never comes (its thread needs it):
# faulthandler's watchdog writes every thread's stack without it (pytest-timeout off, or it takes the option over).
if run etests 40; then  # the engine's CUDA tests one at a time, launches blocking: a hang shows the launch it hangs in
  timeout --kill-after=5 60 python -m pytest -v -p no:cacheprovider --timeout 55 tests/layers/test_kda_inplace_state.py \
    -k "cuda" > "$OUT/etests_kda_inplace.log" 2>&1
  log "etests kda in place: rc $?"
  for test in ${K3_ETESTS:-padded_prefill_equals prompt_tails_from overlapped_steps cuda_graph_decode}; do
    limit=$(( $(left) < 80 ? $(left) - 5 : ${K3_ETEST_S:-75} ))
    [ "$limit" -lt 20 ] && break
    CUDA_LAUNCH_BLOCKING=${K3_ETEST_BLOCKING:-1} K3_AUTOTUNE_CONFIGS=1 timeout --kill-after=5 $(( limit + 5 )) python -m pytest -v \
      -p no:cacheprovider -p no:timeout -o faulthandler_timeout=$(( limit - 3 )) tests/infer/test_engine_cuda.py -k "$test" \
      > "$OUT/etests_$test.log" 2>&1
    log "etests $test: rc $?"
  done
  limit=$(( $(left) < 60 ? $(left) - 5 : 55 ))
  if [ "$limit" -ge 20 ] && [ "${K3_ETESTS_PACKED:-1}" = 1 ]; then
    timeout --kill-after=5 $(( limit + 5 )) python -m pytest -v -p no:cacheprovider -p no:timeout \
      -o faulthandler_timeout=$(( limit - 3 )) tests/ops/test_packed_attention.py > "$OUT/etests_packed.log" 2>&1
    log "etests packed attention: rc $?"
  fi
fi
if run overlap 250; then  # k3 serve's CUDA default (engine process) without, then with overlapped steps, one call
  mkdir -p "$OUT/overlap"
  for arm in ${K3_OVERLAP_ARMS:-off on}; do
    flag=--no-overlap-steps; [ "$arm" = on ] && flag=--overlap-steps
    if [ -n "$DRY" ]; then
      timeout 200 python bench/serve.py --preset debug --concurrency 1 4 --skip transformers --engine-modes process \
        $flag --out "$OUT/overlap/serve_$arm.json" > "$OUT/overlap/serve_$arm.log" 2>&1
    else
      timeout --kill-after=10 $(( $(left) < 210 ? $(left) - 10 : 200 )) python bench/serve.py --preset small \
        --skip transformers --engine-modes process $flag --out "$OUT/overlap/serve_$arm.json" \
        > "$OUT/overlap/serve_$arm.log" 2>&1
    fi
    log "overlap $arm: rc $?"
  done
fi
if run gather 230; then  # k3 serve (engine process): one client process then several, new prompts gathered or not
  mkdir -p "$OUT/gather"
  # The arm that ran first in the overlap A/B still compiled during its levels, after its warm-up: say what.
  export TORCH_LOGS=${TORCH_LOGS:-recompiles}
  # Arms "client processes:gather ms" (auto: bench/serve.py's default, one client process per 16 streams).
  for arm in ${K3_GATHER_ARMS:-1:0 auto:0 auto:${K3_GATHER_MS:-10}}; do
    clients=${arm%%:*}; ms=${arm##*:}
    client_option=()
    [ "$clients" != auto ] && client_option=(--client-processes "$clients")
    name="${clients}_$ms"
    if [ -n "$DRY" ]; then
      timeout 200 python bench/serve.py --preset debug --concurrency 4 --skip transformers one-by-one \
        --engine-modes process --gather-prompts-ms "$ms" "${client_option[@]}" --out "$OUT/gather/serve_$name.json" \
        > "$OUT/gather/serve_$name.log" 2>&1
    else
      # 110 s cut the first two arms short on a cache without the engine's kernels (2026-12-07): 170 at most
      timeout --kill-after=10 $(( $(left) < 180 ? $(left) - 10 : 170 )) python bench/serve.py --preset small \
        --concurrency 16 64 --skip transformers --engine-modes process --gather-prompts-ms "$ms" "${client_option[@]}" \
        --out "$OUT/gather/serve_$name.json" > "$OUT/gather/serve_$name.log" 2>&1
    fi
    log "gather arm $arm (client processes:gather ms): rc $?"
  done
fi
if run fresh 150; then  # k3 serve's CUDA default (engine process): a fresh server's first request, C=1 and C=16
  mkdir -p "$OUT/fresh"
  if [ -n "$DRY" ]; then
    timeout 200 python bench/serve.py --preset debug --concurrency 1 4 --skip transformers in-process \
      --engine-modes process --out "$OUT/fresh/serve.json" > "$OUT/fresh/serve.log" 2>&1
  else
    timeout --kill-after=10 $(( $(left) - 10 )) python bench/serve.py --preset small --concurrency 1 16 \
      --skip transformers in-process --engine-modes process --out "$OUT/fresh/serve.json" > "$OUT/fresh/serve.log" 2>&1
  fi
  log "fresh: rc $?"
fi
if run cache 40; then
  if [ -d /tmp/kcache ] && [ -n "$(ls -A /tmp/kcache)" ]; then
    mkdir -p "$OUT/cache" && (cd /tmp/kcache && tar -cf - . | xz -T0 -6 | split -b 9m - "$OUT/cache/tc.")
    log "cache: $(du -sh "$OUT/cache" | cut -f1) in $(ls "$OUT/cache" | wc -l) parts"
  else
    log "cache: no kernel cache at /tmp/kcache (source .devcache/env.sh first); skipped"
  fi
fi
# The kernels this run compiled that the restored cache lacked, packed apart (a few MB, where the whole cache is too
# large to come back): `bash bench/kernel_cache_merge.sh OUT/kernels_new.tar.xz` adds them to .devcache/.
if [ -d "$KCACHE" ]; then
  (cd "$KCACHE" && find . -type f -newer "$STARTED" -print0) > "$STARTED.list"
  new=$(tr -cd '\0' < "$STARTED.list" | wc -c)
  if [ "$new" -gt 0 ]; then
    (cd "$KCACHE" && tar --null -cf - -T "$STARTED.list" | xz -T0 -6) > "$OUT/kernels_new.tar.xz"
    log "new kernels: $new files, $(du -h "$OUT/kernels_new.tar.xz" | cut -f1) in OUT/kernels_new.tar.xz"
  fi
fi
rm -f "$STARTED" "$STARTED.list"
log "done"
