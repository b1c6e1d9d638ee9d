"""Images as the model sees them, end to end: raw pictures of several shapes through the checkpoint's
own processor, greedy parity with transformers fed the raw pictures (verify's reference), on the
any-grid export (ONNX Runtime, both --ops) and on a static-grid export (OpenVINO, each grid
compiled once); several grids in one prompt and across chat turns; detail and the per-call limit."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from .conftest import IMAGE_BUDGET as BUDGET
from .conftest import processor_grids

NEW_TOKENS = 32
PROMPT = "Describe this image."


# The exports (conftest's image_exports) and the test pictures (conftest's shapes) are shared with
# tests/test_chunked_prefill.py: these tests do not depend on the prefill form (chunks or buckets).
@pytest.fixture(scope="module")
def any_grid_exports(image_exports):
    """``any_grid_exports(ops)``: capacity 256, budget 96, two images, the any-grid vision graph (``--ops
    ort``: prefill chunks; portable: one prefill bucket)."""
    return lambda ops: image_exports(f"any-{ops}")


@pytest.fixture(scope="module")
def static_export(image_exports):
    """Portable, static grids: the processor's grid of every test picture, plus 16 x 18, which none has."""
    return image_exports("static")


@pytest.mark.parametrize("ops", ["ort", "portable"])
def test_raw_pictures_of_every_shape_match_transformers(any_grid_exports, checkpoint, reference_model, shapes, ops):
    """The default (any-grid) export on ONNX Runtime: one graph for every grid. (On OpenVINO: raw pictures in
    tests/test_video.py's OpenVINO test, the per-grid compiles below.)"""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import token_parity

    pipe = Pipeline.from_exported(any_grid_exports(ops))
    assert not pipe.contract.static_vision
    grids = []
    for name, picture in shapes.items():
        parity = token_parity(pipe, checkpoint, picture, PROMPT, NEW_TOKENS, model=reference_model)
        assert parity.ok and parity.total >= NEW_TOKENS, (name, parity.line())
        grids.append(pipe.prepare(picture, PROMPT).image_grids[0][1:])
    assert grids == processor_grids(shapes)
    assert len(set(grids)) == len(grids)  # five different grids, one graph
    assert pipe.backend.graphs.loaded_grids == [None]


def test_openvino_per_grid_compiles_keep_the_most_recent(any_grid_exports, shapes):
    """--vision-grid-cache 4: the any-grid graph reshaped to each picture's grid and compiled static on first use,
    four kept (the fifth picture's grid drops the first's, which compiles again when used again); the embeddings
    equal the dynamic compile's."""
    from qwen35_onnx.pipeline import Pipeline

    export = any_grid_exports("portable")
    pipe = Pipeline.from_exported(export, runtime="openvino", vision_grid_cache=4)
    dynamic = Pipeline.from_exported(export, runtime="openvino")
    graphs, grids = pipe.backend.graphs, []
    for picture in shapes.values():
        prepared = pipe.prepare(picture, PROMPT)
        embeds = pipe.generation(prepared).run_vision()
        np.testing.assert_allclose(embeds, dynamic.generation(prepared).run_vision(), rtol=0, atol=1e-4)
        grids.append(prepared.image_grids[0][1:])
    assert graphs.grids.compiles == 5 and graphs.loaded_grids == grids[1:]
    for grid in graphs.loaded_grids:  # each compiled grid is static
        graph = graphs.vision(grid)
        assert not graph.dynamic and graph.inputs["pixel_values"] == [grid[0] * grid[1], pipe.contract.patch_dim]
    first = pipe.prepare(list(shapes.values())[0], PROMPT)
    assert graphs.grids.compiles == 5  # no graph runs in prepare
    pipe.generation(first).run_vision()
    assert graphs.grids.compiles == 6 and graphs.loaded_grids[-1] == grids[0]  # dropped, used again: compiled again


def test_static_grids_on_openvino_compile_once_each_and_match_transformers(
    static_export, checkpoint, reference_model, shapes
):
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import token_parity

    pipe = Pipeline.from_exported(static_export, runtime="openvino")
    graphs = pipe.backend.graphs
    compiled = []
    prepare = graphs._prepare
    graphs._prepare = lambda graph: compiled.append(graph.name) or prepare(graph)
    assert graphs.loaded_grids == []  # nothing compiled before the first image
    for _ in range(2):
        for name, picture in shapes.items():
            parity = token_parity(pipe, checkpoint, picture, PROMPT, NEW_TOKENS, model=reference_model)
            assert parity.ok and parity.total >= NEW_TOKENS, (name, parity.line())
    vision = sorted(name for name in compiled if name.startswith("vision"))
    expected = sorted({pipe.contract.vision_graph_key(g) for g in processor_grids(shapes)})
    assert vision == expected  # each grid compiled once, on first use, although used twice
    for grid in pipe.contract.vision_grids:  # every static grid compiles, with no dynamic dimension
        graph = graphs.vision(grid)
        assert graph.inputs["pixel_values"] == [grid[0] * grid[1], pipe.contract.patch_dim]
        assert graph.outputs["image_embeds"][0] == grid[0] * grid[1] // 4


