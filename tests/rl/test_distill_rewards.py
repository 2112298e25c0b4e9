"""k3 distill: the top-k reverse-KL estimator and task rewards from an RL suite (--rl-suite) in the advantage."""

import json
import math

import pytest
import torch

from k3.config import ModelConfig
from k3.data.tokenizer import train_bpe
from k3.model import K3ForCausalLM
from k3.rl import distill as distill_module
from k3.rl.distill import DistillConfig, DistillTrainer, exact_reverse_kl, topk_reverse_kl
from k3.rl.distill_sources import LocalTeacher
from k3.rl.distill_tasks import centred_rewards, load_reward_suite, parse_rl_suite, single_turn_answer, task_reward
from k3.rl.policy import packed_logprobs
from k3.rl.suites import get_suite

TEXTS = [f"Compute {i}+{i * 3}. The answer is {i * 4}.\n" for i in range(200)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(TEXTS, 300, show_progress=False)


def _model(tokenizer, seed):
    torch.manual_seed(seed)
    return K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                 eos_token_id=tokenizer.eos_token_id)).eval()


def test_topk_reverse_kl_is_the_kl_of_the_coarsened_distributions():
    # Student (0.5, 0.3, 0.2), teacher (0.2, 0.5, 0.3); top-2 of the teacher: ids 1, 2; bucket: id 0.
    student = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    teacher = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    ids = torch.tensor([[1, 2]])
    got = topk_reverse_kl(student, ids, teacher.gather(1, ids))
    by_hand = 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.5 * math.log(0.5 / 0.2)
    torch.testing.assert_close(got, torch.tensor([by_hand]))  # with one id outside, the bucket is that id: exact
    # every id in the top-k: the full reverse KL, and its gradient
    logits = torch.tensor([[1.0, -0.5, 0.3, 2.0]], requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([[0.2, 0.1, -1.0, 0.5]]), -1)
    all_ids = torch.tensor([[3, 0, 1, 2]])
    got = topk_reverse_kl(torch.log_softmax(logits, -1), all_ids, teacher.gather(1, all_ids))
    (grad,) = torch.autograd.grad(got.sum(), logits)
    exact = exact_reverse_kl(torch.log_softmax(logits, -1), teacher)
    (exact_grad,) = torch.autograd.grad(exact.sum(), logits)
    torch.testing.assert_close(got, exact.detach())
    torch.testing.assert_close(grad, exact_grad)
    # a top-2 of four: a lower bound on the full KL
    two = topk_reverse_kl(torch.log_softmax(logits.detach(), -1), all_ids[:, :2], teacher.gather(1, all_ids[:, :2]))
    assert 0 <= float(two) <= float(exact.detach())


def test_single_turn_answers_are_scored_by_the_suite_verifier(tokenizer):
    task = get_suite("calc").task("train", 0)
    expected = task.meta["answer"]
    submit = f'<tool_call>{{"name": "submit", "arguments": {{"answer": "{expected}"}}}}</tool_call>'
    assert single_turn_answer(submit) == expected
    assert single_turn_answer(f"  {expected}\n") == expected
    assert single_turn_answer('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>') is None
    eos = tokenizer.eos_token_id
    assert task_reward(task, tokenizer.encode(submit) + [eos], tokenizer) == 1.0
    assert task_reward(task, tokenizer.encode(expected + "0"), tokenizer) == 0.0
    assert parse_rl_suite("calc") == ("calc", 1.0) and parse_rl_suite("calc:0.25") == ("calc", 0.25)
    assert parse_rl_suite("/tmp/a:b/tasks.jsonl:2") == ("/tmp/a:b/tasks.jsonl", 2.0)
    assert centred_rewards([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1]) == [0.5, -0.5, 0.0, 0.0]


def test_a_suite_with_command_verifiers_is_refused(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t{i}", "prompt": "make the test pass", "split": split,
             "verifier": {"type": "command", "command": "true"}} for i, split in enumerate(("train", "heldout"))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="command verifier"):
        load_reward_suite(str(path), 1.0, 4, 4)


