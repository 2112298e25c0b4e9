"""Multi-teacher distillation: the reverse-KL advantage, the tokenizer check, routing, that an on-policy run
moves the student towards its teacher, and exact resume."""

import copy
import json
import math

import pytest
import torch

from k3.config import ModelConfig
from k3.data.tokenizer import load_tokenizer, train_bpe
from k3.model import K3ForCausalLM
from k3.rl.distill import DistillConfig, DistillTrainer, exact_reverse_kl, reverse_kl_advantages, topk_forward_kl
from k3.rl.distill_cli import _pairs
from k3.rl.distill_sources import Item, LocalTeacher, PromptSets, check_shared_tokenizer, route
from k3.rl.policy import packed_logprobs

CODE = [f"def f{i}(x):\n    return x + {i}\n" for i in range(200)]
PROSE = [f"The cat number {i} sat on the mat.\n" for i in range(200)]


@pytest.fixture(scope="module")
def shared_tokenizer():
    return train_bpe(CODE + PROSE, 300, show_progress=False)


def _model(tokenizer, seed: int):
    torch.manual_seed(seed)
    return K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                 eos_token_id=tokenizer.eos_token_id)).eval()


def _fine_tuned(model, tokenizer, texts, steps: int, lr: float = 3e-3):
    """A copy of ``model`` moved by a few SFT steps on ``texts``: a teacher near the student, deterministically."""
    teacher = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=lr)
    for step in range(steps):
        batch = [tokenizer.encode(t) for t in texts[step * 8:(step + 1) * 8]]
        logps, _ = packed_logprobs(teacher, batch, torch.device("cpu"))
        (-torch.cat([lp[1:] for lp in logps]).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return teacher.eval()


def _write_prompts(path, texts, cut=12):
    path.write_text("".join(json.dumps({"prompt": t[:cut], "completion": t[cut:]}) + "\n" for t in texts))
    return str(path)


def _config(tmp_path, data, **overrides):
    fields = dict(data=data, out=str(tmp_path / "run"), steps=4, lr=3e-3, prompts_per_domain=2, samples=4,
                  max_new_tokens=10, heldout_prompts=4, heldout_samples=2, heldout_every=2, save_every=2,
                  device="cpu", max_context=128)
    fields.update(overrides)
    return DistillConfig.flat(**fields)


def test_advantage_is_the_hand_computed_reverse_kl():
    # Student p_s = (1/2, 1/4, 1/4), teacher p_t = (1/4, 1/2, 1/4) over three tokens.
    student = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    teacher = torch.log(torch.tensor([0.25, 0.5, 0.25]))
    sampled = torch.tensor([0, 1, 2])
    advantages = reverse_kl_advantages(student[sampled], teacher[sampled])
    log2 = math.log(2)
    torch.testing.assert_close(advantages, torch.tensor([-log2, log2, 0.0]))
    # KL(p_s || p_t) = 1/2 log 2 + 1/4 log(1/2) + 0 = log(2)/4; -E_{y~p_s}[A(y)] is the same number.
    exact = exact_reverse_kl(student[None], teacher[None])
    torch.testing.assert_close(exact, torch.tensor([log2 / 4]))
    torch.testing.assert_close(-(student.exp() * advantages).sum(), torch.tensor(log2 / 4))


def test_topk_forward_kl_with_every_token_is_the_full_kl():
    student = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0]]), -1)
    teacher = torch.log_softmax(torch.tensor([[0.0, 1.0, 0.5]]), -1)
    ce, kl = topk_forward_kl(student, torch.tensor([[0, 1, 2]]), teacher)
    full = (teacher.exp() * (teacher - student)).sum(-1)
    torch.testing.assert_close(kl, full)
    torch.testing.assert_close(ce, -(teacher.exp() * student).sum(-1))


def test_a_teacher_with_another_tokenizer_is_refused(shared_tokenizer, tmp_path):
    shared_tokenizer.save(tmp_path / "tok")
    check_shared_tokenizer(shared_tokenizer, {"same": load_tokenizer(tmp_path / "tok")})  # a reloaded copy is fine
    other = train_bpe(PROSE, 300, show_progress=False)
    with pytest.raises(ValueError, match="teacher 'prose' does not share the student's tokenizer"):
        check_shared_tokenizer(shared_tokenizer, {"prose": other})
    data = {"prose": _write_prompts(tmp_path / "prose.jsonl", PROSE[:20])}
    teachers = {"prose": LocalTeacher("prose", _model(other, 1), other, max_context=128)}
    with pytest.raises(ValueError, match="does not share the student's tokenizer"):
        DistillTrainer(_config(tmp_path, data), student=_model(shared_tokenizer, 0), tokenizer=shared_tokenizer,
                       teachers=teachers, show_progress=False)