def test_the_vision_grid_cache_option_is_checked():
    from qwen35_onnx.runtime.backend import RuntimeOptions

    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="vision_grid_cache must be an integer >= 0"):
            RuntimeOptions(vision_grid_cache=bad).validate()


def test_a_picture_without_its_grid_goes_to_the_closest_static_grid(static_export, shapes):
    from qwen35_onnx.image_grids import choose_grid, processor_grid
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(static_export)
    picture = shapes["square"].resize((600, 330))  # about 16:9: no exported grid has its shape
    exact = processor_grid(330, 600, 16, 2, 65536, BUDGET * 1024)
    assert exact not in pipe.contract.vision_grids
    prepared = pipe.prepare(picture, PROMPT)
    grid = prepared.image_grids[0][1:]
    assert grid == choose_grid(330, 600, pipe.contract.vision_grids, exact)
    assert prepared.pixel_values.shape == (grid[0] * grid[1], pipe.contract.patch_dim)  # resized to it, not padded
    assert pipe.generate_prepared(prepared, max_new_tokens=4).token_ids


def test_two_grids_in_one_prompt_and_images_in_turns_1_and_3(any_grid_exports, checkpoint, reference_model, shapes):
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import chat_parity

    pipe = Pipeline.from_exported(any_grid_exports("ort"))
    two = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": shapes["landscape"]},
                {"type": "image", "image": shapes["tiny"]},
                {"type": "text", "text": "Compare them."},
            ],
        }
    ]
    parity = chat_parity(pipe, checkpoint, two, NEW_TOKENS, model=reference_model)
    assert parity.ok and parity.total >= NEW_TOKENS, parity.line()
    grids = pipe.prepare_chat(two).image_grids
    assert len({g for g in grids}) == 2
    chat = [
        {"role": "user", "content": [{"type": "image", "image": shapes["portrait"]}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "image", "image": shapes["panorama"]}, {"type": "text", "text": "And?"}]},
    ]
    parity = chat_parity(pipe, checkpoint, chat, NEW_TOKENS, model=reference_model)
    assert parity.ok and parity.total >= NEW_TOKENS, parity.line()


def test_detail_and_the_per_call_limit(any_grid_exports, shapes):
    from qwen35_onnx.conversation.messages import ChatInputError
    from qwen35_onnx.image_grids import grid_tokens
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(any_grid_exports("ort"))
    picture = shapes["landscape"]

    def tokens(detail=None, **kwargs):
        part = {"type": "image", "image": picture} | ({"detail": detail} if detail else {})
        prepared = pipe.prepare_chat([{"role": "user", "content": [part, {"type": "text", "text": "x"}]}], **kwargs)
        return grid_tokens(prepared.image_grids[0][1:], 2)

    assert tokens() == tokens("high") == tokens("auto") == BUDGET
    assert tokens("low") <= 64 < BUDGET
    assert tokens(max_image_tokens=70) <= 70
    with pytest.raises(ChatInputError, match="max_image_tokens 200 is above this export's budget of 96") as err:
        tokens(max_image_tokens=200)
    assert err.value.param == "max_image_tokens"
    with pytest.raises(ChatInputError, match="max_image_tokens 10 is below the image processor's minimum of 64"):
        tokens(max_image_tokens=10)
    with pytest.raises(ChatInputError, match="detail 'huge' must be one of"):
        tokens("huge")
    with pytest.raises(
        ChatInputError, match=r"2400x10 pixels, an aspect ratio of 240:1, above .* limit of 200:1"
    ) as err:
        pipe.prepare(picture.resize((2400, 10)), "x")
    assert err.value.param == "messages[0].content[0]"


def test_verify_refuses_an_image_the_export_cannot_run_at_the_processors_grid(any_grid_exports, checkpoint):
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import token_parity

    pipe = Pipeline.from_exported(any_grid_exports("ort"))
    strip = Image.new("RGB", (1600, 8), (90, 60, 30))  # rounded up to 2 x 228 patches: 114 tokens, over 96
    assert pipe.prepare(strip, PROMPT).image_grids[0][1] * pipe.prepare(strip, PROMPT).image_grids[0][2] <= 4 * BUDGET
    with pytest.raises(ValueError, match=r"processor gives it a 2x228 grid \(114 image tokens\) .* --image-tokens 114"):
        token_parity(pipe, checkpoint, strip, PROMPT, 4, model=object())