def test_the_task_reward_enters_the_advantage_with_its_weight(tokenizer, tmp_path, monkeypatch):
    weight = 0.5
    student, teacher_model = _model(tokenizer, 0), _model(tokenizer, 1)
    config = DistillConfig.flat(out=str(tmp_path / "run"), steps=1, lr=1e-3, prompts_per_domain=3, samples=4,
                                max_new_tokens=6, heldout_prompts=2, heldout_samples=1, rl_suites={"calc": weight},
                                suite_tasks=8, device="cpu", max_context=1024)
    trainer = DistillTrainer(config, student=student, tokenizer=tokenizer, show_progress=False,
                             teachers={"calc": LocalTeacher("calc", teacher_model, tokenizer, 1024)})
    assert all(item.task is not None for item in trainer.prompts.train["calc"])

    def fake_reward(task, completion_ids, tokenizer):  # a reward that differs between siblings
        return float(sum(completion_ids) % 2)

    monkeypatch.setattr(distill_module, "task_reward", fake_reward)
    seen = []
    monkeypatch.setattr(trainer.updater, "update", lambda sequences: seen.extend(sequences) or {})
    record = trainer.train_step()
    assert len(seen) == 12 and "train_reward/calc" in record
    rewards = [fake_reward(None, s.ids[s.start:], None) for s in seen]
    assert len(set(rewards)) == 2, "pick a fake reward that differs within the batch"
    groups = {}
    for s, r in zip(seen, rewards):
        groups.setdefault(s.group, []).append(r)
    with torch.no_grad():
        teacher_lp, _ = packed_logprobs(teacher_model, [s.ids for s in seen], torch.device("cpu"))
    for s, r, theirs in zip(seen, rewards, teacher_lp):
        dense = theirs[s.start:] - torch.tensor(s.rollout_logprobs)
        bonus = weight * (r - sum(groups[s.group]) / len(groups[s.group]))
        torch.testing.assert_close(torch.tensor(s.advantages), dense + bonus, atol=1e-4, rtol=0)
    held = trainer.evaluate()
    assert 0.0 <= held["heldout_pass/calc"] <= 1.0 and 0.0 <= held["teacher_heldout_pass/calc"] <= 1.0


def test_topk_estimator_trains_with_the_reward_only_in_the_policy_gradient(tokenizer, tmp_path, monkeypatch):
    student, teacher_model = _model(tokenizer, 0), _model(tokenizer, 1)
    config = DistillConfig.flat(out=str(tmp_path / "run"), steps=1, lr=1e-3, prompts_per_domain=2, samples=2,
                                max_new_tokens=6, heldout_prompts=2, heldout_samples=1, rl_suites={"calc": 2.0},
                                suite_tasks=8, estimator="topk", top_k=8, device="cpu", max_context=1024)
    trainer = DistillTrainer(config, student=student, tokenizer=tokenizer, show_progress=False,
                             teachers={"calc": LocalTeacher("calc", teacher_model, tokenizer, 1024)})
    monkeypatch.setattr(distill_module, "task_reward", lambda task, ids, tok: float(sum(ids) % 2))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    captured = []
    update = trainer.updater.update
    monkeypatch.setattr(trainer.updater, "update", lambda sequences: captured.extend(sequences) or update(sequences))
    record = trainer.train_step()
    assert record["topk_reverse_kl"] > 0 and math.isfinite(record["pg_loss"])
    for s in captured:  # no reverse-KL term in the advantage: only weight x the centred reward, one per sequence
        assert len(set(s.advantages)) == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_the_batch_baseline_only_shifts_the_sampled_advantages():
    from k3.rl.distill import TokenSequence

    sequences = [TokenSequence("a", [1, 2, 3], 1, "pg", advantages=[-1.0, -3.0]),
                 TokenSequence("b", [1, 2], 1, "pg", advantages=[-2.0]),
                 TokenSequence("a", [1, 2], 1, "sft")]
    DistillTrainer._subtract_baseline(sequences)
    assert sequences[0].advantages == [1.0, -1.0] and sequences[1].advantages == [0.0]
    assert sequences[2].advantages is None


def test_a_top_k_of_the_whole_vocabulary_takes_the_teachers_full_distributions(tokenizer):
    import copy

    from k3.rl.distill import TokenSequence

    teacher = LocalTeacher("a", _model(tokenizer, 1), tokenizer, 256)
    trainer = DistillTrainer.__new__(DistillTrainer)  # only _score's state: the teachers and the config
    trainer.teachers, trainer.config = {"a": teacher}, DistillConfig.flat(estimator="topk")
    sequences = [TokenSequence("a", ids, 3, "pg", rollout_logprobs=[0.0] * (len(ids) - 3))
                 for ids in (tokenizer.encode(text) for text in TEXTS[:3])]
    full, listed = copy.deepcopy(sequences), copy.deepcopy(sequences)
    trainer._score(full, teacher.vocab_size)
    trainer._score(listed, teacher.vocab_size - 1)  # through engine.score's top-k lists
    for a, b in zip(full, listed):
        torch.testing.assert_close(torch.tensor(a.teacher_logprobs), torch.tensor(b.teacher_logprobs), atol=1e-4, rtol=0)
        assert a.top_logprobs.shape == (len(a.ids) - 3, teacher.vocab_size)
        torch.testing.assert_close(a.top_logprobs.gather(1, b.top_ids), b.top_logprobs, atol=1e-4, rtol=0)
