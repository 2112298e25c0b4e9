#!/usr/bin/env bash
# The serving and long-context numbers of BENCHMARKS.md in one call on one GPU (about 8 minutes on an H100):
#   probe     the GPU, and whether SDPA's flash / efficient kernels take MLA's lower-right causal prefill at 1M
#   serve     bench/serve.py --preset small: engine one by one, engine in process C=64, k3 serve C=1 / 16 / 64
#             with the engine in the server's process and then in its own process (--engine-modes, same
#             requests), each fresh server's warm-up and first-request TTFT, and chat at C=64 plain / with
#             tools / json_schema
#   run       a random-weight `small` run directory (bench/random_run.py; k3 eval and k3 serve read runs)
#   eval      k3 eval --task needle_single mqar --lengths 1M (seconds and peak memory per task)
#   serve1m   k3 serve --max-context 1048576: warm-up, then one request with a 1M-token prompt (TTFT, peak memory
#             as nvidia-smi sees the server and its engine process)
#             (expected total about 8.5 minutes; should the 10-minute limit cut it, the rest has been written)
# Each part runs under its own timeout; summary.json is rewritten as each part ends (status, seconds, numbers).
#
# K3_SERVE_PARTS picks parts (default "probe serve run eval serve1m"; serve1m needs run), for a call that runs
# something else first.
#
# Usage: bench/serve_gpu.sh OUT_DIR            on the GPU
#        bench/serve_gpu.sh OUT_DIR --cpu-check the same logic on CPU: debug preset, tiny lengths (minutes)
# Files in OUT_DIR (7): summary.json probe.log serve.json serve.log run.log eval.json eval.log
set -u
OUT=${1:?usage: bench/serve_gpu.sh OUT_DIR [--cpu-check]}
MODE=${2:-gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RUN_DIR=$(mktemp -d /tmp/k3_serve_gpu_run.XXXXXX)
trap 'rm -rf "$RUN_DIR"' EXIT
PARTS=" ${K3_SERVE_PARTS:-probe serve run eval serve1m} "
want() { [[ "$PARTS" == *" $1 "* ]]; }

if [ "$MODE" = "--cpu-check" ]; then
  export OMP_NUM_THREADS=1
  PRESET=debug DEVICE=cpu LENGTH=2K LONG_CONTEXT=4096
  SERVE_ARGS=(--prompt 64 --new 8 --concurrency 1 4 8 --threads 1 --baseline-requests 2)
  T_PROBE=60 T_SERVE=500 T_RUN=120 T_EVAL=300 T_SERVE1M=300
else
  PRESET=small DEVICE=cuda LENGTH=1M LONG_CONTEXT=1048576
  SERVE_ARGS=()
  T_PROBE=40 T_SERVE=360 T_RUN=60 T_EVAL=150 T_SERVE1M=100
fi

# summary.json: {"mode", "parts": {name: {"status", "seconds", ...}}}, rewritten after every part.
record() {  # record NAME STATUS SECONDS [JSON-FILE-TO-EMBED]
  python - "$OUT/summary.json" "$MODE" "$@" <<'PY'
import json, sys
from pathlib import Path
path, mode, name, status, seconds, *embed = sys.argv[1:]
summary = json.loads(Path(path).read_text()) if Path(path).is_file() else {"mode": mode, "parts": {}}
part = {"status": status, "seconds": float(seconds)}
for file in embed:
    try:
        part["result"] = json.loads(Path(file).read_text())
    except (OSError, ValueError) as error:
        part["result_error"] = f"{file}: {error}"
summary["parts"][name] = part
Path(path).write_text(json.dumps(summary, indent=1) + "\n")
PY
}

part() {  # part NAME TIMEOUT LOG CMD... : run CMD under timeout, append to LOG, record status and seconds
  local name=$1 limit=$2 log=$3; shift 3
  local start=$(date +%s.%N)
  echo "== $name: $* (timeout ${limit}s)" >> "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  local status=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="timed out after ${limit}s"
  [ $rc -ne 0 ] && [ "$status" = ok ] && status="failed (exit $rc)"
  LAST_SECONDS=$(python -c "print(round($(date +%s.%N) - $start, 1))")
  LAST_STATUS=$status
  echo "== $name: $status in ${LAST_SECONDS}s" >> "$log"
}

# --- probe -------------------------------------------------------------------------------------------------
want probe && part probe "$T_PROBE" "$OUT/probe.log" python - "$DEVICE" <<'PY'
import sys, torch
device = sys.argv[1]
print("torch", torch.__version__, "device", torch.cuda.get_device_name() if device == "cuda" else "cpu")
if device == "cuda":
    free, total = torch.cuda.mem_get_info()
    print(f"free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
    # MLA's last prefill chunk at 1M: 49,152 queries after the rest of the context, 8 heads, head dim 128.
    for queries, keys in [(65536, 1 << 20), (49152, 1 << 20), (8192, 131072)]:
        q = torch.empty(1, 8, queries, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(1, 8, keys, 128, device="cuda", dtype=torch.bfloat16)
        params = SDPAParams(q, k, k, None, 0.0, False, False)
        print(f"lower-right causal {queries} x {keys}: flash {can_use_flash_attention(params, True)}, "
              f"efficient {can_use_efficient_attention(params, True)}")
        del q, k
PY
want probe && record probe "$LAST_STATUS" "$LAST_SECONDS"

# The server's packages: a GPU image without them (and without a package index) gets them from .whl/, which
# bench/gpu_wheels.sh fills on a machine that has one; without them the server parts are skipped, said so.
MISSING=$(python -c "import fastapi, uvicorn, httpx, llguidance" 2>&1 | tail -1)
WHY="serving packages missing ($MISSING); run bash bench/gpu_wheels.sh before the call"
[ -n "$MISSING" ] && echo "$WHY: server parts skipped" | tee -a "$OUT/serve.log"
skip() {  # skip NAME: record a server part as not run
  record "$1" "skipped: $WHY" 0
}

# --- serve ---------------------------------------------------------------------------------------------------
if ! want serve; then
  :
elif [ -z "$MISSING" ]; then
  part serve "$T_SERVE" "$OUT/serve.log" python bench/serve.py --preset "$PRESET" --device "$DEVICE" \
    --skip transformers --mixed tools json_schema --engine-modes in-process process --out "$OUT/serve.json" \
    "${SERVE_ARGS[@]}"
  record serve "$LAST_STATUS" "$LAST_SECONDS" "$OUT/serve.json"
else
  skip serve
fi

# --- a random run, then k3 eval at 1M ---------------------------------------------------------------------------
want run && part run "$T_RUN" "$OUT/run.log" python bench/random_run.py --preset "$PRESET" --out "$RUN_DIR" --device "$DEVICE"
want run && record run "$LAST_STATUS" "$LAST_SECONDS"

want eval && part eval "$T_EVAL" "$OUT/eval.log" python -m k3 eval --run "$RUN_DIR" --device "$DEVICE" \
  --task needle_single mqar --lengths "$LENGTH" --n 1 --json "$OUT/eval.json" --quiet
want eval && record eval "$LAST_STATUS" "$LAST_SECONDS" "$OUT/eval.json"

# --- k3 serve at 1M context -------------------------------------------------------------------------------------
want serve1m || { echo "done: $OUT/summary.json"; exit 0; }
[ -n "$MISSING" ] && { skip serve1m; echo "done: $OUT/summary.json"; exit 0; }
part serve1m "$T_SERVE1M" "$OUT/eval.log" python - "$RUN_DIR" "$DEVICE" "$LONG_CONTEXT" "$OUT/serve1m.json" <<'PY'
import json, subprocess, sys, threading, time
import httpx
run, device, context, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
server = subprocess.Popen([sys.executable, "-m", "k3", "serve", "--run", run, "--device", device, "--port", "0",
                           "--max-context", str(context), "--max-batch", "4", "--served-model-name", "run"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines, peak = [], [0]
def drain():
    for line in server.stdout:
        lines.append(line)
        print(line, end="", flush=True)
threading.Thread(target=drain, daemon=True).start()
def watch():  # the memory of the server and its engine process as nvidia-smi sees it (allocated + cached + context)
    while server.poll() is None:
        if device == "cuda":
            try:
                pids = {str(server.pid), *open(f"/proc/{server.pid}/task/{server.pid}/children").read().split()}
            except OSError:
                pids = {str(server.pid)}
            used = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True).stdout
            total = 0
            for row in used.splitlines():
                pid, mib = (x.strip() for x in row.split(","))
                total += int(mib) if pid in pids else 0
            peak[0] = max(peak[0], total)
        time.sleep(0.5)
threading.Thread(target=watch, daemon=True).start()
result = {}
try:
    while not any(" on http://" in line for line in lines):
        if server.poll() is not None or time.perf_counter() - start > 600:
            raise SystemExit(f"k3 serve did not start: {''.join(lines)[-2000:]}")
        time.sleep(0.1)
    url = next(l for l in lines if " on http://" in l).split(" on ")[1].split()[0]
    while httpx.get(f"{url}/health", timeout=60).status_code != 200:
        time.sleep(0.2)
    result["ready_s"] = time.perf_counter() - start
    result["warmup_s"] = httpx.get(f"{url}/health", timeout=60).json()["warmup_s"]
    prompt = [7 + (i * 7919) % 900 for i in range(context - 16)]
    sent = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", timeout=600,
                       json={"model": "run", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    result.update(status=reply.status_code, prompt_tokens=len(prompt), seconds=time.perf_counter() - sent,
                  reply=reply.json().get("usage") or reply.text[:500])
finally:
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
    result["peak_process_mib"] = peak[0]
    json.dump(result, open(out, "w"), indent=1)
    print(json.dumps(result))
PY
record serve1m "$LAST_STATUS" "$LAST_SECONDS" "$OUT/serve1m.json"
rm -f "$OUT/serve1m.json"  # embedded in summary.json; keeps OUT within its file count

echo "done: $OUT/summary.json"
