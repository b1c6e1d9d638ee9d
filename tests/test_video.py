"""Video in, as the checkpoint's own processor reads it: clips made from the shipped photo (tests/clips.py)
against transformers' PyAV reader and ``Qwen3VLVideoProcessor`` run in the reference environment
(tests/video_reference.py: it needs torchvision): the same frames, pixel values bit for bit, the same prompt
ids (timestamps and pads); greedy parity with transformers' video path on ONNX Runtime (both --ops) and
OpenVINO (a static export holding the clips' grids); an image and a video in one turn; a video turn then
turns continued from kept states; the limits; bad input refused before any graph runs."""

from __future__ import annotations

import numpy as np
import pytest

from .clips import CLIP_FILES, CLIP_GRIDS, write_clip

NEW_TOKENS = 32
PROMPT = "Describe this video."
CLIPS = list(CLIP_FILES)


def user(*parts, text: str = PROMPT) -> dict:
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def video_part(path, python: bool = True) -> dict:
    """A video part as our messages take it (``python``) or as the reference script does."""
    return {"type": "video", "video": str(path)} if python else {"type": "video", "path": str(path)}


def reference_case(name: str, messages: list[dict], **extra) -> dict:
    """A case for tests/video_reference.py: ``messages`` with our parts turned into its ``path`` parts."""

    def part(p):
        if p.get("type") in ("video", "image") and not isinstance(p.get(p["type"]), (dict, type(None))):
            return {"type": p["type"], "path": str(p[p["type"]])}
        return p

    converted = [
        {**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages
    ]
    return {"name": name, "messages": converted, **extra}


def reference_tokens(model, ref: dict, name: str, n: int, eos) -> list[int]:
    """transformers' greedy tokens for the case ``name`` of a reference run, fed its own inputs."""
    from qwen35_onnx.verify import reference_generate

    videos = None
    if f"{name}/video_grid_thw" in ref:
        videos = (ref[f"{name}/pixel_values_videos"].astype(np.float32), ref[f"{name}/video_grid_thw"])
    pixels, grids = ref.get(f"{name}/pixel_values"), ref.get(f"{name}/image_grid_thw")
    pixels = None if pixels is None else pixels.astype(np.float32)
    return reference_generate(model, ref[f"{name}/input_ids"].astype(np.int64), pixels, grids, n, eos, videos)


@pytest.fixture(scope="module")
def single(clips, video_reference):
    """transformers' processing of each clip alone with PROMPT (processor defaults), and of the pan at 1 fps
    and within 36 video tokens (``size.longest_edge`` by the export's rule), plus torchvision resizes."""
    cases = [reference_case(name, [user(video_part(clips[name]))]) for name in CLIPS]
    cases.append(reference_case("pan-1fps", [user(video_part(clips["pan"]))], fps=1))
    # 36 tokens over the pan's 3 frame pairs: 12 a pair, 6 sampled frames x 12 x 32 x 32 pixels
    cases.append(
        reference_case("pan-36", [user(video_part(clips["pan"]))], size={"shortest_edge": 4096, "longest_edge": 73728})
    )
    resizes = [(0, 120, 160, 64, 96), (1, 97, 131, 224, 160), (2, 720, 1280, 352, 640), (3, 33, 400, 32, 384)]
    resizes.append((4, 720, 1280, 64, 96))  # a tenth: sums past float32's exact integers (float64)
    return video_reference(cases, resizes), resizes


@pytest.fixture(scope="module")
def preprocessor(checkpoint):
    """The demo checkpoint's preprocessor, sized as the any-grid test exports size (budget 96, capacity 256)."""
    from qwen35_onnx.conversation.processor import ImageSizing, Preprocessor

    from .conftest import IMAGE_BUDGET, IMAGE_CAPACITY

    sizing = ImageSizing(16, 2, 65536, 16777216, IMAGE_BUDGET)
    return Preprocessor.from_pretrained(checkpoint, sizing, 1003, IMAGE_CAPACITY)


def test_frames_pixels_and_prompt_ids_equal_transformers(single, clips, preprocessor):
    """Every clip: the sampled frames (decode order, indices), the pixel values bit for bit, the grid and the
    prompt ids (timestamps, vision markers, pads) are transformers'."""
    from qwen35_onnx.conversation.videos import read_video

    ref, _ = single
    settings = preprocessor.video_sizing.settings
    grids = set()
    for name, fps, limit in [(n, None, None) for n in CLIPS] + [("pan-1fps", 1, None), ("pan-36", None, 36)]:
        clip = read_video(clips[name.split("-")[0]], settings, fps)
        np.testing.assert_array_equal(clip.frames, ref[f"{name}/frames0"], err_msg=name)
        np.testing.assert_array_equal(clip.frame_indices, ref[f"{name}/indices0"], err_msg=name)
        values, grid, tokens = preprocessor.video_pixel_values(clip, limit)
        assert grid == tuple(int(v) for v in ref[f"{name}/video_grid_thw"][0]), name
        np.testing.assert_array_equal(values, ref[f"{name}/pixel_values_videos"], err_msg=name)
        ids, _ = preprocessor.encode_chat(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}], [tokens]
        )
        np.testing.assert_array_equal(ids, ref[f"{name}/input_ids"], err_msg=name)
        if fps is None and limit is None:
            grids.add(grid[1:])
    assert grids == CLIP_GRIDS  # the static test export holds these
    assert tokens.total == 36  # pan-36: the limit binds


