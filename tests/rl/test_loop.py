"""The RL loop end to end on CPU (tiny model, real sandboxes): SFT warm start, RL steps, checkpoints, metrics,
and a resumed run that equals the unbroken one."""

import dataclasses
import json

import pytest
import torch

from k3.rl.demos import write_demonstrations
from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.sft import SFTConfig, SFTTrainer

TIMING = {"generation_s", "tool_s", "sandbox_setup_s", "verify_s", "rollout_tokens_per_s", "rollout_s", "train_s",
          "step_s", "sandbox_s"}


@pytest.fixture(scope="module")
def start_run(sandbox_home, tokenizer, tmp_path_factory):
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM

    root = tmp_path_factory.mktemp("rl-start")
    made = write_demonstrations("calc", 6, root / "demos.jsonl", show_progress=False)
    assert made == {"examples": 6, "solved": 6, "sandbox_calls": 6}
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                  eos_token_id=tokenizer.eos_token_id))
    sft = SFTTrainer(SFTConfig(data=str(root / "demos.jsonl"), out=str(root / "sft"), steps=3, batch_size=4,
                               device="cpu"), model=model, tokenizer=tokenizer, show_progress=False)
    summary = sft.train()
    assert summary["steps"] == 3 and summary["last_loss"] < summary["first_loss"]
    return root / "sft"


