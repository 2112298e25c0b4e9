"""The image-text JSONL format (k3.vision.image_text): a file -> the exact ids, labels, images and pixel tensors;
every bad input -> an error naming file, line and field (one hostile property per test); packing beside text."""

import base64
import io
import json
import random
import struct
import zlib

import pytest
import torch

from k3.data.packing import pack_rows
from k3.vision.image_batches import mixed_batch, pack_image_rows
from k3.vision.image_text import (ImageDataError, ImageDataOptions, is_image_text_file, media_token_id_for,
                                  read_image_text)
from k3.vision.processing import ImageProcessor

Image = pytest.importorskip("PIL.Image")


class ByteTokenizer:
    """ids = bytes + 1, EOS = 0; the media token is one past the table (257)."""

    vocab_size, eos_token_id, bos_token_id, eos_token = 257, 0, None, "<eos>"

    def encode(self, text):
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 1 for i in ids if 0 < i < 257).decode("utf-8", errors="replace")


TOKENIZER = ByteTokenizer()
MEDIA = media_token_id_for(TOKENIZER)
RED, BLUE = (255, 0, 0), (0, 0, 255)


def enc(text):
    return TOKENIZER.encode(text)


def two_colour_png(path, size=(56, 28)):
    """Left half red, right half blue: 28 x 56 px = 2 x 4 patches = 2 merged tokens."""
    image = Image.new("RGB", size, BLUE)
    image.paste(Image.new("RGB", (size[0] // 2, size[1]), RED), (0, 0))
    image.save(path)
    return path


def png_bytes(size=(28, 28), colour=RED):
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(raw):
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def read(path, **options):
    processor = ImageProcessor(max_patches=options.pop("max_patches", 64))
    return read_image_text([path], TOKENIZER, processor, MEDIA, ImageDataOptions(**options))


def patch(colour):
    """One normalised [3, 14, 14] patch of a solid colour (mean 0.5, std 0.5)."""
    return (torch.tensor(colour, dtype=torch.float32) / 255.0 - 0.5).div(0.5).view(3, 1, 1).expand(3, 14, 14)


def test_media_token_is_one_past_a_table_without_it():
    assert MEDIA == 257


def test_a_file_is_image_text_when_any_record_has_images_or_messages(tmp_path):
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}, {"text": "also plain"}])
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"text": "plain"}, {"text": "<image>", "images": ["a.png"]}])
    assert not is_image_text_file(text) and is_image_text_file(mixed)


def test_document_round_trip_gives_exact_ids_labels_and_pixels(tmp_path):
    two_colour_png(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "A <image> b", "images": ["a.png"]}])
    assert is_image_text_file(data)
    [example] = read(data).examples
    ids = enc("A ") + [MEDIA, MEDIA] + enc(" b") + [0]
    assert example.ids == ids
    # Every text token (and the closing EOS) is a target; a position whose next token is a placeholder is not.
    assert example.labels == [ids[1], -100, -100, ids[4], ids[5], 0, -100]
    assert example.images == [str((tmp_path / "a.png").resolve())]
    assert example.tokens_per_image == [2] and example.source == f"{data}:1"
    rows = pack_image_rows([example], 1, 10, filler_id=0, rng=random.Random(0))
    batch = mixed_batch(None, rows, ImageProcessor(max_patches=64))
    assert batch.input_ids.tolist() == [ids + [0, 0, 0]]
    assert batch.labels.tolist() == [example.labels + [-100] * 3]
    assert batch.cu_seqlens.tolist() == [0, 7, 10]
    assert batch.grid_thw.tolist() == [[1, 2, 4]]
    # Patches in (row, column) order: two red, two blue, in both patch rows.
    expected = torch.stack([patch(c) for c in (RED, RED, BLUE, BLUE, RED, RED, BLUE, BLUE)])
    assert batch.image_patches.dtype == torch.uint8  # normalised on the step's device
    assert torch.allclose(ImageProcessor().normalise(batch.image_patches), expected, atol=1e-6)