def test_routing_sends_each_domain_to_its_own_teacher(shared_tokenizer, tmp_path):
    items = [Item("code", [1], []), Item("prose", [2], []), Item("code", [3], [])]
    assert route(items) == {"code": [0, 2], "prose": [1]}
    with pytest.raises(ValueError, match=r"domain\(s\) \['math'\] have no teacher"):
        PromptSets(items + [Item("math", [4], [])], ["code", "prose"], heldout=0, seed=0)

    student = _model(shared_tokenizer, 0)
    teachers = {"code": LocalTeacher("code", _model(shared_tokenizer, 1), shared_tokenizer, 128),
                "prose": LocalTeacher("prose", _model(shared_tokenizer, 2), shared_tokenizer, 128)}
    seen = {name: [] for name in teachers}
    for name, teacher in teachers.items():
        original = teacher.score

        def recording(sequences, starts, top_k=0, name=name, original=original):
            seen[name].extend(seq[:start] for seq, start in zip(sequences, starts))
            return original(sequences, starts, top_k)

        teacher.score = recording
    # A "domain" field sends a line of the prose file to the code teacher.
    prose_path = tmp_path / "prose.jsonl"
    _write_prompts(prose_path, PROSE[:20])
    with prose_path.open("a") as f:
        f.write(json.dumps({"prompt": CODE[50][:12], "domain": "code"}) + "\n")
    data = {"code": _write_prompts(tmp_path / "code.jsonl", CODE[:20]), "prose": str(prose_path)}
    trainer = DistillTrainer(_config(tmp_path, data, prompts_per_domain=8, heldout_prompts=2), student=student,
                             tokenizer=shared_tokenizer, teachers=teachers, show_progress=False)
    assert len(trainer.prompts.train["code"]) + len(trainer.prompts.heldout["code"]) == 21
    trainer.train_step()
    prompts = {d: {tuple(i.prompt) for i in trainer.prompts.train[d] + trainer.prompts.heldout[d]} for d in teachers}
    assert seen["code"] and seen["prose"]
    assert all(tuple(p) in prompts["code"] for p in seen["code"])
    assert all(tuple(p) in prompts["prose"] for p in seen["prose"])


def test_advantages_are_teacher_minus_sampling_logprobs(shared_tokenizer, tmp_path):
    student = _model(shared_tokenizer, 0)
    teacher_model = _model(shared_tokenizer, 1)
    data = {"code": _write_prompts(tmp_path / "code.jsonl", CODE[:20])}
    trainer = DistillTrainer(_config(tmp_path, data), student=student, tokenizer=shared_tokenizer,
                             teachers={"code": LocalTeacher("code", teacher_model, shared_tokenizer, 128)},
                             show_progress=False)
    items = trainer.prompts.for_step(1, 2)
    sequences = trainer._student_samples(items, [1, 2], 2)
    trainer._score(sequences, top_k=0)
    with torch.no_grad():
        student_lp, _ = packed_logprobs(student, [s.ids for s in sequences], torch.device("cpu"))
        teacher_lp, _ = packed_logprobs(teacher_model, [s.ids for s in sequences], torch.device("cpu"))
    for s, mine, theirs in zip(sequences, student_lp, teacher_lp):
        # the engine's sampling logprobs are the student's own (temperature 1, no filters)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), mine[s.start:], atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(s.advantages), theirs[s.start:] - mine[s.start:], atol=1e-4, rtol=0)


def test_on_policy_distillation_lowers_reverse_kl_to_the_teacher(shared_tokenizer, tmp_path):
    student = _model(shared_tokenizer, 0)
    teacher = _fine_tuned(student, shared_tokenizer, CODE, steps=20)
    data = {"code": _write_prompts(tmp_path / "code.jsonl", CODE[:40])}
    config = _config(tmp_path, data, steps=8, prompts_per_domain=8, samples=8, max_new_tokens=16,
                     heldout_samples=4, heldout_every=8, save_every=8)
    trainer = DistillTrainer(config, student=student, tokenizer=shared_tokenizer,
                             teachers={"code": LocalTeacher("code", teacher, shared_tokenizer, 128)},
                             show_progress=False)
    summary = trainer.train()
    before, after = summary["first"]["heldout_rkl/code"], summary["last"]["heldout_rkl/code"]
    assert before > 0.3  # the teacher really differs
    assert after < 0.9 * before, (before, after)  # measured: 0.858 -> 0.679


