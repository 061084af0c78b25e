"""vLLM's CPU backend stores an fp8 KV cache by truncating the mantissa toward zero (not rounding to nearest as
its GPU kernels do): quantkit's simulation against known values and, where vLLM is installed, against vLLM's own
cpu_attn_reshape_and_cache byte for byte."""

import json
import subprocess

import pytest
import torch

from quantkit.eval.kv.vllm import fp8_cpu_codes, fp8_cpu_round_trip, fp8_round_trip
from quantkit.serve import vllm_server


def test_truncated_toward_zero_and_saturated():
    x = torch.tensor([0.3, -0.3, 3e-3, 500.0, -1000.0, 7.0, 0.0, 1e-4])
    assert fp8_cpu_round_trip(x).tolist() == [0.28125, -0.28125, 0.001953125, 448.0, -448.0, 7.0, 0.0, 0.0]
    assert fp8_round_trip(x)[:3].tolist() == [0.3125, -0.3125, 0.00390625]  # the GPU kernels' nearest
    assert fp8_cpu_round_trip(x, e5m2=True)[:5].tolist() == [0.25, -0.25, 0.0029296875, 448.0, -896.0]
    # a value on the grid is kept; a scale divides first
    grid = torch.tensor([0.28125, 448.0, -0.001953125])
    assert torch.equal(fp8_cpu_round_trip(grid), grid)
    assert fp8_cpu_round_trip(torch.tensor([0.6]), scale=2.0).tolist() == [0.5625]


def test_never_farther_from_zero_than_the_value():
    x = torch.randn(4096) * 3
    for e5m2 in (False, True):
        y = fp8_cpu_round_trip(x, e5m2=e5m2)
        assert bool((y.abs() <= x.abs()).all()) and bool((torch.sign(y) * torch.sign(x) >= 0).all())


PROBE = """
import json, sys, torch
import vllm._custom_ops as ops
x = torch.tensor(json.loads(sys.stdin.read())["x"], dtype=torch.float32).to(torch.bfloat16)
tokens, dim = x.shape
out = {}
for name, scale in (("fp8", 1.0), ("fp8", 0.05), ("fp8_e5m2", 1.0)):
    kc = torch.zeros(1, 1, tokens, dim, dtype=torch.uint8); vc = torch.zeros_like(kc)
    ops.cpu_attn_reshape_and_cache(x[:, None], x[:, None], kc, vc, torch.arange(tokens), "vec", scale, scale, name)
    out[f"{name}@{scale}"] = vc[0, 0].tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_equals_vllm_cpu_byte_for_byte(tmp_path):
    installed = vllm_server.find()
    if installed is None:
        pytest.skip("vLLM is not installed (scripts/setup_engines.sh)")
    python = vllm_server.script_python(installed.executable)
    if python is None:
        pytest.skip("vLLM's python is not found beside its executable")
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=generator) * torch.logspace(-4, 3, 64)).to(torch.bfloat16)
    done = subprocess.run([str(python), "-c", PROBE], input=json.dumps({"x": x.float().tolist()}), text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    stored = json.loads(done.stdout.strip().splitlines()[-1])
    for key, codes in stored.items():
        name, scale = key.split("@")
        ours = fp8_cpu_codes(x, float(scale), e5m2=name == "fp8_e5m2")
        assert ours.tolist() == codes, key
