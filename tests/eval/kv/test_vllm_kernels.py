"""quantkit's vLLM KV-cache simulations against vLLM's own code, run from the vLLM install of
scripts/setup_engines.sh ($QUANTKIT_ENGINES/vllm/bin/python): the Lloyd-Max centroids of
vllm.model_executor.layers.quantization.turboquant.centroids, and TurboQuant's store kernel
(vllm/v1/attention/ops/triton_turboquant_store.py) run by Triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors: the stored key codes, norms, value codes, scales and minima, element for element (Triton itself handed
to the kernels where the CPU build's import would replace it)."""

import json
import subprocess

import numpy as np
import pytest
import torch

from quantkit.eval.kv import vllm
from quantkit.serve.engines import engines_dir

PYTHON = engines_dir() / "vllm" / "bin" / "python"
HAS_VLLM = PYTHON.is_file() and subprocess.run([str(PYTHON), "-c", "import vllm"], capture_output=True).returncode == 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (setup_engines.sh)")]

VLLM_SIDE = r"""
import json, math, sys, types
import triton, triton.language as tl
# vLLM's CPU build disables Triton when Triton has no CPU backend (vllm.triton_utils.importing puts placeholders in
# its place); the interpreter needs none, so the kernels are given Triton itself, as a GPU build's import gives it
sys.modules["vllm.triton_utils"] = types.SimpleNamespace(triton=triton, tl=tl, HAS_TRITON=True)
import numpy as np, torch
from vllm.model_executor.layers.quantization.turboquant.centroids import solve_lloyd_max
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
data = np.load(sys.argv[1])
out = {}
for d in (64, 128):
    for b in (3, 4):
        out[f"centroids_{d}_{b}"] = solve_lloyd_max(d, b)[0].tolist()
for preset in ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
    k, v = torch.from_numpy(data["k"]), torch.from_numpy(data["v"])
    n, h, d = k.shape
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    H = torch.tensor([[1.0]])
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    H = H / math.sqrt(d)
    c = solve_lloyd_max(d, cfg.mse_bits)[0].sort().values
    mid = (c[:-1] + c[1:]) / 2
    cache = torch.zeros(1, n, h, cfg.slot_size_aligned, dtype=torch.uint8)
    triton_turboquant_store(k, v, cache, torch.arange(n, dtype=torch.int32), H, mid, cfg.mse_bits,
                            cfg.key_packed_size, cfg.value_quant_bits)
    out[preset] = cache[0].numpy().tolist()
print(json.dumps(out))
"""


def unpack(raw: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The kernels' little-endian bit packing (bits 3: 8 codes in 3 bytes; 4: 2 per byte)."""
    value = np.zeros(raw.shape[:-1] + (count,), np.int64)
    as_int = [int.from_bytes(bytes(r), "little") for r in raw.reshape(-1, raw.shape[-1])]
    flat = value.reshape(-1, count)
    for row, number in enumerate(as_int):
        flat[row] = [(number >> (bits * i)) & ((1 << bits) - 1) for i in range(count)]
    return value


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(6, 2, 128, generator=g) * 3).to(torch.float16)
    v = torch.randn(6, 2, 128, generator=g).to(torch.float16)
    path = tmp_path_factory.mktemp("tq") / "kv.npz"
    np.savez(path, k=k.numpy(), v=v.numpy())
    result = subprocess.run([str(PYTHON), "-c", VLLM_SIDE, str(path)], capture_output=True, text=True,
                            env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    return k, v, json.loads(result.stdout.strip().splitlines()[-1])


def test_centroids_are_vllms(engine):
    _, _, out = engine
    for d in (64, 128):
        for b in (3, 4):
            ours = np.array(vllm.lloyd_max(d, b).centroids, np.float32)
            np.testing.assert_array_equal(ours, np.array(out[f"centroids_{d}_{b}"], np.float32))


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"])
def test_store_kernel_codes_are_ours(engine, preset):
    k, v, out = engine
    cache = np.array(out[preset], np.uint8)  # (n, h, slot)
    k_bits, v_bits, _ = vllm.TURBOQUANT[preset]
    d = k.shape[-1]
    mse = -(-d * k_bits // 8)
    idx, norms = vllm.tq_key_codes(k, vllm.lloyd_max(k.shape[-1], k_bits))
    np.testing.assert_array_equal(unpack(cache[..., :mse], k_bits, d), idx.numpy())
    np.testing.assert_array_equal(cache[..., mse:mse + 2].copy().view(np.float16)[..., 0], norms[..., 0].numpy())
    q, scale, lo = vllm.tq_value_codes(v, v_bits)
    vb = -(-d * v_bits // 8)
    base = mse + 2
    np.testing.assert_array_equal(unpack(cache[..., base:base + vb], v_bits, d), q.numpy().astype(np.int64))
    meta = cache[..., base + vb:base + vb + 4].copy().view(np.float16)
    np.testing.assert_array_equal(meta[..., 0], scale[..., 0].numpy())
    np.testing.assert_array_equal(meta[..., 1], lo[..., 0].numpy())
