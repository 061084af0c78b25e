"""MLX's affine packing and dequantization, exact against mlx.core; the calibrated search against plain rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.mlx import affine

CASES = [(bits, group) for bits in affine.BITS for group in affine.GROUP_SIZES]


def mlx_core():
    return pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'quantkit[mlx]')")


@pytest.mark.parametrize("bits", affine.BITS)
def test_pack_then_unpack_gives_the_values_back(bits):
    q = np.random.default_rng(bits).integers(0, 2 ** bits, size=(3, 128), dtype=np.uint8)
    words = affine.pack(q, bits)
    assert words.dtype == np.dtype("<u4") and words.shape == (3, 128 * bits // 32)
    assert np.array_equal(affine.unpack(words, bits), q)


def test_packing_is_a_little_endian_bit_stream():
    """3-bit values 1..8 (mod 8): value i at bits 3i..3i+2 of the row's words, lowest bit first."""
    q = (np.arange(32, dtype=np.uint8) + 1)[None] % 8
    words = affine.pack(q, 3)
    stream = sum(int(v) << (3 * i) for i, v in enumerate(q[0]))
    assert [int(w) for w in words[0]] == [(stream >> (32 * k)) & 0xFFFFFFFF for k in range(3)]


@pytest.mark.parametrize("bits,group_size", CASES)
def test_unpack_reads_what_mlx_quantize_packs(bits, group_size):
    mx = mlx_core()
    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    words, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    q = affine.unpack(np.array(words), bits).astype(np.float32)
    rebuilt = np.repeat(np.array(scales), group_size, -1) * q + np.repeat(np.array(biases), group_size, -1)
    assert np.array_equal(rebuilt, np.array(mx.dequantize(words, scales, biases, group_size=group_size, bits=bits)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits,group_size", CASES)
def test_dequantize_is_bit_exact_with_mlx(bits, group_size, dtype):
    """quantkit's quantize -> mlx.core.dequantize equals quantkit's dequantize, value for value."""
    mx = mlx_core()
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits)).to(getattr(torch, dtype))
    words, scales, biases = affine.quantize(w, bits, group_size)
    ours = affine.dequantize(words, scales, biases, bits, group_size)
    as_mx = [mx.array(t.float().numpy()).astype(getattr(mx, dtype)) for t in (scales, biases)]
    theirs = mx.dequantize(mx.array(words), *as_mx, group_size=group_size, bits=bits)
    assert ours.dtype == getattr(torch, dtype)
    assert torch.equal(ours, torch.from_numpy(np.array(theirs.astype(mx.float32))).to(ours.dtype))


@pytest.mark.parametrize("bits", affine.BITS)
def test_calibrated_scales_beat_rounding_on_the_weighted_error(bits):
    """With importance-weighted columns, the searched (scale, bias) have a lower output error than
    min/max rounding, in the same format and size."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen)
    x = torch.randn(256, 256, generator=gen) * torch.exp(torch.randn(256, generator=gen))
    imp = (x * x).mean(0)

    def output_error(importance):
        words, scales, biases = affine.quantize(w, bits, 64, importance)
        return float(((x @ (affine.dequantize(words, scales, biases, bits, 64) - w).T) ** 2).mean())

    assert output_error(imp) < 0.8 * output_error(None)


def test_quantize_is_deterministic_and_keeps_the_scale_dtype():
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    first = affine.quantize(w, 4, 32, torch.ones(128))
    second = affine.quantize(w, 4, 32, torch.ones(128))
    assert np.array_equal(first[0], second[0]) and torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    assert first[1].dtype == torch.bfloat16 and first[1].shape == (96, 4)


def test_stacked_experts_are_quantized_each_on_its_own_and_read_by_mlx():
    """quantize_stacked: each expert's slice exactly what `quantize` gives it with its own importances, stored
    [experts, rows, words] as mlx-lm's QuantizedSwitchLinear holds them; mlx.core dequantizes the stack along its
    last axis to quantkit's dequantization of each expert."""
    mx = mlx_core()
    generator = torch.Generator().manual_seed(0)
    w, imp = torch.randn(3, 8, 64, generator=generator), torch.rand(3, 64, generator=generator)
    words, scales, biases = affine.quantize_stacked(w, 4, 32, imp, torch.bfloat16)
    assert words.shape == (3, 8, 8) and scales.shape == biases.shape == (3, 8, 2)
    for e in range(3):
        own = affine.quantize(w[e], 4, 32, imp[e], torch.bfloat16)
        assert np.array_equal(words[e], own[0]) and torch.equal(scales[e], own[1]) and torch.equal(biases[e], own[2])
    theirs = mx.dequantize(mx.array(words), mx.array(scales.float().numpy()).astype(mx.bfloat16),
                           mx.array(biases.float().numpy()).astype(mx.bfloat16), group_size=32, bits=4)
    ours = torch.stack([affine.dequantize(words[e], scales[e], biases[e], 4, 32) for e in range(3)])
    assert np.array_equal(np.array(theirs.astype(mx.float32)), ours.float().numpy())


def test_dequantize_a_slab_at_a_time_is_the_whole_product(monkeypatch):
    """Dequantized a few rows at a time into one output: value for value the whole tensor's scale * q + bias in
    the scales' dtype (what mlx.core.dequantize computes), a last slab shorter than the others included."""
    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    words, scales, biases = affine.quantize(w, 4, 32)
    q = torch.from_numpy(affine.unpack(words, 4)).to(scales.dtype)
    whole = (q.reshape(37, -1, 32) * scales[..., None] + biases[..., None]).reshape(37, -1)
    monkeypatch.setattr(affine, "SLAB_VALUES", 5 * 128)
    ours = affine.dequantize(words, scales, biases, 4, 32)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, whole)