def test_chat_round_trip_trains_on_assistant_tokens_only(tmp_path):
    image_part = {"type": "image_url", "image_url": {"url": data_url(png_bytes())}}
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image_part]},
                           {"role": "assistant", "content": "ok"}]}
    [example] = read(write_jsonl(tmp_path / "c.jsonl", [record])).examples
    prompt = enc("<|user|>hi") + [MEDIA] + enc("\n<|assistant|>")  # 28 x 28 px: one merged token
    ids = prompt + enc("ok") + [0]
    assert example.ids == ids
    assert example.labels == [-100] * (len(prompt) - 1) + [ids[len(prompt)], ids[len(prompt) + 1], 0, -100]
    assert example.tokens_per_image == [1] and example.images[0].startswith("data:image/png;base64,")


def test_image_rows_pack_beside_text_rows_with_images_in_reading_order(tmp_path):
    two_colour_png(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(png_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>x", "images": ["a.png"]},
                                              {"text": "y<image>", "images": ["b.png"]}])
    first, second = read(data).examples
    rows = pack_image_rows([first, second], 2, 8, filler_id=0, rng=random.Random(3))
    text = pack_rows([(torch.arange(1, 9).numpy(), torch.arange(2, 10).numpy())], 0)
    batch = mixed_batch(text, rows, ImageProcessor(max_patches=64))
    assert batch.input_ids.shape == (1, 24)
    assert batch.cu_seqlens[:2].tolist() == [0, 8] and batch.cu_seqlens[-1] == 24
    media = (batch.input_ids == MEDIA).sum()
    assert media == int(sum(batch.grid_thw[:, 1] * batch.grid_thw[:, 2] // 4))
    assert (batch.labels[batch.input_ids == MEDIA] != MEDIA).all()
    assert not (batch.labels == MEDIA).any()  # a placeholder is never a target
    chosen = [e for row in rows for e in row.images]
    assert batch.grid_thw.shape[0] == len(chosen)


class InOrder:
    """Draws examples 0, 1, 2, ... (a stand-in for random.Random in pack_image_rows)."""

    def __init__(self):
        self.next = 0

    def randrange(self, n):
        self.next += 1
        return (self.next - 1) % n


def test_images_land_at_their_media_positions_in_reading_order(tmp_path):
    """Two examples with images of two sizes in one row: the tower's rows for image i fill exactly the positions
    of image i's media tokens."""
    from k3.config import ModelConfig
    from k3.multimodal import K3ForConditionalGeneration
    from k3.vision.config import VisionConfig

    two_colour_png(tmp_path / "wide.png")  # 2 tokens
    (tmp_path / "small.png").write_bytes(png_bytes())  # 1 token
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab<image>c", "images": ["wide.png"]},
                                              {"text": "<image>d<image>", "images": ["small.png", "wide.png"]}])
    first, second = read(data).examples
    rows = pack_image_rows([first, second], 1, 16, filler_id=0, rng=InOrder())
    assert rows[0].lengths == [len(first.ids), len(second.ids), 16 - len(first.ids) - len(second.ids)]
    batch = mixed_batch(None, rows, ImageProcessor(max_patches=64))
    positions = (batch.input_ids[0] == MEDIA).nonzero().flatten().tolist()
    # "ab", the wide image (2), "c", EOS; then the small image (1), "d", the wide image (2)
    assert positions == [2, 3, 6, 8, 9]
    assert batch.grid_thw.tolist() == [[1, 2, 4], [1, 2, 2], [1, 2, 4]]
    torch.manual_seed(0)
    text = ModelConfig.from_preset("debug", vocab_size=MEDIA + 1)
    model = K3ForConditionalGeneration(text, VisionConfig.from_preset("tiny", text_hidden_size=text.hidden_size),
                                       MEDIA).eval()
    with torch.no_grad():
        pixel_values = ImageProcessor().normalise(batch.image_patches)
        embeds = model.embed_multimodal(batch.input_ids, pixel_values, batch.grid_thw)
        images = model.vision(pixel_values, batch.grid_thw)
    assert images.shape[0] == len(positions)
    assert torch.equal(embeds[0, positions], images)
    others = [t for t in range(batch.input_ids.shape[1]) if t not in positions]
    assert torch.equal(embeds[0, others], model.language_model.model.embed_tokens(batch.input_ids[0, others]))


