import pytest

from k3.cli import main
from k3.train.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("infer")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text("\n".join(f"print('line {i} {j}')" for j in range(60)))
    out = root / "run"
    config = TrainConfig.flat(preset="debug", out=str(out), max_steps=2, seq_len=32, batch_size=2, eval_batches=1,
                              data=[str(corpus)], val_fraction=0.3, model_overrides={"vocab_size": 300})
    Trainer(config, show_progress=False).train()
    return out


def test_generate_streams_one_prompt_and_batches_several(run, capsys):
    assert main(["generate", "--run", str(run), "--prompt", "print(", "--max-new-tokens", "5", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("print(")
    assert main(["generate", "--run", str(run), "--prompt", "a", "--prompt", "bb", "--temperature", "0",
                 "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "=== [0] ===\na" in out and "=== [1] ===\nbb" in out


def test_generate_bad_input(run, tmp_path, capsys):
    assert main(["generate", "--run", str(run), "--prompt", "x" * 200, "--max-context", "20"]) == 1
    captured = capsys.readouterr()
    assert "context allows 20" in captured.err
    assert captured.out == ""  # refused before anything was echoed
    assert main(["generate", "--run", str(tmp_path), "--prompt", "x"]) == 1
    assert "no checkpoint at" in capsys.readouterr().err
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main(["generate", "--run", str(tmp_path), "--prompt", "x"]) == 1
    assert "corrupt or truncated" in capsys.readouterr().err
    assert main(["generate", "--run", str(run)]) == 1
    assert "no prompt given" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x"]) == 1
    assert "exactly one of --run" in capsys.readouterr().err


def test_chat_keeps_the_conversation(run, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n\n"))
    assert main(["chat", "--run", str(run), "--max-new-tokens", "6", "--seed", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_engine_flags_shared_with_serve_reach_the_engine(run, capsys, monkeypatch):
    """--max-batch (generate) and --no-prefix-cache (chat) are EngineConfig's flags, as in k3 serve."""
    import io

    from k3.infer import cli

    built = []
    real = cli.build_engine
    monkeypatch.setattr(cli, "build_engine", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    assert main(["generate", "--run", str(run), "--prompt", "a", "--prompt", "b", "--prompt", "c", "--max-batch",
                 "2", "--temperature", "0", "--max-new-tokens", "3", "--max-context", "64"]) == 0
    assert capsys.readouterr().out.count("=== [") == 3  # three prompts through two slots
    assert (built[-1].max_batch, built[-1].max_context, built[-1].prefix_cache) == (2, 64, None)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\n"))
    assert main(["chat", "--run", str(run), "--max-new-tokens", "4", "--no-prefix-cache"]) == 0
    assert built[-1].max_batch == 1 and built[-1].prefix_cache is None
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\n"))
    assert main(["chat", "--run", str(run), "--max-new-tokens", "4"]) == 0
    assert built[-1].prefix_cache is not None  # chat keeps earlier turns' states by default


def test_generate_chat_renders_the_prompt_in_the_runs_chat_format(run, capsys):
    """A `k3 train` run has no chat template: the plain format; the prompt printed is the rendered one."""
    assert main(["generate", "--run", str(run), "--chat", "--prompt", "hi", "--max-new-tokens", "3",
                 "--temperature", "0", "--no-stream"]) == 0
    assert "User: hi\nAssistant:" in capsys.readouterr().out


def test_generate_from_a_hugging_face_directory(run, tmp_path, capsys):
    from k3.checkpoint.hf import save_pretrained
    from k3.infer.cli import load_for_inference

    model, tokenizer = load_for_inference(str(run), None)
    save_pretrained(model, tokenizer, tmp_path / "hf", format="kimi_k3", progress=False)
    args = ["--prompt", "print(", "--max-new-tokens", "6", "--temperature", "0", "--no-stream"]
    assert main(["generate", "--run", str(run), *args]) == 0
    from_run = capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path / "hf"), *args]) == 0
    assert capsys.readouterr().out == from_run


def test_inference_dtype_casts_only_when_asked(run, capsys):
    """The inference CLIs take --dtype (auto: bf16 on CUDA, fp32 on CPU); trainers that start from a run
    (dtype=None) keep the fp32 master weights."""
    import torch

    from k3.checkpoint.inference import load_for_inference
    from k3.runtime import inference_dtype

    assert inference_dtype("auto", "cpu") == torch.float32
    assert inference_dtype("bf16", "cpu") == torch.bfloat16
    kept, _ = load_for_inference(str(run), None, "cpu")
    assert {p.dtype for p in kept.parameters()} == {torch.float32}
    cast, _ = load_for_inference(str(run), None, "cpu", "bf16")
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
    assert main(["generate", "--run", str(run), "--prompt", "def", "--max-new-tokens", "3", "--temperature", "0",
                 "--dtype", "bf16", "--no-stream"]) == 0
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit):
        main(["generate", "--run", str(run), "--prompt", "def", "--dtype", "fp16"])
