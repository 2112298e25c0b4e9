#!/usr/bin/env bash
# The default CUDA training step (bf16 parameters, fp32 masters) against fp32 weights under autocast and the bench's
# best step, in one short GPU run: bash bench/train_weights_check.sh OUT (after `source .devcache/env.sh`).
O=$1; mkdir -p $O
# bf16-params-torch-step: the same weights with the master step before the fused pass (K3_MASTER_ADAMW=torch).
for run in bf16-params fp32-autocast bf16-params-torch-step; do
  mw=${run%-torch-step}; step=auto; [ "$run" != "$mw" ] && step=torch
  K3_MASTER_ADAMW=$step timeout 95 python -m k3 train --preset small --device cuda --max-steps 60 --seq-len 4096 \
    --batch-size 4 --max-corpus-mb 3 --master-weights $mw --out /tmp/t_$run > $O/train_$run.log 2>&1; echo "$run rc=$?"
  cp /tmp/t_$run/metrics.jsonl $O/m_$run.jsonl 2>/dev/null
done
timeout 60 python bench/train.py --variants k3-small-graphed-step --steps 6 --out $O/bench.json > $O/bench.log 2>&1; echo "bench rc=$?"
timeout 110 python -m pytest -q -x tests/train/test_master_adamw.py tests/train/test_graphed_step.py tests/train/test_master_weights.py > $O/pytest.log 2>&1; echo "pytest rc=$?"
tail -3 $O/pytest.log; tail -4 $O/bench.log
python - $O <<'PY'
import json, sys, statistics
o = sys.argv[1]
for mw in ("bf16-params", "fp32-autocast", "bf16-params-torch-step"):
    try:
        r = [x for x in map(json.loads, open(f"{o}/m_{mw}.jsonl")) if "step_seconds" in x]
    except OSError:
        print(mw, "no metrics"); continue
    late = [x["step_seconds"] for x in r if x["step"] > 20]
    print(mw, len(r), "steps; first", round(r[0]["step_seconds"], 2), "s; p50 step after 20:",
          round(1000 * statistics.median(late), 1) if late else None, "ms; loss", round(r[0]["loss"], 3), "->", round(r[-1]["loss"], 3))
PY