# --- bad inputs: one property each ---------------------------------------------------------------------------
def expect_error(path, match, **options):
    with pytest.raises(ImageDataError, match=match) as caught:
        read(path, **options)
    assert f"{path}:" in str(caught.value)
    return str(caught.value)


def test_missing_image_file_names_file_line_and_field(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ['{"text": "plain"}',
                                              {"text": "<image>", "images": ["nowhere.png"]}])
    message = expect_error(data, "does not exist")
    assert f"{data}:2: field \"images\"[0]" in message


def test_unreadable_image_is_a_named_error(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png at all" * 10)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": ["bad.png"]}])
    assert "not a readable image" in expect_error(data, r"d.jsonl:1: field \"images\"\[0\]")


def test_truncated_image_is_a_named_error(tmp_path):
    (tmp_path / "cut.png").write_bytes(png_bytes((200, 200))[:-60])
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": ["cut.png"]}])
    expect_error(data, "cut.png")


def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    raw = bytearray(png_bytes((28, 28)))
    # Rewrite the IHDR's size to 60000 x 60000 (3.6G pixels) and fix its CRC: a tiny file claiming a huge image.
    raw[16:24] = struct.pack(">II", 60000, 60000)
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))
    (tmp_path / "bomb.png").write_bytes(bytes(raw))
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": ["bomb.png"]}])
    expect_error(data, "too large to decode safely|decompression-bomb")


def test_image_over_the_row_budget_is_a_named_error(tmp_path):
    two_colour_png(tmp_path / "a.png", size=(224, 224))  # 16 x 16 patches = 64 tokens
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "x <image>", "images": ["a.png"]}])
    message = expect_error(data, "over the limit of 40", max_tokens=40, max_patches=1024)
    assert "field \"images\"" in message and "[64]" in message


def test_placeholder_count_mismatch_is_a_named_error(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image> and <image>", "images": ["a.png"]}])
    expect_error(data, r"d.jsonl:1: field \"images\": 1 image\(s\) but the text has 2 <image> tag")


def test_absolute_path_is_refused_unless_allowed(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(png_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": [str(image)]}])
    expect_error(data, "absolute path")
    assert len(read(data, allow_outside=True).examples) == 1


def test_dotdot_escape_is_refused(tmp_path):
    (tmp_path / "outside.png").write_bytes(png_bytes())
    (tmp_path / "data").mkdir()
    data = write_jsonl(tmp_path / "data" / "d.jsonl", [{"text": "<image>", "images": ["../outside.png"]}])
    expect_error(data, "leads outside")


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "link.png").symlink_to(tmp_path / "secret.png")
    data = write_jsonl(tmp_path / "data" / "d.jsonl", [{"text": "<image>", "images": ["link.png"]}])
    expect_error(data, "leads outside")


def test_network_url_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": ["http://example.com/a.png"]}])
    expect_error(data, "nothing is fetched")


def test_file_over_the_byte_cap_is_refused(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": ["a.png"]}])
    expect_error(data, "max-image-bytes", max_image_bytes=16)


def test_bad_image_part_names_the_field(tmp_path):
    record = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "a.png"}]},
                           {"role": "assistant", "content": "ok"}]}
    data = write_jsonl(tmp_path / "c.jsonl", [record])
    expect_error(data, r"field \"messages\"\[0\].content\[0\].image_url")


def test_skip_bad_images_keeps_the_good_records_and_counts_the_rest(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": ["a.png"]},
                                              {"text": "<image>", "images": ["gone.png"]},
                                              "{not json",
                                              {"text": "<image> x", "images": ["a.png"]}])
    read_back = read(data, skip_bad=True)
    assert [e.source for e in read_back.examples] == [f"{data}:1", f"{data}:4"]
    assert len(read_back.skipped) == 2
    assert "d.jsonl:2" in read_back.skipped[0] and "d.jsonl:3" in read_back.skipped[1]


def test_an_image_removed_after_reading_is_a_clear_error_at_its_step(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "<image>", "images": ["a.png"]}])
    examples = read(data).examples
    (tmp_path / "a.png").unlink()
    rows = pack_image_rows(examples, 1, 8, filler_id=0, rng=random.Random(0))
    with pytest.raises(ValueError, match="cannot be read any more.*a.png.*readable when the run read its data"):
        mixed_batch(None, rows, ImageProcessor(max_patches=64))
