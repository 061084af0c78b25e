"""Offset norms (x * (1 + w)) through llm-compressor's calibration stand-in and its smoothing, exactly
(quantkit.engines.llmcompressor.offset_norm): a norm nothing smoothed comes back bit for bit, and a smoothed one
stores a factor that, times the scale the balance layers took, is the original 1 + w."""

from __future__ import annotations

import pytest
import torch

from quantkit.engines.llmcompressor.offset_norm import representable_scales
from quantkit.engines.patches import OFFSET_NORMS, patched


def gemma_norm(weight):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(weight.numel())
    norm.weight.data = weight.clone()
    return norm


def round_trip(weight, scales=None):
    """The weight CalibrationOffsetNorm writes back after (optionally) dividing by `scales`, as AWQ does."""
    from llmcompressor.modeling.offset_norm import CalibrationOffsetNorm

    norm = gemma_norm(weight)
    stand_in = CalibrationOffsetNorm(norm, None)
    if scales is not None:
        stand_in.weight.data.div_(scales)
    return stand_in.restore(norm).weight.data


def small_weights():
    return (torch.randn(512, generator=torch.Generator().manual_seed(0)) * 2.0 ** -8).to(torch.bfloat16)


def test_a_norm_nothing_smoothed_comes_back_bit_for_bit():
    weight = small_weights()
    with patched(*OFFSET_NORMS):
        assert torch.equal(round_trip(weight), weight)


def test_llm_compressor_alone_loses_small_norm_weights():
    """The check can fail: 0.14.0.1 rounds 1 + w to bf16 on the way in (|w| < 2^-9 comes back as 0)."""
    weight = small_weights()
    back = round_trip(weight)
    assert not torch.equal(back, weight) and int((back == 0).sum()) > int((weight == 0).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_stored_factor_times_the_scale_is_the_original(dtype):
    generator = torch.Generator().manual_seed(1)
    factor = 1 + (torch.randn(4096, generator=generator) * 0.5).to(dtype).float()
    factor[:4] = torch.tensor([0.0, -0.3, 1e-3, 40.0])
    scales = 10.0 ** (torch.rand(4096, generator=generator) * 8 - 4)  # 1e-4 .. 1e4, wider than AWQ's
    kept = representable_scales(factor, scales, dtype)
    stored = (factor / kept - 1).to(dtype).float()  # what the stand-in writes back after AWQ's division
    assert torch.isfinite(kept).all() and (kept > 0).all()
    live = factor != 0
    assert torch.allclose(((1 + stored) * kept)[live], factor[live], rtol=1e-6, atol=0)
    near = (factor / scales).abs().clamp(0.125, 8) == (factor / scales).abs()  # stored factors of bf16's fine steps
    assert ((kept[near] / scales[near]) - 1).abs().max() < 0.02  # the search's choice, moved by a rounding step


def test_the_plain_division_misses_the_factor_where_scales_are_large():
    """What the scales fix: (1 + w) / s - 1 stored in bf16, times s, is off by up to 2^-9 s / (1 + w)."""
    factor, scales = torch.ones(1000), torch.linspace(50, 200, 1000)
    stored = (factor / scales - 1).to(torch.bfloat16).float()
    assert ((1 + stored) * scales / factor - 1).abs().max() > 0.1
