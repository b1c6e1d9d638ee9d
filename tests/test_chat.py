"""Issue acceptance (chat API): several images per prompt and multi-turn conversations give the
token ids and mRoPE positions of transformers; message and image errors are clear and come before
any graph runs."""

from __future__ import annotations

import base64
import io
import re
import shutil

import numpy as np
import pytest
from PIL import Image, ImageOps

from qwen35_onnx.conversation.messages import ChatInputError
from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime.sampling import Sampler

from .conftest import CAPACITY, IMAGE_TOKENS

N_TOKENS = 32


@pytest.fixture(scope="module")
def pipe(chat_export):
    return Pipeline.from_exported(chat_export)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    media = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}[fmt]
    return f"data:{media};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def images(photo):
    first = Image.open(photo).convert("RGB")
    # another picture, not square (5:3), over the budget: the checkpoint's processor scales it down to
    # a 12 x 20 grid (60 tokens) that the export serves as it is (a smaller picture would be upscaled
    # to min_pixels and over the test exports' budget of IMAGE_TOKENS = min_pixels' 64 tokens)
    second = ImageOps.mirror(first).rotate(90).crop((0, 0, 200, 120)).resize((400, 240))
    return first, second


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def reference_positions(model, input_ids, grids):
    """transformers' get_rope_index on ``input_ids`` with each image's ``grids`` row: [3, 1, S] and
    rope_deltas."""
    import torch

    ids = torch.from_numpy(input_ids)
    with torch.no_grad():
        pos, deltas = model.model.get_rope_index(
            ids,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            image_grid_thw=torch.from_numpy(np.asarray(grids, dtype=np.int64)),
        )
    return pos.numpy(), int(deltas.item())