def test_resume_equals_the_unbroken_run(shared_tokenizer, tmp_path):
    teacher_models = {"code": _model(shared_tokenizer, 1), "prose": _model(shared_tokenizer, 2)}
    data = {"code": _write_prompts(tmp_path / "code.jsonl", CODE[:20]),
            "prose": _write_prompts(tmp_path / "prose.jsonl", PROSE[:20])}

    def teachers():
        return {n: LocalTeacher(n, m, shared_tokenizer, 128) for n, m in teacher_models.items()}

    deterministic = ("train_rkl/", "heldout_", "teacher_", "pg_loss", "topk_forward_kl", "grad_norm", "sampled_tokens")

    def records(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if k == "step" or k.startswith(deterministic)} for r in rows]

    whole = DistillTrainer(_config(tmp_path / "a", data, mode="mixed"), student=_model(shared_tokenizer, 0),
                           tokenizer=shared_tokenizer, teachers=teachers(), show_progress=False)
    whole.train()
    first = DistillTrainer(_config(tmp_path / "b", data, mode="mixed"), student=_model(shared_tokenizer, 0),
                           tokenizer=shared_tokenizer, teachers=teachers(), show_progress=False)
    first.train(stop_at=2)
    with pytest.raises(ValueError, match="already holds a distillation run"):
        DistillTrainer(_config(tmp_path / "b", data), student=_model(shared_tokenizer, 0),
                       tokenizer=shared_tokenizer, teachers=teachers(), show_progress=False)
    resumed = DistillTrainer(DistillConfig(out=str(tmp_path / "b" / "run")), resume=True, teachers=teachers(),
                             show_progress=False)
    assert resumed.step == 2 and resumed.config.mode == "mixed"
    resumed.train()
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert records(tmp_path / "a" / "run" / "metrics.jsonl") == records(tmp_path / "b" / "run" / "metrics.jsonl")


def test_offline_and_forward_kl_baselines_train(shared_tokenizer, tmp_path):
    student = _model(shared_tokenizer, 0)
    teacher = LocalTeacher("code", _model(shared_tokenizer, 1), shared_tokenizer, 128)
    data = {"code": _write_prompts(tmp_path / "code.jsonl", CODE[:20])}
    for mode, key in (("offline", "sft_loss"), ("forward-kl", "topk_forward_kl")):
        trainer = DistillTrainer(_config(tmp_path / mode, data, mode=mode, top_k=8), student=copy.deepcopy(student),
                                 tokenizer=shared_tokenizer, teachers={"code": teacher}, show_progress=False)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        record = trainer.train_step()
        assert math.isfinite(record[key]) and record[key] > 0 and "pg_loss" not in record
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_cli_pairs_need_name_and_path():
    assert _pairs(["code=/a", "docs=/b"], "--teacher") == {"code": "/a", "docs": "/b"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        _pairs(["/just/a/path"], "--teacher")


def test_a_time_budget_stops_evaluates_saves_and_reports_the_steps(shared_tokenizer, tmp_path, step_clock):
    """10 s a step against 15 s: two steps, then a held-out evaluation (step 2 is no evaluation step) and a save."""
    from k3.checkpoint.native import load_checkpoint

    data = {"code": _write_prompts(tmp_path / "code.jsonl", CODE[:20])}
    teacher = LocalTeacher("code", _model(shared_tokenizer, 1), shared_tokenizer, 128)
    trainer = DistillTrainer(_config(tmp_path, data, steps=6, heldout_every=5, save_every=5, time_budget_s=15.0),
                             student=_model(shared_tokenizer, 0), tokenizer=shared_tokenizer,
                             teachers={"code": teacher}, show_progress=False, log=lambda *_: None)
    step_clock(trainer, 10.0)
    summary = trainer.train()
    assert (summary["steps"], summary["stopped"]) == (2, "time_budget")
    assert "heldout_rkl/code" in summary["last"]
    assert load_checkpoint(tmp_path / "run")["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and "heldout_rkl/code" in rows[-1]


def test_a_run_saved_before_the_time_budget_resumes(shared_tokenizer, tmp_path):
    """distill_config.json of an earlier run is flat (DistillConfig had no sections) and has no time_budget_s (nor
    any field added since): it still resumes, settings intact."""
    from k3.checkpoint.native import load_checkpoint, save_checkpoint
    from k3.cli_config import to_flat

    data = {"code": _write_prompts(tmp_path / "code.jsonl", CODE[:20])}
    teacher = LocalTeacher("code", _model(shared_tokenizer, 1), shared_tokenizer, 128)
    config = _config(tmp_path, data, steps=2, heldout_every=5, save_every=1)
    DistillTrainer(config, student=_model(shared_tokenizer, 0), tokenizer=shared_tokenizer, teachers={"code": teacher},
                   show_progress=False, log=lambda *_: None).train(stop_at=1)
    state = load_checkpoint(tmp_path / "run")
    assert state["distill"]["heldout"]["every"] == 5  # saved in sections now
    state["distill"] = {k: v for k, v in to_flat(config).items() if k != "time_budget_s"}
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", state)
    resumed = DistillTrainer(DistillConfig(out=str(tmp_path / "run")), resume=True, teachers={"code": teacher},
                             show_progress=False, log=lambda *_: None)
    assert resumed.config == config and resumed.step == 1
    assert resumed.train()["steps"] == 2
