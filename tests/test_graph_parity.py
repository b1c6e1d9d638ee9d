"""Acceptance: each graph against the transformers modules on the same inputs (vision
embeddings, prefill last logits and all three states, several decode steps): max abs error
<= 1e-4 in fp32."""

from __future__ import annotations

import numpy as np
import pytest

from qwen35_onnx.pipeline import Pipeline

from .conftest import PROMPT

pytestmark = pytest.mark.slow
TOL = 1e-4
DECODE_STEPS = 4


def _maxabs(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def _reference_states(cache, contract):
    """transformers cache -> our stacked layouts (conv state: its last K-1 columns, time-major)."""
    conv, rec, kv = [], [], []
    for i, kind in enumerate(contract.layer_types):
        layer = cache.layers[i]
        if kind == "linear_attention":
            conv.append(layer.conv_states[0][..., -(contract.conv_kernel - 1) :].transpose(-1, -2).numpy())
            rec.append(layer.recurrent_states[0].float().numpy())
        else:
            kv.extend([layer.keys.numpy(), layer.values.numpy()])
    return np.stack(conv), np.stack(rec), kv


@pytest.fixture(scope="module")
def pipe(fixed_export):
    return Pipeline.from_exported(fixed_export, host_state_roundtrip=True)


def test_each_graph_matches_transformers(pipe, reference_model, photo):
    import torch
    from transformers import DynamicCache

    contract = pipe.contract
    prepared = pipe.prepare(photo, PROMPT)
    ids = torch.from_numpy(prepared.input_ids)
    pixels = torch.from_numpy(prepared.pixel_values)
    assert prepared.image_grids == ((1, 16, 16),)  # the photo's own grid (256 x 256 pixels)
    grid = torch.tensor(prepared.image_grids)
    prompt_len = ids.shape[1]
    generation = pipe.generation(prepared)

    # vision
    embeds = generation.run_vision()
    with torch.no_grad():
        ref_embeds = reference_model.model.get_image_features(pixels, grid).pooler_output[0]
    assert _maxabs(embeds, ref_embeds) <= TOL

    # prefill: last logits and the three states
    assert prepared.bucket > prompt_len  # the prompt is padded
    logits = generation.prefill(embeds)
    states = generation.states
    cache = DynamicCache(config=reference_model.config.text_config)
    with torch.no_grad():
        out = reference_model(
            input_ids=ids,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(ids == contract.image_token_id).int(),
            cache=cache,
            use_cache=True,
        )
    assert _maxabs(logits, out.logits[0, -1]) <= TOL
    ref_conv, ref_rec, ref_kv = _reference_states(cache, contract)
    assert _maxabs(states["present_conv_states"], ref_conv) <= TOL
    assert _maxabs(states["present_recurrent_states"], ref_rec) <= TOL
    kv = states["present_kv_cache"]
    assert kv.shape[3] == contract.capacity
    for n, ref in enumerate(ref_kv):
        assert _maxabs(kv[n, :, :, :prompt_len], ref) <= TOL
    assert not kv[:, :, :, prompt_len:].any(), "KV slots past the prompt must stay zero"

    # decode: several steps on the reference's greedy tokens (host-state roundtrip: the decoder's
    # states are numpy arrays after each step)
    token = int(out.logits[0, -1].argmax())
    for step in range(DECODE_STEPS):
        assert generation.length == prompt_len + step
        step_logits = generation.step(token)
        with torch.no_grad():
            out = reference_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        assert _maxabs(step_logits, out.logits[0, -1]) <= TOL, f"decode step {step}"
        past = generation.decoder.past
        ref_conv, ref_rec, ref_kv = _reference_states(cache, contract)
        assert _maxabs(past["conv_states"], ref_conv) <= TOL
        assert _maxabs(past["recurrent_states"], ref_rec) <= TOL
        for n, ref in enumerate(ref_kv):
            assert _maxabs(past["kv_cache"][n, :, :, : prompt_len + step + 1], ref) <= TOL
        token = int(out.logits[0, -1].argmax())


def test_vision_graph_of_another_grid_matches_transformers(pipe, reference_model, photo):
    """The export's one any-grid vision graph on a grid that is not square (12 x 20 patches, the
    checkpoint processor's grid of a 400 x 240 picture): its position taps and rotary ids are the
    host's, per grid."""
    import torch
    from PIL import Image

    picture = Image.open(photo).convert("RGB").resize((400, 240))
    pixels, grid = pipe.preprocessor.pixel_values(picture)
    assert grid == (1, 12, 20)
    embeds = pipe.backend.run_vision(grid[1:], pixels)
    assert embeds.shape == (12 * 20 // 4, pipe.contract.image_embed_dim)
    with torch.no_grad():
        ref = reference_model.model.get_image_features(torch.from_numpy(pixels), torch.tensor([grid])).pooler_output[0]
    assert _maxabs(embeds, ref) <= TOL
