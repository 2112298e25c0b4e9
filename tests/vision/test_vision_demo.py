"""`k3 vision demo` end to end at toy settings: it trains, reports every question kind before and after against
chance, writes the curve and a model that `k3 eval --task vqa ocr` reads."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("PIL")

from k3.cli import main  # noqa: E402
from k3.vision.synthetic_qa import KINDS  # noqa: E402


def test_demo_settings_refuse_what_cannot_run():
    from k3.vision.demo import DemoSettings

    with pytest.raises(ValueError, match="multiple of 28"):
        DemoSettings(image_size=100)
    with pytest.raises(ValueError, match="kinds"):
        DemoSettings(kinds=("colour", "smell"))
    with pytest.raises(ValueError, match="steps"):
        DemoSettings(steps=0)


def test_demo_refuses_a_folder_it_did_not_write_before_training(tmp_path):
    from k3.vision.demo import DemoSettings, run_demo

    foreign = tmp_path / "model"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"someone else's weights")
    with pytest.raises(ValueError, match="does not hold an earlier"):
        run_demo(DemoSettings(), out=foreign, progress=False)
    assert (foreign / "model.safetensors").read_bytes() == b"someone else's weights"


@pytest.mark.slow
def test_demo_contract_end_to_end(tmp_path, capsys):
    out = tmp_path / "vqa"
    assert main(["vision", "demo", "--out", str(out), "--steps", "20", "--batch-size", "10", "--eval-count", "25",
                 "--eval-every", "10", "--vision-width", "32", "--vision-layers", "1", "--vision-heads", "2",
                 "--vision-head-dim", "16", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("before", "after", "chance", "majority"):
        assert set(report[key]) == set(KINDS), key
        assert all(0 <= v <= 1 for v in report[key].values())
    assert report["chance"]["shape"] == pytest.approx(1 / 3) and report["chance"]["text"] == pytest.approx(1e-3)
    assert [point["step"] for point in report["curve"]] == [0, 10, 20]
    assert all(set(point) == {"step", *KINDS} for point in report["curve"])
    assert report["cpu_seconds"] > 0 and report["train_images_per_second"] > 0
    assert report["last_loss"] < report["first_loss"]
    assert 0 <= report["text_letters"]["after"] <= 1
    assert json.loads((out / "report.json").read_text())["after"] == report["after"]
    assert (out / "curve.png").read_bytes()[:4] == b"\x89PNG"

    rows_path = tmp_path / "rows.json"
    assert main(["eval", "--run", str(out), "--task", "vqa", "ocr", "--n", "10", "--json", str(rows_path),
                 "--quiet"]) == 0
    rows = json.loads(rows_path.read_text())
    assert {r["task"] for r in rows} == {"vqa", "ocr", *(f"vqa/{k}" for k in KINDS if k != "text")}
    assert all(r["length"] == 84 and 0 <= r["accuracy"] <= 1 for r in rows)


@pytest.mark.slow
def test_the_ocr_like_kind_is_learned():
    """The text kind's layout (three large letters, a cell each) is readable by the demo's model: trained on text
    alone for 250 steps (~1.5 CPU-minutes) it reads most answers (chance 0.001; smaller text at a free place
    stayed at 0)."""
    from k3.vision.demo import DemoSettings, run_demo

    report = run_demo(DemoSettings(kinds=("text",), steps=250, eval_count=60, eval_every=250), progress=False,
                      log=lambda *_: None)
    assert report["before"]["text"] < 0.05
    assert report["after"]["text"] > 0.5 and report["text_letters"]["after"] > 0.8