@pytest.fixture(scope="module")
def user_suite(tmp_path_factory):
    """A user task file whose reward (even answer length) varies between samples, so every step updates."""
    path = tmp_path_factory.mktemp("suite") / "tasks.jsonl"
    rows = [{"id": f"say-{i}", "prompt": f"Say something about {word}.", "split": split,
             "verifier": {"type": "python", "function": "tests.rl.verifiers:even_length"},
             "limits": {"turns": 2, "tokens_per_turn": 12, "total_tokens": 24}}
            for i, (word, split) in enumerate([("cats", "train"), ("dogs", "train"), ("owls", "heldout")])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rl_config(start_run, suite, out, **fields):
    return RLConfig.flat(run=str(start_run), suite=str(suite), out=str(out), algo="grpo", group=4, tasks_per_step=2,
                         steps=2, lr=1e-2, heldout_every=2, heldout_tasks=1, save_every=1, device="cpu",
                         max_context=512, temperature=1.0, **fields)


def comparable(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_resumed_rl_run_equals_the_unbroken_run(start_run, user_suite, tmp_path):
    unbroken = RLTrainer(rl_config(start_run, user_suite, tmp_path / "a"), show_progress=False, log=lambda *_: None)
    start = {k: v.clone() for k, v in unbroken.model.state_dict().items()}
    summary = unbroken.train()
    assert summary["steps"] == 2
    assert any(not torch.equal(start[k], v) for k, v in unbroken.model.state_dict().items())  # it did learn
    first = RLTrainer(rl_config(start_run, user_suite, tmp_path / "b"), show_progress=False, log=lambda *_: None)
    first.train(stop_at=1)
    resumed = RLTrainer(RLConfig(out=str(tmp_path / "b")), resume=True, show_progress=False, log=lambda *_: None)
    assert resumed.step == 1
    resumed.train()
    a, b = unbroken.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert comparable(tmp_path / "a" / "metrics.jsonl") == comparable(tmp_path / "b" / "metrics.jsonl")
    records = comparable(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    step = records[1]
    for key in ("reward_mean", "pass_rate", "response_tokens", "episode_tokens", "tool_calls", "tool_errors",
                "generated_tokens", "groups"):
        assert key in step, key
    assert "heldout_pass_rate" in records[0] and "heldout_pass_rate" in records[2]
    assert all("skipped_update" not in r and r["groups_kept"] == 2 for r in records[1:])
    assert (tmp_path / "a" / "metrics.png").is_file()
    with pytest.raises(ValueError, match="already holds an RL run"):
        RLTrainer(rl_config(start_run, user_suite, tmp_path / "a"), show_progress=False)


def test_k3_rl_cli_runs_a_step_and_reads_back(start_run, tmp_path, capsys):
    from k3.cli import main

    out = tmp_path / "cli"
    assert main(["rl", "--run", str(start_run), "--suite", "calc", "--out", str(out), "--algo", "gspo", "--group",
                 "2", "--tasks-per-step", "1", "--steps", "1", "--heldout-tasks", "0", "--device", "cpu"]) == 0
    assert "run written to" in capsys.readouterr().out
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and record["episodes"] == 2
    assert main(["rl", "--suite", "nonsense", "--run", str(start_run), "--out", str(tmp_path / "x")]) == 1


def test_k3_rl_demos_and_k3_sft_from_the_command_line(start_run, tmp_path, capsys):
    from k3.cli import main

    demos = tmp_path / "files.jsonl"
    assert main(["rl", "demos", "--suite", "files", "--count", "3", "--out", str(demos)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"examples": 3, "solved": 3,
                                                                             "sandbox_calls": 3}
    out = tmp_path / "sft"
    assert main(["sft", "--run", str(start_run), "--data", str(demos), "--out", str(out), "--steps", "1",
                 "--batch-size", "2", "--device", "cpu"]) == 0
    assert main(["sft", "--out", str(out), "--resume", "--steps", "2", "--device", "cpu"]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["sft", "--run", str(start_run), "--data", str(bad), "--out", str(tmp_path / "x")]) == 1
    assert "bad.jsonl:1: field 'messages': no assistant message" in capsys.readouterr().err


def test_a_bf16_rollout_copy_follows_every_update(start_run, user_suite, tmp_path):
    """rollout_dtype=bf16 (the default on CUDA): the engine samples from a bf16 copy of the fp32 policy, which
    holds the policy's weights again after every update; fp32 (the default on CPU) shares the policy itself."""
    shared = RLTrainer(rl_config(start_run, user_suite, tmp_path / "shared"), show_progress=False, log=lambda *_: None)
    assert shared.rollout_model is shared.model and shared.engine.model is shared.model
    trainer = RLTrainer(rl_config(start_run, user_suite, tmp_path / "copy", rollout_dtype="bf16"),
                        show_progress=False, log=lambda *_: None)
    copy = trainer.engine.model
    assert copy is trainer.rollout_model and copy is not trainer.model
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    before = {k: v.clone() for k, v in copy.state_dict().items()}
    record = trainer.train_step()
    assert "loss" in record  # the user suite's rewards vary, so the step updated the policy
    moved = 0
    for (name, mine), theirs in zip(copy.state_dict().items(), trainer.model.state_dict().values()):
        assert torch.equal(mine, theirs.to(mine.dtype)), name
        moved += not torch.equal(mine, before[name])
    assert moved > 0
    with pytest.raises(ValueError, match="rollout_dtype"):
        RLConfig(rollout_dtype="fp16")


def test_sft_batches_padded_to_a_multiple_score_the_same_loss(start_run, tokenizer, tmp_path):
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM

    demos = start_run.parent / "demos.jsonl"
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                  eos_token_id=tokenizer.eos_token_id))
    losses, lengths = [], []
    for multiple in (0, 128):
        sft = SFTTrainer(SFTConfig(data=str(demos), out=str(tmp_path / f"sft{multiple}"), steps=1, batch_size=3,
                                   device="cpu", pack_multiple=multiple), model=model, tokenizer=tokenizer,
                         show_progress=False)
        ids, labels, cu = sft.batch(1)
        assert int(cu[-1]) == ids.shape[1]
        lengths.append(ids.shape[1])
        with torch.no_grad():
            losses.append(float(model(ids, cu_seqlens=cu, labels=labels).loss))
    assert lengths[0] % 128 != 0 and lengths[1] % 128 == 0 and lengths[1] > lengths[0]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)  # the filler's labels are ignored


def test_sampled_evaluation_scores_several_episodes_per_task(start_run, user_suite, tmp_path):
    trainer = RLTrainer(rl_config(start_run, user_suite, tmp_path / "eval"), show_progress=False, log=lambda *_: None)
    result = trainer.evaluate(temperature=1.0, outcomes=True, samples=4)
    # one held-out task ("say-2"), four episodes: its outcome is the share of them that passed, the rate their mean
    assert result["heldout_tasks"] == 1 and result["heldout_episodes"] == 4
    share = result["heldout_outcomes"]["say-2"]
    assert share * 4 == round(share * 4) and share == pytest.approx(result["heldout_pass_rate"])
    greedy = trainer.evaluate(outcomes=True)
    assert greedy["heldout_episodes"] == 1 and isinstance(greedy["heldout_outcomes"]["say-2"], bool)
    with pytest.raises(ValueError, match="samples must be at least 1"):
        trainer.evaluate(samples=0)


class ScriptedRunner:
    """Stands in for the rollouts: every group's rewards come from ``script`` in call order, so a test says which
    groups are all-equal. Records the tasks of every call."""

    def __init__(self, script):
        self.script, self.calls, self.stats, self.parked = list(script), [], {}, []

    def _groups(self, tasks, group_size, step):
        from k3.rl.rollout import Episode

        self.calls.append(([t.id for t in tasks], step))
        groups = []
        for index, task in enumerate(tasks):
            rewards = self.script.pop(0)
            assert len(rewards) == group_size
            groups.append([Episode(task, index, s, [1, 2, 3, 4, 5], [False, False, True, True, True], [float("nan")] * 5,
                                   2, done=True, reward=r, finish="submitted", verified=True)
                           for s, r in enumerate(rewards)])
        self.stats = {"generation_s": 1.0, "generated_tokens": 10}
        return groups

    def run(self, tasks, group_size, step=0, indices=None):
        return self._groups(tasks, group_size, step)

    def run_aside(self, tasks, group_size, step, temperature, indices=None):
        return self._groups(tasks, group_size, step)


def test_dynamic_sampling_refills_the_batch_with_fresh_tasks(start_run, tmp_path):
    """DAPO's dynamic sampling drops all-equal groups and draws fresh tasks until the batch holds tasks_per_step
    groups with a signal (at most refill_rounds extra rounds); the surplus of the last round is dropped."""
    config = RLConfig.flat(run=str(start_run), suite="arith", out=str(tmp_path / "refill"), algo="dapo", group=2,
                           tasks_per_step=3, steps=2, lr=1e-3, heldout_tasks=0, device="cpu", max_context=512)
    trainer = RLTrainer(config, show_progress=False, log=lambda *_: None)
    mixed, equal = [0.0, 1.0], [1.0, 1.0]
    # round 0: 3 tasks, 1 kept; refill 1: (3 - 1) * 3 / 1 -> 3 tasks (capped), 1 kept; refill 2: 1 * 6 / 2 = 3
    # tasks, 2 kept: one too many, dropped
    trainer.runner = ScriptedRunner([mixed, equal, [0.0, 0.0], equal, mixed, equal, mixed, mixed, equal])
    record = trainer.train_step()
    assert record["groups_kept"] == 3 and record["refill_rounds"] == 2 and record["refill_groups"] == 5
    assert "loss" in record
    ids = [ids for ids, _ in trainer.runner.calls]
    assert [len(i) for i in ids] == [3, 3, 3]
    assert len({t for i in ids for t in i}) == 9  # fresh tasks in every round
    assert len({step for _, step in trainer.runner.calls}) == 3  # and fresh sampling seeds
    # a batch that cannot fill stops after refill_rounds extra rounds
    trainer.runner = ScriptedRunner([equal] * 3 + [equal] * 3 * 3)
    record = trainer.train_step()
    assert record["groups_kept"] == 0 and record["refill_rounds"] == 3 and "skipped_update" in record
    # drgrpo's normaliser is a constant of the run, the same at every step: max_context
    drgrpo = RLTrainer(dataclasses.replace(config, algo="drgrpo", out=str(tmp_path / "drgrpo")), show_progress=False,
                       log=lambda *_: None)
    assert drgrpo.updater.loss_config.norm_length == 512


def test_a_run_saved_in_the_flat_layout_resumes(start_run, user_suite, tmp_path):
    """RLConfig was flat before it nested the policy, loss and rollout configs: such a run still resumes."""
    from k3.checkpoint.native import load_checkpoint, save_checkpoint
    from k3.cli_config import to_flat

    config = rl_config(start_run, user_suite, tmp_path / "run")
    RLTrainer(config, show_progress=False, log=lambda *_: None).train(stop_at=1)
    flat = {k: v for k, v in to_flat(config).items() if k not in ("weight_decay", "grad_clip", "pack_multiple",
                                                                 "top_p", "tool_timeout", "keep_transcripts")}
    flat.update(clip_low=None, clip_high=None, tau=None)  # the flat layout kept "the algorithm's" as None
    state = load_checkpoint(tmp_path / "run")
    state["rl"] = flat
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", state)
    resumed = RLTrainer(RLConfig(out=str(tmp_path / "run")), resume=True, show_progress=False, log=lambda *_: None)
    assert resumed.config == config and resumed.step == 1
    assert resumed.train()["steps"] == 2


def test_an_sft_run_saved_in_the_flat_layout_resumes(start_run, tokenizer, tmp_path):
    """SFTConfig was flat before its image fields became a section: such a run still resumes, settings intact."""
    from k3.checkpoint.native import load_checkpoint, save_checkpoint
    from k3.cli_config import to_flat

    config = SFTConfig.flat(run=str(start_run), data=str(start_run.parent / "demos.jsonl"), out=str(tmp_path / "sft"),
                            steps=2, batch_size=2, save_every=1, device="cpu", vision_train="projector",
                            max_image_bytes=1 << 20)
    SFTTrainer(config, show_progress=False, log=lambda *_: None).train(stop_at=1)
    flat = {k: v for k, v in to_flat(config).items() if k != "image_fraction"}  # the flat SFTConfig had none
    state = load_checkpoint(tmp_path / "sft")
    assert state["sft"]["images"]["max_image_bytes"] == 1 << 20  # saved in sections now
    state["sft"] = flat
    save_checkpoint(tmp_path / "sft" / "checkpoint.pt", state)
    resumed = SFTTrainer(SFTConfig(out=str(tmp_path / "sft")), resume=True, show_progress=False, log=lambda *_: None)
    assert resumed.config == config and resumed.step == 1
    assert resumed.config.images.vision_train == "projector"
    assert resumed.train()["steps"] == 2


def test_an_sft_time_budget_stops_saves_and_reports_the_steps(start_run, tmp_path, step_clock, capsys):
    """10 s a step against a 25 s budget: steps 1-3 run (the budget is spent after the third), then a save; the
    resumed run takes this session's budget from the command line (15 s: two more steps)."""
    from k3.checkpoint.native import load_checkpoint

    config = SFTConfig(run=str(start_run), data=str(start_run.parent / "demos.jsonl"), out=str(tmp_path / "sft"),
                       steps=10, batch_size=2, save_every=100, device="cpu", time_budget_s=25.0)
    trainer = SFTTrainer(config, show_progress=False)
    step_clock(trainer, 10.0)
    summary = trainer.train()
    assert (summary["steps"], summary["stopped"]) == (3, "time_budget")
    assert load_checkpoint(tmp_path / "sft")["step"] == 3
    assert "time budget of 25 s spent: stopped after step 3 (3 steps this session), saved" in capsys.readouterr().out
    with pytest.raises(ValueError, match="below the 3 steps"):
        SFTTrainer(SFTConfig(out=str(tmp_path / "sft")), resume=True, resume_overrides={"steps": 2})
    resumed = SFTTrainer(SFTConfig(out=str(tmp_path / "sft")), resume=True, show_progress=False,
                         resume_overrides={"time_budget_s": 15.0, "steps": None})
    assert (resumed.config.time_budget_s, resumed.config.steps) == (15.0, 10)
    step_clock(resumed, 10.0)
    summary = resumed.train()
    assert (summary["steps"], summary["stopped"]) == (5, "time_budget")
    assert "stopped after step 5 (2 steps this session)" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4, 5]


def test_an_rl_time_budget_stops_evaluates_saves_and_reports_the_steps(start_run, user_suite, tmp_path, step_clock):
    """10 s a step against 15 s: two steps, then a held-out evaluation (step 2 is no evaluation step) and a save."""
    from k3.checkpoint.native import load_checkpoint

    config = rl_config(start_run, user_suite, tmp_path / "rl").replace(steps=6, heldout_every=5, save_every=5,
                                                                       time_budget_s=15.0)
    trainer = RLTrainer(config, show_progress=False, log=lambda *_: None)
    step_clock(trainer, 10.0)
    summary = trainer.train()
    assert (summary["steps"], summary["stopped"]) == (2, "time_budget")
    assert "last_heldout_pass_rate" in summary
    assert load_checkpoint(tmp_path / "rl")["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and "heldout_pass_rate" in rows[-1]
