"""llama.cpp's KV cache: blocks as gguf-py's reference quantizers (ggml-quants.c ports) store them, and the
Hadamard rotation of src/llama-kv-cache.cpp."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from quantkit.errors import UnsupportedError
from quantkit.eval.kv import llamacpp

LEGACY = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def vectors(seed=0, shape=(3, 5, 128)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 7] *= 20  # an outlier channel, as keys have
    return x


@pytest.mark.parametrize("name", LEGACY)
def test_blocks_are_gguf_py_reference(name):
    x = vectors()
    qtype = QT[name.upper()]
    ref = gguf_dequantize(gguf_quantize(x, qtype), qtype)
    np.testing.assert_array_equal(llamacpp.round_trip(x, name), ref)


def test_f16_cache_rounds_to_half():
    x = vectors()
    np.testing.assert_array_equal(llamacpp.round_trip(x, "f16"), x.astype(np.float16).astype(np.float32))


def test_hadamard_is_ggml_gen_hadamard():
    """ggml_gen_hadamard's recursion: data[0][0] = 1/sqrt(n); each doubling copies the block, negating the corner."""
    for n in (64, 128, 256):
        h = llamacpp.hadamard(n)
        np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-5)  # res^2 == I (orthonormal, symmetric)
        np.testing.assert_array_equal(h, h.T)
        assert h[0, 0] == np.float32(1 / np.sqrt(n))
        np.testing.assert_array_equal(np.sign(h[n // 2:, n // 2:]), -np.sign(h[:n // 2, :n // 2]))


def test_rotation_sizes():
    assert llamacpp.k_rotation_size(128) == 128 and llamacpp.k_rotation_size(192) == 64
    assert llamacpp.k_rotation_size(256) == 256 and llamacpp.k_rotation_size(96) == 0
    assert llamacpp.v_rotation_size(256) == 64 and llamacpp.v_rotation_size(80) == 0


def test_rotated_attention_equals_model_basis():
    """q'·k' in the model's basis equals the engine's dot product of the rotated, quantized vectors."""
    q, k = vectors(1, (4, 128)), vectors(2, (6, 128))
    n = llamacpp.k_rotation_size(128)
    engine = llamacpp.q8_round_trip(llamacpp.rotate(q, n)) @ llamacpp.round_trip(llamacpp.rotate(k, n), "q4_0").T
    ours = llamacpp.query(q, "q4_0", n) @ llamacpp.stored(k, "q4_0", n).T
    np.testing.assert_allclose(ours, engine, rtol=1e-4, atol=1e-3)


def test_rotation_spreads_outliers():
    x = vectors()
    plain = np.abs(llamacpp.stored(x, "q4_0", 0) - x).mean()
    rotated = np.abs(llamacpp.stored(x, "q4_0", 128) - x).mean()
    assert rotated < plain


def test_head_dim_must_tile_blocks():
    with pytest.raises(UnsupportedError, match="multiple of 32"):
        llamacpp.check_head_dim("q4_0", 80)
    llamacpp.check_head_dim("f16", 80)
    with pytest.raises(UnsupportedError, match="q3_k"):
        llamacpp.check_type("q3_k")
