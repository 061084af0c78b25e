"""vLLM's KV-cache types against values derived from vLLM's sources (cache.py, turboquant/{config,centroids}.py,
triton_turboquant_store.py, int4_per_token_head.py); tests/eval/kv/test_vllm_kernels.py runs vLLM's own code."""

import math

import numpy as np
import torch

from quantkit.eval.kv import vllm


def keys(seed=0, shape=(5, 2, 128), dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 30
    return x.to(dtype)


def test_fp8_saturates_and_scales():
    x = torch.tensor([1000.0, -1000.0, 0.3, 1e-9])
    out = vllm.fp8_round_trip(x, scale=1.0)
    assert out[0] == 448 and out[1] == -448
    assert out[2] == torch.tensor(0.3).to(torch.float8_e4m3fn).float()
    np.testing.assert_array_equal(vllm.fp8_round_trip(x, scale=4.0), (x / 4).clamp(-448, 448).to(
        torch.float8_e4m3fn).float() * 4)
    assert vllm.fp8_round_trip(torch.tensor([1e6]), e5m2=True) == 57344


def test_per_token_head_scale_is_absmax():
    x = keys(1, dtype=torch.float32)
    out = vllm.per_token_head_round_trip(x, "int8")
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((out - x).abs() <= step * (0.5 + 1e-5))
    np.testing.assert_allclose(out.abs().amax(-1).numpy(), x.abs().amax(-1).numpy(), rtol=1e-6)
    fp8 = vllm.per_token_head_round_trip(x, "fp8")
    np.testing.assert_allclose(fp8.abs().amax(-1).numpy(), x.abs().amax(-1).numpy(), rtol=1e-6)


def test_int4_codes_as_the_store_kernel():
    """_reshape_cache_int4_kernel: zp from -min/scale, codes in [0, 15], zp in the scale's low mantissa bits."""
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0] * 4])
    q, zp, scale = vllm.int4_codes(x)
    s = 3.0 / 15
    assert zp.item() == 5  # round(1 / 0.2)
    expected = torch.clamp(vllm.round_half_away(x / torch.tensor(s) + 5), 0, 15)
    assert torch.equal(q, expected)
    bits = torch.tensor([s], dtype=torch.float32).view(torch.int32) & -16
    assert scale.item() == bits.view(torch.float32).item()


def test_rht_signs_are_the_seeded_generator():
    s = vllm.rht_signs(128)
    gen = torch.Generator().manual_seed(0x9E3779B9)
    assert torch.equal(s, 2.0 * torch.bernoulli(torch.full((128,), 0.5), generator=gen) - 1.0)
    assert set(s.tolist()) == {-1.0, 1.0}


def test_int4_round_trip_inverts_the_rotation():
    """Without quantization error (16 distinct levels exactly), the read-back equals the input."""
    d = 64
    h, signs = vllm.sylvester(d), vllm.rht_signs(d)
    codes = torch.arange(16.0).repeat(d // 16)[None] - 7.0  # a rotated vector on the 4-bit grid
    x = (codes @ h.T * signs / d)  # its preimage
    np.testing.assert_allclose(vllm.int4_round_trip(x.float()).numpy(), x.numpy(), atol=1e-5)


def test_lloyd_max_matches_gaussian_quantizer():
    """Max's optimal quantizer for N(0, σ²): 1 bit ±0.7979σ, 2 bits ±0.4528σ, ±1.5104σ."""
    d = 128
    sigma = 1 / math.sqrt(d)
    one = vllm.lloyd_max(d, 1).centroids
    np.testing.assert_allclose(np.array(one) / sigma, [-0.7979, 0.7979], atol=2e-3)
    two = vllm.lloyd_max(d, 2).centroids
    np.testing.assert_allclose(np.array(two) / sigma, [-1.5104, -0.4528, 0.4528, 1.5104], atol=2e-3)
    assert len(vllm.lloyd_max(d, 3).centroids) == 8


def test_turboquant_key_is_norm_times_unit_codebook_vector():
    k = keys(2, (7, 1, 128))
    out = vllm.tq_key_round_trip(k, vllm.lloyd_max(k.shape[-1], 3), norm_correction=True).float()
    np.testing.assert_allclose(out.norm(dim=-1).numpy(), k.float().norm(dim=-1).numpy(), rtol=1e-2)  # fp16 norm, unit codebook vector
    idx, _ = vllm.tq_key_codes(k, vllm.lloyd_max(k.shape[-1], 3))
    assert idx.min() >= 0 and idx.max() <= 7
    cos = torch.nn.functional.cosine_similarity(out, k.float(), dim=-1)
    assert cos.min() > 0.9


def test_turboquant_value_min_max():
    v = torch.tensor([[0.0, 1.0, 2.0, 15.0]])
    q, scale, lo = vllm.tq_value_codes(v, 4)
    assert torch.equal(q, torch.tensor([[0.0, 1.0, 2.0, 15.0]])) and scale.item() == 1.0 and lo.item() == 0.0
    assert torch.equal(vllm.tq_value_round_trip(v, 4), v)


def test_layout_bytes_are_turboquant_config():
    """TurboQuantConfig.key_packed_size / value_packed_size for head_dim 128."""
    assert vllm.key_bytes("turboquant_k3v4_nc", 128) == 48 + 2
    assert vllm.value_bytes("turboquant_k3v4_nc", 128) == 64 + 4
    assert vllm.key_bytes("turboquant_k8v4", 128) == 128
    assert vllm.value_bytes("turboquant_3bit_nc", 128) == 48 + 4


def test_boundary_skip_layers():
    assert vllm.boundary_skip_layers(32) == (0, 1, 30, 31)
    assert vllm.boundary_skip_layers(3) == (0, 2)
