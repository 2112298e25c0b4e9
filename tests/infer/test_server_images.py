"""`k3 serve --model` on a multimodal K3 directory: chat messages with image_url parts (data: URLs) are
answered with the tokens the multimodal forward gives when recomputed at every step; bad image parts get 400."""

import base64
import io

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
PIL = pytest.importorskip("PIL.Image")

from server_helpers import Server, make_run  # noqa: E402


def png_data_url(seed: int, size=(56, 42)) -> str:
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=generator) * 255).to(torch.uint8).numpy()
    buffer = io.BytesIO()
    PIL.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from k3.checkpoint.hf_multimodal import save_pretrained
    from k3.infer.cli import load_for_inference
    from k3.multimodal import K3ForConditionalGeneration
    from k3.vision import VisionConfig

    root = tmp_path_factory.mktemp("images")
    text_model, tokenizer = load_for_inference(str(make_run(root / "run")), None, "cpu")
    vision = VisionConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, head_dim=24,
                          pos_emb_height=8, pos_emb_width=8, text_hidden_size=text_model.config.hidden_size)
    torch.manual_seed(1)
    model = K3ForConditionalGeneration(text_model.config, vision, media_token_id=text_model.config.vocab_size - 1)
    model.language_model.load_state_dict(text_model.state_dict())
    with torch.no_grad():
        for p in model.vision.parameters():
            p.add_(0.2 * torch.randn_like(p))
    save_pretrained(model.eval(), tokenizer, root / "mm", progress=False)
    return root / "mm"


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server(model_dir, "--max-batch", "4", "--max-context", "512", hf=True)
    try:
        yield server
    finally:
        server.stop()


def test_image_chat_equals_the_multimodal_forward(server, model_dir):
    from k3.checkpoint.hf_multimodal import from_pretrained
    from k3.vision.processing import ImageProcessor

    assert "images: yes" in server.log()
    image = png_data_url(0)
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is in"},
                                                      {"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "?"}]}]}
    answer = server.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    prompt, generated = choice["prompt_token_ids"], choice["token_ids"]
    model = from_pretrained(model_dir, progress=False)
    images = ImageProcessor.for_vision(model.vision.config)([image])
    assert prompt.count(model.media_token_id) == images.tokens_per_image[0] > 0
    reference = []
    with torch.no_grad():
        for _ in range(len(generated)):
            logits = model(torch.tensor([prompt + reference]), images.pixel_values, images.grid_thw).logits
            reference.append(int(logits[0, -1].argmax()))
    assert generated == reference
    # A different image changes the answer's logits: the pixels reached the model.
    body["messages"][0]["content"][1]["image_url"]["url"] = png_data_url(5)
    body["logprobs"], body["top_logprobs"] = True, 1
    other = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]
    body["messages"][0]["content"][1]["image_url"]["url"] = image
    same = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert other["logprobs"]["content"][0]["logprob"] != same["logprobs"]["content"][0]["logprob"]
    server.wait_idle()


@pytest.mark.parametrize("url, message", [("https://example.com/cat.png", "only data: URLs"),
                                          ("data:image/png;base64,bm90IGFuIGltYWdl", "image")])
def test_bad_image_parts_get_400(server, url, message):
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    answer = server.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages" and message in error["message"]


def test_generate_with_an_image_file(model_dir, tmp_path, capsys):
    import base64 as b64

    from k3.cli import main

    image = tmp_path / "x.png"
    image.write_bytes(b64.b64decode(png_data_url(0).split(",", 1)[1]))
    args = ["generate", "--model", str(model_dir), "--image", str(image), "--prompt", "see:", "--temperature", "0",
            "--max-new-tokens", "5", "--device", "cpu"]
    assert main(args) == 0
    with_image = capsys.readouterr().out
    assert with_image.startswith("see:")
    image2 = tmp_path / "y.png"
    image2.write_bytes(b64.b64decode(png_data_url(5).split(",", 1)[1]))
    assert main(args[:4] + [str(image2)] + args[5:]) == 0
    assert capsys.readouterr().out.startswith("see:")
    assert main(args[:4] + [str(tmp_path / "missing.png")] + args[5:]) == 1
    assert "does not exist" in capsys.readouterr().err