def raw_image_messages(messages):
    """``messages`` with each image part (a data URL or a path) replaced by ``{"type": "image",
    "image": the decoded PIL image}``: what transformers' own processor is given."""
    from qwen35_onnx.conversation.messages import ImagePolicy, normalize_messages

    decoded = iter(normalize_messages(messages, ImagePolicy.trusted())[1])

    def raw(part):
        return {"type": "image", "image": next(decoded).image} if part["type"] in ("image", "image_url") else part

    return [{**m, "content": [raw(p) for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages]


def check_parity(pipe, checkpoint, reference_model, messages, grids):
    """Our prompt (ids, each image's grid and pixels) is the one the checkpoint's own tokenizer, chat
    template and image processor make of the raw images; our positions are transformers'; and our
    greedy tokens are transformers' on its own inputs."""
    from qwen35_onnx.verify import reference_generate, reference_prompt

    c = pipe.contract
    prepared = pipe.prepare_chat(messages)
    assert prepared.image_grids == tuple(grids)
    reference_inputs = reference_prompt(checkpoint, raw_image_messages(messages), c.image_max_pixels)
    ids, pixel_values, reference_grids = (
        reference_inputs.input_ids,
        reference_inputs.pixel_values,
        reference_inputs.image_grid_thw,
    )
    assert [tuple(g) for g in reference_grids.tolist()] == list(grids)
    np.testing.assert_array_equal(prepared.input_ids, ids)
    np.testing.assert_allclose(prepared.pixel_values, pixel_values, rtol=0, atol=1e-6)
    tokens = sum(h * w // c.spatial_merge_size**2 for _, h, w in grids)
    assert int((prepared.input_ids == c.image_token_id).sum()) == tokens
    positions, deltas = reference_positions(reference_model, ids, reference_grids)
    np.testing.assert_array_equal(prepared.position_ids[1:], positions)
    assert prepared.rope_deltas == deltas
    result = pipe.chat(messages, max_new_tokens=N_TOKENS)
    reference = reference_generate(reference_model, ids, pixel_values, reference_grids, N_TOKENS, c.eos_token_ids)
    assert len(reference) >= N_TOKENS, "the demo checkpoint must not stop before 32 tokens here"
    assert result.generation.token_ids == reference
    assert result.finish_reason == "length"
    return result


@pytest.mark.slow
def test_two_images_in_one_prompt_match_transformers(pipe, checkpoint, reference_model, images):
    messages = [
        {
            "role": "user",
            "content": [
                image_part(data_url(images[0])),
                {"type": "text", "text": "Compare this image"},  # greedy runs 32 tokens without an end of turn
                image_part(data_url(images[1], "JPEG")),
                {"type": "text", "text": "with this one."},
            ],
        }
    ]
    check_parity(pipe, checkpoint, reference_model, messages, [(1, 16, 16), (1, 12, 20)])


@pytest.mark.slow
def test_image_in_turn_one_and_turn_three_match_transformers(pipe, checkpoint, reference_model, images, photo):
    messages = [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [image_part(str(photo)), {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A person in a white suit."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image_part(data_url(images[1]))]},
    ]
    result = check_parity(pipe, checkpoint, reference_model, messages, [(1, 16, 16), (1, 12, 20)])
    # the first image stays in turn one: its tokens come before the assistant reply's
    prepared = pipe.prepare_chat(messages)
    ids = prepared.input_ids[0]
    reply = pipe.preprocessor.tokenizer("A person in a white suit.", add_special_tokens=False)["input_ids"]
    reply_at = next(i for i in range(len(ids)) if ids[i : i + len(reply)].tolist() == reply)
    image_at = np.flatnonzero(ids == pipe.contract.image_token_id)
    assert (image_at < reply_at).sum() == 16 * 16 // 4  # the photo's grid
    assert (image_at > reply_at).sum() == 12 * 20 // 4  # the second picture's
    assert result.content == result.generation.text and result.reasoning_content is None


def test_single_prompt_api_is_the_one_turn_chat(pipe, photo):
    """generate(image, prompt) renders exactly the one-turn chat with the image first."""
    chat = pipe.prepare_chat([{"role": "user", "content": [image_part(str(photo)), {"type": "text", "text": "Hi"}]}])
    single = pipe.prepare(photo, "Hi")
    np.testing.assert_array_equal(chat.input_ids, single.input_ids)
    np.testing.assert_array_equal(chat.pixel_values, single.pixel_values)
    text_only = pipe.prepare_chat([{"role": "user", "content": "Hi"}])
    np.testing.assert_array_equal(text_only.input_ids, pipe.prepare(None, "Hi").input_ids)
    assert (
        pipe.chat([{"role": "user", "content": "Hi"}], max_new_tokens=6).generation.token_ids
        == pipe.generate(None, "Hi", max_new_tokens=6).token_ids
    )


def test_more_images_than_exported_fails_before_any_graph(pipe, images, monkeypatch):
    def no_graphs(*args, **kwargs):
        raise AssertionError("a graph ran")

    monkeypatch.setattr(pipe.backend, "run_vision", no_graphs)
    monkeypatch.setattr(pipe.backend, "run_prefill", no_graphs)
    url = data_url(images[0])
    messages = [{"role": "user", "content": [image_part(url)] * 3 + [{"type": "text", "text": "Three?"}]}]
    with pytest.raises(ChatInputError, match=r"3 images, more than the 2 this export takes") as err:
        pipe.stream_chat(messages)
    assert err.value.param == "messages"


def test_one_image_export_refuses_a_second_image(fixed_export, images):
    pipe = Pipeline.from_exported(fixed_export)
    assert pipe.contract.max_images == 1
    url = data_url(images[0])
    with pytest.raises(ChatInputError, match=r"2 images, more than the 1 this export takes"):
        pipe.prepare_chat([{"role": "user", "content": [image_part(url), image_part(url)]}])


def test_prefill_graph_takes_rows_for_every_image(pipe, chat_export):
    c = pipe.contract
    assert c.max_images == 2 and c.n_image_tokens == IMAGE_TOKENS and c.n_image_rows == 2 * IMAGE_TOKENS
    graph = pipe.backend.graphs.prefill(c.prefill_buckets[0])
    assert graph.inputs["image_embeds"] == [c.n_image_rows, c.image_embed_dim]


def test_manifest_without_max_images_reads_as_one(fixed_export, tmp_path):
    import json

    from qwen35_onnx.contract import read_manifest

    copy = shutil.copytree(fixed_export, tmp_path / "old")
    data = json.loads((copy / "manifest.json").read_text())
    del data["max_images"]
    (copy / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(copy).max_images == 1


def test_export_refuses_more_image_tokens_than_capacity(checkpoint, tmp_path):
    from qwen35_onnx.export.exporter import export
    from qwen35_onnx.export.options import ExportError, ExportOptions

    with pytest.raises(
        ExportError,
        match=r"--max-images 3 with --image-tokens 64 needs 3 x 64 = 192 image tokens, more than the capacity 128",
    ):
        export(checkpoint, tmp_path / "x", ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS, max_images=3))
    with pytest.raises(ExportError, match=r"--max-images must be an integer >= 1, got 0"):
        export(checkpoint, tmp_path / "y", ExportOptions(capacity=CAPACITY, max_images=0))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize(
    "messages, param, message",
    [
        ("hi", "messages", "must be a list"),
        ([], "messages", "at least one message"),
        ([{"role": "robot", "content": "x"}], "messages[0].role", "'robot' is not one of"),
        ([{"role": "user"}], "messages[0].content", "must be a string or a list"),
        ([{"role": "user", "content": 5}], "messages[0].content", "got int"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type", "'audio' must be"),
        ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]", "must be a content part object"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "messages[0].content[0].text",
            "must be a string",
        ),
        (
            [{"role": "assistant", "content": [image_part("data:image/png;base64,AAAA")]}],
            "messages[0].content[0]",
            "user messages only",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].image_url.url",
            "non-empty string",
        ),
        (
            [{"role": "user", "content": [image_part("https://example.com/a.png")]}],
            "messages[0].content[0].image_url.url",
            "are not fetched",
        ),
        (
            [{"role": "user", "content": [image_part("data:text/plain;base64,aGk=")]}],
            "messages[0].content[0].image_url.url",
            "'text/plain' is not one of",
        ),
        (
            [{"role": "user", "content": [image_part("data:image/png;base64,not base64!")]}],
            "messages[0].content[0].image_url.url",
            "not valid base64",
        ),
        (
            [{"role": "user", "content": [image_part("data:image/png;base64," + base64.b64encode(b"junk").decode())]}],
            "messages[0].content[0].image_url.url",
            "not a readable image",
        ),
        (
            [{"role": "user", "content": [image_part("data:image/png,rawdata")]}],
            "messages[0].content[0].image_url.url",
            "data:image/png;base64",
        ),
    ],
)
def test_bad_messages_name_the_field(messages, param, message):
    from qwen35_onnx.conversation.messages import normalize_messages

    with pytest.raises(ChatInputError, match=message) as err:
        normalize_messages(messages)
    assert err.value.param == param


def test_local_images_follow_the_policy(tmp_path, photo):
    from qwen35_onnx.conversation.messages import ImagePolicy, normalize_messages

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inside = shutil.copy(photo, allowed / "p.jpg")
    outside = shutil.copy(photo, tmp_path / "secret.jpg")
    (allowed / "link.jpg").symlink_to(outside)

    def ask(url, policy):
        return normalize_messages([{"role": "user", "content": [image_part(url)]}], policy)

    with pytest.raises(ChatInputError, match="local image paths are not allowed"):
        ask(str(inside), ImagePolicy())
    policy = ImagePolicy(local_dir=allowed)
    assert len(ask(str(inside), policy)[1]) == 1
    assert len(ask(f"file://{inside}", policy)[1]) == 1
    for escape in (str(outside), f"{allowed}/../secret.jpg", str(allowed / "link.jpg"), "file:///etc/passwd"):
        with pytest.raises(ChatInputError, match="outside the allowed image folder"):
            ask(escape, policy)
    with pytest.raises(ChatInputError, match="not found"):
        ask(str(allowed / "missing.png"), policy)
    with pytest.raises(ChatInputError, match="more than the limit of 100 bytes"):
        ask(str(inside), ImagePolicy(local_dir=allowed, max_image_bytes=100))
    with pytest.raises(ChatInputError, match="more than the limit of 100 bytes"):
        ask(data_url(Image.open(photo)), ImagePolicy(max_image_bytes=100))


def test_image_formats_and_modes(images):
    from qwen35_onnx.conversation.messages import normalize_messages

    rgba = images[1].convert("RGBA")
    for fmt, picture in (("PNG", rgba), ("JPEG", images[0]), ("WEBP", images[1]), ("GIF", images[1].convert("P"))):
        _, decoded = normalize_messages([{"role": "user", "content": [image_part(data_url(picture, fmt))]}])
        assert decoded[0].image.mode == "RGB" and decoded[0].image.size == picture.size and decoded[0].detail == "auto"


def test_chat_loop_keeps_the_conversation_and_survives_bad_turns(pipe, photo, monkeypatch, tmp_path):
    import io as _io

    from qwen35_onnx.chat_repl import run_chat

    seen = []
    original = pipe.stream_chat

    def spy(messages, *args, **kwargs):
        seen.append(messages)
        return original(messages, *args, **kwargs)

    monkeypatch.setattr(pipe, "stream_chat", spy)
    not_an_image = tmp_path / "notes.jpg"
    not_an_image.write_text("hello")
    lines = [
        f"/image {photo}\n",
        f"/image {photo}\n",
        f"/image {photo}\n",  # refused at once: max 2
        "/image /no/such.png\n",
        f"/image {not_an_image}\n",
        "/frobnicate\n",
        "two images\n",
        f"/image {photo}\n",  # refused: the conversation already holds 2
        "and again\n",
        "word " * 4000 + "\n",  # refused: over the largest bucket
        "/reset\n",
        "fresh\n",
        "/quit\n",
        "ignored\n",
    ]
    out, err = _io.StringIO(), _io.StringIO()
    answered = run_chat(pipe, lines, out, err, system="Be brief.", max_new_tokens=4)
    assert answered == 3
    log = err.getvalue()
    assert log.count("the export takes at most 2 image(s) per prompt and this conversation already has 2") == 2
    assert "image file not found: /no/such.png" in log and f"cannot read image {not_an_image}" in log
    assert "unknown command '/frobnicate'" in log
    left = [
        int(n) for n, cap in re.findall(r"\| (\d+) of (\d+) tokens left", log) if int(cap) == pipe.contract.capacity
    ]
    assert len(left) == 3 and left[1] < left[0]  # what the capacity leaves after each answer; the history grows
    assert "more than the largest prefill bucket" in log and "; /reset starts a new conversation" in log
    # the refused long turn is dropped; /reset keeps only the system prompt
    assert [m["role"] for m in seen[0]] == ["system", "user"]
    assert sum(part["type"] == "image_url" for part in seen[0][1]["content"]) == 2
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert [m["role"] for m in seen[2]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["role"] for m in seen[3]] == ["system", "user"]
    assert len(out.getvalue().splitlines()) == 3


def test_huge_or_odd_images_are_refused_early(tmp_path):
    from qwen35_onnx.conversation.messages import ImagePolicy, normalize_messages

    big = Image.new("L", (3000, 2000))  # small PNG, many pixels
    with pytest.raises(ChatInputError, match=r"3000x2000 = 6000000 pixels, more than the limit of 1000000"):
        normalize_messages(
            [{"role": "user", "content": [image_part(data_url(big))]}], ImagePolicy(max_image_pixels=10**6)
        )
    policy = ImagePolicy(local_dir=tmp_path)
    for path in (str(tmp_path / "a\0b.png"), str(tmp_path / ("x" * 5000))):
        with pytest.raises(ChatInputError, match="not a usable file path|not found"):
            normalize_messages([{"role": "user", "content": [image_part(path)]}], policy)
    bmp = io.BytesIO()
    big.resize((8, 8)).save(bmp, format="BMP")
    url = "data:image/png;base64," + base64.b64encode(bmp.getvalue()).decode()
    with pytest.raises(ChatInputError, match="format BMP is not PNG, JPEG, WebP or GIF"):
        normalize_messages([{"role": "user", "content": [image_part(url)]}])


def test_cancel_from_another_thread_stops_before_the_next_token(pipe):
    import threading

    stream = pipe.stream_chat([{"role": "user", "content": "Tell me more."}], max_new_tokens=60)
    deltas = iter(stream)
    next(deltas)
    worker = threading.Thread(target=stream.cancel)
    worker.start()
    worker.join()
    rest = list(deltas)  # ends instead of running to 60 tokens
    result = stream.result
    assert result.finish_reason is None
    assert len(result.generation.token_ids) < 60
    assert len(rest) <= 1  # at most the streamer's held-back tail
    assert (
        result.generation.token_ids
        == pipe.chat([{"role": "user", "content": "Tell me more."}], max_new_tokens=60).generation.token_ids[
            : len(result.generation.token_ids)
        ]
    )


def test_image_limits_are_exact_and_cover_local_files_and_bombs(tmp_path):
    from qwen35_onnx.conversation.messages import ImagePolicy, ImageTooLarge, normalize_messages

    def ask(url, policy):
        return normalize_messages([{"role": "user", "content": [image_part(url)]}], policy)

    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    for pad in range(3):  # a PNG of exactly the limit passes whatever its base64 padding
        data = png.getvalue() + b"\0" * pad
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        assert len(ask(url, ImagePolicy(max_image_bytes=len(data)))[1]) == 1
        with pytest.raises(ImageTooLarge, match=f"is {len(data)} bytes, more than the limit of {len(data) - 1}"):
            ask(url, ImagePolicy(max_image_bytes=len(data) - 1))
    big = tmp_path / "big.png"
    Image.new("L", (3000, 2000)).save(big)
    with pytest.raises(ImageTooLarge, match="3000x2000 = 6000000 pixels, more than the limit of 1000000"):
        ask(str(big), ImagePolicy(local_dir=tmp_path, max_image_pixels=10**6))
    with pytest.raises(ImageTooLarge, match="3000x2000 = 6000000 pixels"):  # relative paths live in the folder
        ask("big.png", ImagePolicy(local_dir=tmp_path, max_image_pixels=10**6))
    # a header declaring 20000 x 20000 pixels: PIL refuses it in Image.open, still a 413-kind error
    bomb = io.BytesIO()
    Image.new("1", (20000, 20000)).save(bomb, format="PNG")
    with pytest.raises(ImageTooLarge, match="more than the limit of 50000000 pixels"):
        ask("data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode(), ImagePolicy())
    with pytest.raises(ChatInputError, match=r"^[^(]*'/etc/passwd' is outside the allowed image folder$"):
        ask("/etc/passwd", ImagePolicy(local_dir=tmp_path))
    with pytest.raises(ChatInputError, match="is not a regular file"):
        ask(str(tmp_path), ImagePolicy(local_dir=tmp_path))
    with pytest.raises(ChatInputError, match=r"not a readable image \(no known image format\)$"):
        ask("data:image/png;base64," + base64.b64encode(b"junk").decode(), ImagePolicy())


def test_sampling_none_means_the_checkpoints_sampling_and_stops_include_the_end_of_turn(
    pipe, chat_export, tmp_path, monkeypatch, photo
):
    import dataclasses
    import json

    from qwen35_onnx import pipeline as pipeline_module
    from qwen35_onnx.runtime.sampling import SamplingConfig

    assert pipe.sampling_defaults == SamplingConfig()  # do_sample false: greedy
    folder = shutil.copytree(chat_export, tmp_path / "export")
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    (folder / "generation_config.json").write_text(json.dumps(config))
    sampled = Pipeline(folder, pipe.contract, pipe.backend, pipe.preprocessor)
    assert sampled.sampling_defaults == SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    used = []
    monkeypatch.setattr(pipeline_module, "Sampler", lambda config: used.append(config) or Sampler(config))
    sampled.generate(photo, "hi", max_new_tokens=2)
    sampled.generate(photo, "hi", max_new_tokens=2, sampling=SamplingConfig())
    assert used == [sampled.sampling_defaults, SamplingConfig()]

    end_of_turn = pipe.preprocessor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    only_eos = dataclasses.replace(pipe.contract, eos_token_ids=(pipe.contract.pad_token_id,))
    assert Pipeline(folder, only_eos, pipe.backend, pipe.preprocessor).stop_token_ids == only_eos.eos_token_ids
    (folder / "generation_config.json").unlink()  # nothing lists the stops: the tokenizer's eos_token joins
    assert Pipeline(folder, only_eos, pipe.backend, pipe.preprocessor).stop_token_ids == (
        *only_eos.eos_token_ids,
        end_of_turn,
    )
