"""A teacher in a Ray actor gives what the same teacher gives in process (slow: starts a local Ray)."""

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'k3[ray]')")

pytestmark = pytest.mark.slow


def test_ray_teacher_scores_as_the_local_teacher(tmp_path):
    from k3.checkpoint.native import directory_files, save_checkpoint
    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.infer.sampling import SamplingParams
    from k3.model import K3ForCausalLM
    from k3.rl.distill_sources import LocalTeacher, RayTeacher

    tokenizer = train_bpe([f"def f{i}(x):\n    return x + {i}\n" for i in range(50)], 300, show_progress=False)
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                  eos_token_id=tokenizer.eos_token_id))
    run = tmp_path / "teacher"
    tokenizer.save(run / "tokenizer")
    save_checkpoint(run / "checkpoint.pt", {"model": model.state_dict(), "config": model.config.to_dict(), "step": 0,
                                            "tokenizer": directory_files(run / "tokenizer")})
    local = LocalTeacher.load("code", str(run), "cpu", 128)
    sequences = [tokenizer.encode("def f1(x):\n    return x + 1\n"), tokenizer.encode("def f7(x):")]
    starts = [3, 2]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = RayTeacher("code", str(run), "cpu", 128)
        assert remote.tokenizer.encode("def f3") == tokenizer.encode("def f3")
        for a, b in zip(remote.score(sequences, starts, top_k=4), local.score(sequences, starts, top_k=4)):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert [t for t, _ in a.top_logprobs[0]] == [t for t, _ in b.top_logprobs[0]]
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, logprobs=0, n=2)
        assert ([c.token_ids for c in remote.sample([sequences[1]], params)[0].outputs]
                == [c.token_ids for c in local.sample([sequences[1]], params)[0].outputs])
        for a, b in zip(remote.log_softmax(sequences, starts), local.log_softmax(sequences, starts)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        remote.close()
    finally:
        ray.shutdown()