def test_settings_default_to_the_video_processor_class(single):
    from qwen35_onnx.conversation.videos import VideoSettings

    ref, _ = single
    d = VideoSettings()
    assert [d.min_pixels, d.max_pixels] == ref["defaults/size"].tolist()
    assert [d.min_frames, d.max_frames] == ref["defaults/frames"].tolist()
    assert d.fps == float(ref["defaults/fps"]) and d.max_frame_tokens == int(ref["defaults/max_video_tokens"])


def test_resize_is_torchvisions_bit_for_bit(single):
    from qwen35_onnx.conversation.frame_resize import resize_frames

    ref, resizes = single
    for k, (seed, h, w, out_h, out_w) in enumerate(resizes):
        frames = np.random.default_rng(seed).integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        np.testing.assert_array_equal(resize_frames(frames, out_h, out_w), ref[f"resize{k}/out"], err_msg=str(k))


@pytest.mark.parametrize("ops", ["ort", "portable"])
def test_clips_match_transformers_on_onnx_runtime(image_exports, single, clips, reference_model, ops):
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    ref, _ = single
    pipe = Pipeline.from_exported(image_exports(f"any-{ops}"))
    for name in CLIPS:
        result = pipe.generate(None, PROMPT, video=clips[name], max_new_tokens=NEW_TOKENS, sampling=SamplingConfig())
        expected = reference_tokens(reference_model, ref, name, NEW_TOKENS, pipe.stop_token_ids)
        assert result.token_ids == expected and len(expected) == NEW_TOKENS, name


