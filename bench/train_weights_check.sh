#!/usr/bin/env bash
# The default CUDA training step (bf16 parameters, fp32 masters) against fp32 weights under autocast and the bench's
# best step, in one short GPU run: bash bench/train_weights_check.sh OUT (after `source .devcache/env.sh`).
O=$1; mkdir -p $O
for mw in bf16-params fp32-autocast; do
  timeout 95 python -m k3 train --preset small --device cuda --max-steps 60 --seq-len 4096 --batch-size 4 \
    --max-corpus-mb 3 --master-weights $mw --out /tmp/t_$mw > $O/train_$mw.log 2>&1; echo "$mw rc=$?"
  cp /tmp/t_$mw/metrics.jsonl $O/m_$mw.jsonl 2>/dev/null
done
timeout 60 python bench/train.py --variants k3-small-graphed-step --steps 6 --out $O/bench.json > $O/bench.log 2>&1; echo "bench rc=$?"
timeout 110 python -m pytest -q -x tests/train/test_graphed_step.py tests/train/test_master_weights.py > $O/pytest.log 2>&1; echo "pytest rc=$?"
tail -3 $O/pytest.log; tail -4 $O/bench.log
python - $O <<'PY'
import json, sys, statistics
o = sys.argv[1]
for mw in ("bf16-params", "fp32-autocast"):
    try:
        r = [x for x in map(json.loads, open(f"{o}/m_{mw}.jsonl")) if "step_seconds" in x]
    except OSError:
        print(mw, "no metrics"); continue
    late = [x["step_seconds"] for x in r if x["step"] > 20]
    print(mw, len(r), "steps; first", round(r[0]["step_seconds"], 2), "s; p50 step after 20:",
          round(1000 * statistics.median(late), 1) if late else None, "ms; loss", round(r[0]["loss"], 3), "->", round(r[-1]["loss"], 3))
PY
