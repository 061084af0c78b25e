"""mlx-lm's KV cache: the simulation equals mx.quantize / mx.dequantize element for element."""

import numpy as np
import pytest
import torch

from quantkit.errors import UnsupportedError
from quantkit.eval.kv import mlx as kv_mlx

mx = pytest.importorskip("mlx.core")

MX_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@pytest.mark.parametrize("dtype", list(MX_DTYPES))
def test_round_trip_is_mx_quantize(dtype):
    for bits in kv_mlx.BITS:
        for group_size in kv_mlx.GROUP_SIZES:
            check_round_trip(dtype, bits, group_size)


def check_round_trip(dtype, bits, group_size):
    rng = np.random.default_rng(bits * 7 + group_size)
    x = (rng.standard_normal((2, 3, 128)) * rng.uniform(0.05, 8)).astype(np.float32)
    x[0, 0, :group_size] = 0.0  # an all-zero group: q0 == 0, bias 0
    x[1, 1, :group_size] = np.abs(x[1, 1, :group_size])  # one-signed groups take the other edge
    t = torch.from_numpy(x).to(dtype)
    a = mx.array(t.float().numpy()).astype(getattr(mx, MX_DTYPES[dtype]))
    w, s, b = mx.quantize(a, group_size=group_size, bits=bits)
    ref = np.array(mx.dequantize(w, s, b, group_size=group_size, bits=bits).astype(mx.float32))
    got = kv_mlx.round_trip(t, bits, group_size).float().numpy()
    np.testing.assert_array_equal(got, ref)


def test_group_must_tile_head_dim():
    with pytest.raises(UnsupportedError, match="head dimension 96"):
        kv_mlx.check(4, 64, 96)
    with pytest.raises(UnsupportedError, match="--kv-bits 7"):
        kv_mlx.check(7, 64, 128)


def test_bytes_per_value():
    assert kv_mlx.bytes_per_value(4, 64) == 0.5 + 4 / 64