@pytest.mark.parametrize("kind", ["any-portable", "static"])
def test_clips_match_transformers_on_openvino(image_exports, single, clips, reference_model, kind, checkpoint, shapes):
    """The default export (its any-grid vision graph compiled once, dynamic; raw pictures too) and a static export
    whose grids include the clips'."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    ref, _ = single
    pipe = Pipeline.from_exported(image_exports(kind), runtime="openvino")
    for name in CLIPS:
        prepared = pipe.prepare(None, PROMPT, video=clips[name])
        if kind == "static":
            assert {g[1:] for g in prepared.image_grids} <= set(pipe.contract.vision_grids)
        result = pipe.generate_prepared(prepared, max_new_tokens=NEW_TOKENS, sampling=SamplingConfig())
        assert result.token_ids == reference_tokens(reference_model, ref, name, NEW_TOKENS, pipe.stop_token_ids), name
    graphs = pipe.backend.graphs
    if kind == "static":
        assert sorted(graphs.loaded_grids) == sorted(CLIP_GRIDS)
    else:  # one compile with a dynamic patch count (the CPU plugin takes it): one copy of the weights
        assert graphs.loaded_grids == [None] and graphs.vision(None).dynamic
        from qwen35_onnx.verify import token_parity

        for name in ("landscape", "portrait", "tiny"):  # raw pictures on the same compile
            parity = token_parity(
                pipe, checkpoint, shapes[name], "Describe this image.", NEW_TOKENS, model=reference_model
            )
            assert parity.ok and parity.total >= NEW_TOKENS, (name, parity.line())


def test_an_image_and_a_video_then_turns_from_kept_states(
    image_exports, clips, shapes, tmp_path, video_reference, reference_model
):
    """Turn 1: an image and the pan; turns 2 and 3: questions about them, continued from the state kept after
    each turn. Every turn's tokens equal transformers' on the whole conversation."""
    REPLY = 10
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    picture = tmp_path / "square.png"  # 64 image tokens: the whole conversation fits the capacity of 256
    shapes["square"].resize((128, 128)).save(picture)
    pipe = Pipeline.from_exported(image_exports("any-ort"))
    cache = pipe.state_cache()
    messages = [user({"type": "image", "image": str(picture)}, video_part(clips["pan"]), text="What changes?")]
    turns, cached = [], []
    for question in (None, "And then?", "Why?"):
        if question is not None:
            messages += [{"role": "assistant", "content": turns[-1].content}, user(text=question)]
        turns.append(pipe.chat(messages, max_new_tokens=REPLY, sampling=SamplingConfig(), state_cache=cache))
        cached.append(turns[-1].generation.cached_tokens)
        snapshot = [dict(m) for m in messages]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])  # turns 2 and 3 continued from kept states
    image_size = {"shortest_edge": 65536, "longest_edge": pipe.contract.image_max_pixels}
    cases = [reference_case(f"turn{k}", snapshot[: 2 * k + 1], image_size=image_size) for k in range(3)]
    ref = video_reference(cases)
    for k, turn in enumerate(turns):
        expected = reference_tokens(reference_model, ref, f"turn{k}", REPLY, pipe.stop_token_ids)
        assert turn.generation.token_ids == expected, k


def test_the_limits_and_fps_reach_the_grid(image_exports, clips):
    from qwen35_onnx.conversation.messages import ChatInputError
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(image_exports("any-ort"))
    full = pipe.prepare(None, PROMPT, video=clips["pan"])
    assert full.image_grids == ((1, 8, 10),) * 3
    small = pipe.prepare(None, PROMPT, video=clips["pan"], max_video_tokens=36)
    assert sum(h * w // 4 for _, h, w in small.image_grids) <= 36 and len(small.image_grids) == 3
    slow = pipe.prepare(None, PROMPT, video=clips["pan"], fps=1)
    assert len(slow.image_grids) == 2  # 3 frames sampled, padded to 4
    for kwargs, param in (({"max_video_tokens": 0}, "max_video_tokens"), ({"fps": 0}, "fps"), ({"fps": True}, "fps")):
        with pytest.raises(ChatInputError, match=param) as info:
            pipe.prepare(None, PROMPT, video=clips["pan"], **kwargs)
        assert info.value.param == param
    with pytest.raises(ChatInputError, match="less than one token"):
        pipe.prepare(None, PROMPT, video=clips["pan"], max_video_tokens=2)


def _no_video_stream(path):
    import av

    with av.open(str(path), "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
        container.mux(stream.encode())
    return path


def _zero_frames(path):
    """An AVI whose video stream has no frames (MP4 and Matroska keep no stream without frames)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        container.start_encoding()
    return path


def _raw_h264(path, frames) -> bytes:
    """An Annex B H.264 elementary stream of ``frames`` (no container: streams of two sizes concatenate)."""
    import av

    height, width = frames[0].shape[:2]
    with av.open(str(path), "w", format="h264") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode())
    return path.read_bytes()


