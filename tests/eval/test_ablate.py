"""k3 ablate: the plan changes one switch per arm and shares identical runs; a small ablation runs end to end,
resumes without rerunning, and its report holds every arm."""

import json

import pytest

from k3.config import ModelConfig
from k3.eval.ablate import AXES, AblationSettings, arm_changes, mqar_trained_length, plan, run_ablation
from k3.eval.ablation_report import markdown_tables


def test_arms_change_one_switch_each():
    base = ModelConfig.from_preset("tiny")  # 8 layers, MLA at 4 and 8
    assert arm_changes(base, "attention", "hybrid")[0]["layer_types"] == base.layer_types
    assert arm_changes(base, "attention", "kda_only")[0]["layer_types"] == ["kda"] * 8
    assert arm_changes(base, "attention", "one_to_one")[0]["layer_types"] == ["kda", "mla"] * 4
    assert arm_changes(base, "residuals", "plain") == ({"attn_res_block_size": 0}, {})
    assert arm_changes(base, "balancing", "quantile_single") == ({"moe_balancing": "quantile"}, {"qb_iters": 1})
    assert arm_changes(base, "balancing", "aux_loss")[1]["moe_aux_loss"] > 0
    assert arm_changes(base, "moe", "full") == ({"moe_latent_size": None}, {})
    with pytest.raises(ValueError, match="unknown arm"):
        arm_changes(base, "moe", "huge")


def test_plan_shares_identical_configurations():
    entries = plan(AblationSettings(base="tiny", seeds=2))
    assert len(entries) == 2 * sum(len(arms) for arms in AXES.values())
    keys = {(e["axis"], e["arm"], e["seed"]): e["key"] for e in entries}
    # tiny is the 3:1 hybrid with AttnRes, QB, the lower-bounded gate and latent experts: one run per seed.
    for seed in range(2):
        shared = {keys[("attention", "hybrid", seed)], keys[("residuals", "attn_res", seed)],
                  keys[("balancing", "quantile", seed)], keys[("kda_gate", "lower_bound", seed)],
                  keys[("moe", "latent", seed)]}
        assert len(shared) == 1
    assert keys[("attention", "hybrid", 0)] != keys[("attention", "hybrid", 1)]
    assert len(set(keys.values())) == 2 * (1 + 3 + 1 + 4 + 1 + 1)


def test_small_ablation_runs_resumes_and_reports(tmp_path, corpus_dir):
    settings = AblationSettings(base="debug", axes=("kda_gate",), steps=4, seeds=1, seq_len=32, batch_size=2,
                                warmup_steps=1, recall_fraction=0.5, recall_pairs=2, recall_queries=6,
                                recall_weight=2.0, data=(str(corpus_dir),), eval_every=2)
    logged = []
    rows = run_ablation(settings, tmp_path / "abl", log=logged.append)
    assert {(r["axis"], r["arm"]) for r in rows} == {("kda_gate", "lower_bound"), ("kda_gate", "softplus")}
    for r in rows:
        assert r["val_loss"] > 0 and 0 <= r["mqar_trained"] <= 1 and 0 <= r["mqar_4x"] <= 1
        assert r["maxvio_mean"] >= 0  # reported (QB's balance itself: tests/layers/test_qb_*.py)
        assert [s for s, _ in r["val_curve"]] == [0, 2, 4]
    saved = json.loads((tmp_path / "abl" / "results.json").read_text())
    assert len(saved) == 2
    report = (tmp_path / "abl" / "report.md").read_text()
    assert "| softplus | 1 |" in report and "MQAR @4L" in report
    assert "2 pairs, 6 queries" in report and "weighted 2x" in report and "at 128" in report
    assert (tmp_path / "abl" / "kda_gate.png").read_bytes()[:4] == b"\x89PNG"
    logged.clear()
    run_ablation(settings, tmp_path / "abl", log=logged.append)
    assert "0 to run" in logged[0]


def test_report_spread_over_seeds():
    rows = [{"axis": "moe", "arm": "latent", "val_loss": v, "mqar_trained": 0.5, "mqar_4x": 0.25, "maxvio_mean": 0.0,
             "maxvio_p99": 0.0, "tokens_per_s": 100.0, "mqar_chance": 1 / 32} for v in (4.0, 5.0)]
    table = markdown_tables(rows)
    assert "| latent | 2 | 4.5000 [4.0000, 5.0000] | 0.500 |" in table


def test_mqar_is_measured_at_the_length_of_the_trained_recall_sequences():
    assert mqar_trained_length(AblationSettings(seq_len=64)) == 64
    assert mqar_trained_length(AblationSettings(seq_len=256, recall_length=63)) == 63  # four per row
    assert mqar_trained_length(AblationSettings(seq_len=64, recall_length=64)) == 64  # one per row