def _unknown_codec(path, source):
    data = source.read_bytes().replace(b"V_MPEG4/ISO/AVC", b"V_MPEG4/ISO/XYZ")
    path.write_bytes(data)
    return path


def test_bad_videos_are_refused_before_any_graph(image_exports, clips, tmp_path, photo):
    """A corrupt file, no video stream, zero frames, one frame, a clip too long for the capacity, a huge frame,
    an unknown codec: a ChatInputError naming the part (ImageTooLarge for the limits), and no graph ran."""
    from qwen35_onnx.conversation import videos
    from qwen35_onnx.conversation.messages import ChatInputError, ImagePolicy, ImageTooLarge
    from qwen35_onnx.pipeline import Pipeline

    from .clips import pan_frames

    pipe = Pipeline.from_exported(image_exports("any-ort"))
    ran, decoded = [], []
    pipe.backend.run_vision = lambda *a, **k: ran.append("vision")
    decode = videos._decode
    videos._decode = lambda *a, **k: decoded.append(a[3]) or decode(*a, **k)
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(clips["pan"].read_bytes()[:2000])
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(bytes(range(256)) * 40)
    mkv = write_clip(tmp_path / "h264.mkv", pan_frames(photo, 4, 64, 64))
    cases = {
        "corrupt": (corrupt, "damaged|ended after|cannot"),
        "garbage": (garbage, "cannot read video"),
        "no stream": (_no_video_stream(tmp_path / "audio.wav"), "has no video stream"),
        "zero frames": (_zero_frames(tmp_path / "empty.avi"), "holds no frames"),
        "one frame": (write_clip(tmp_path / "one.mp4", pan_frames(photo, 1, 64, 64)), "at least 2 sampled frames"),
        "too long": (
            write_clip(tmp_path / "long.mp4", pan_frames(photo, 400, 64, 64), fps=2),
            "200 frame pairs.*too long",
        ),
        "codec": (_unknown_codec(tmp_path / "codec.mkv", mkv), "cannot decode|codec"),
    }
    size_change = tmp_path / "sizes.h264"
    size_change.write_bytes(
        _raw_h264(tmp_path / "a.h264", pan_frames(photo, 4, 64, 64))
        + _raw_h264(tmp_path / "b.h264", pan_frames(photo, 4, 96, 64))
    )
    cases["size change"] = (size_change, "change size within the stream: frame 4 is 96x64")
    try:
        for name, (path, message) in cases.items():
            with pytest.raises((ChatInputError, ValueError), match=message) as info:
                pipe.prepare_chat([user(video_part(path))])
            assert isinstance(info.value, ChatInputError) and info.value.param == "messages[0].content[0].video", name
        long = str(cases["too long"][0])
        with pytest.raises(ChatInputError, match="take at least .* tokens .* more than the 256 the capacity leaves"):
            pipe.prepare_chat([user(video_part(long))], max_video_tokens=256)  # a token a pair, still too many
        assert long not in decoded  # refused from the header, before any frame was decoded
        for fps in (1e308, 2**1100, float("nan"), -1):
            with pytest.raises(ChatInputError, match="fps must be a positive number .* at most 1000"):
                pipe.prepare_chat([user(video_part(clips["pan"]))], fps=fps)
    finally:
        videos._decode = decode
    big = write_clip(tmp_path / "big.mp4", pan_frames(photo, 4, 320, 240))
    policy = ImagePolicy(allow_any_local=True, max_video_frame_pixels=320 * 240 - 1)
    with pytest.raises(ImageTooLarge, match="76800 pixels, more than the limit"):
        pipe.prepare_chat([user(video_part(big))], image_policy=policy)
    policy = ImagePolicy(allow_any_local=True, max_video_seconds=2.5)
    with pytest.raises(ImageTooLarge, match="3.0 seconds long"):
        pipe.prepare_chat([user(video_part(clips["pan"]))], image_policy=policy)
    assert ran == []


def test_video_urls_follow_the_policy(clips, tmp_path):
    import base64

    from qwen35_onnx.conversation.messages import (
        ChatInputError,
        ChatVideo,
        ImagePolicy,
        ImageTooLarge,
        normalize_messages,
    )

    data = clips["pan"].read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    part = {"type": "video_url", "video_url": {"url": url}}
    rendered, media = normalize_messages([user(part)], ImagePolicy())
    assert rendered[0]["content"][0] == {"type": "video"} and media[0] == ChatVideo(data=data, param=media[0].param)
    with pytest.raises(ImageTooLarge, match="bytes, more than the limit"):
        normalize_messages([user(part)], ImagePolicy(max_video_bytes=len(data) - 1))
    with pytest.raises(ChatInputError, match="media type 'image/png'"):
        normalize_messages([user({"type": "video_url", "video_url": {"url": "data:image/png;base64,AAAA"}})])
    with pytest.raises(ChatInputError, match="https:// video URLs are not fetched"):
        normalize_messages([user({"type": "video_url", "video_url": "https://example.com/a.mp4"})])
    with pytest.raises(ChatInputError, match="local video paths are not allowed"):
        normalize_messages([user({"type": "video_url", "video_url": str(clips["pan"])})], ImagePolicy())
    inside = ImagePolicy(local_dir=clips["pan"].parent)
    _, media = normalize_messages([user({"type": "video_url", "video_url": {"url": clips["pan"].name}})], inside)
    assert media[0].data == clips["pan"].read_bytes()  # read here: FFmpeg opens it from memory
    with pytest.raises(ChatInputError, match="videos are allowed in user messages only"):
        normalize_messages([{"role": "assistant", "content": [part]}])


def test_generate_chat_and_verify_take_videos(image_exports, clips, checkpoint, tmp_path):
    """``generate --video`` streams as the Python API answers; ``chat``'s ``/video`` attaches (a bad path is
    refused at once and the conversation goes on); ``verify --video`` runs transformers' own video path in the
    reference environment (torchvision) and refuses clearly where torchvision is missing."""
    import io
    import subprocess

    from qwen35_onnx.chat_repl import run_chat
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    from .conftest import video_reference_python
    from .test_cli import invoke_cli

    export = image_exports("any-ort")
    pipe = Pipeline.from_exported(export)
    expected = pipe.generate(None, PROMPT, video=clips["pan"], fps=1, max_new_tokens=6, sampling=SamplingConfig())
    args = ["generate", "--model", str(export), "--video", str(clips["pan"]), "--prompt", PROMPT, "--fps", "1"]
    proc = invoke_cli(*args, "--max-new-tokens", "6", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected.text + "\n"
    bad = invoke_cli(*args[:-2], "--fps", "-1")
    assert bad.returncode != 0 and "--fps must be a positive number" in bad.stderr
    bad = invoke_cli(*args, "--max-video-tokens", "100000")
    assert bad.returncode != 0 and "--max-video-tokens 100000 must lie in [1, 256]" in bad.stderr

    out, err = io.StringIO(), io.StringIO()
    lines = [f"/video {clips['pan']}", "What happens?", f"/video {tmp_path / 'missing.mp4'}", "Go on.", "/quit"]
    answered = run_chat(pipe, lines, out, err, max_new_tokens=4, sampling=SamplingConfig(), fps=1)
    assert answered == 2, err.getvalue()
    assert "[video 1 attached to the next message]" in err.getvalue()
    assert "video file not found" in err.getvalue()
    assert "prompt tokens from the kept state" in err.getvalue()

    verify = [str(video_reference_python().parent / "qwen35-onnx"), "verify", "--model", str(export)]
    verify += ["--model-id", str(checkpoint), "--video", str(clips["odd"]), "--prompt", PROMPT, "--max-new-tokens", "8"]
    done = subprocess.run(verify, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "parity: 8/8 tokens identical to transformers" in done.stdout, done.stderr[-2000:]
    here = invoke_cli(*verify[1:])
    assert here.returncode != 0 and "needs torchvision" in here.stderr
