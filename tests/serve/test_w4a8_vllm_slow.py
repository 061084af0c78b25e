"""gptq W4A8 artifacts against the installed vLLM (scripts/setup_engines.sh): the scheme and kernel vLLM's own
code picks for each and the parameters it loads them into (tests/serve/vllm_scheme_probe.py, run by vLLM's
interpreter), and serve-check: the int8-activation artifact served by vLLM's CPU build as the gate read it, the
fp8-activation one (Hopper only) refused on a CPU before any server starts."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from quantkit.serve import engines, llama_server, mlx_server, vllm_server
from tests.methods.conftest import stored_tensors
from tests.serve.test_serve_check_slow import check_passed, require, serve_check, trained  # noqa: F401

pytestmark = pytest.mark.slow
PROBE = Path(__file__).with_name("vllm_scheme_probe.py")
CALIB = ("--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--no-gate")
LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def w4a8(trained, tmp_path_factory):  # noqa: F811
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    root, made = tmp_path_factory.mktemp("w4a8-serve"), {}

    def make(activations: str) -> Path:
        if activations not in made:
            out = root / activations
            result = CliRunner().invoke(app, ["quantize", str(trained), "-o", str(out), "--method", "gptq",
                                              "--activations", activations, *CALIB], catch_exceptions=False)
            assert result.exit_code == 0, result.output
            made[activations] = out
        return made[activations]

    return make


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_probe(artifact: Path, shape: list[int]) -> dict:
    """vllm_scheme_probe.py's answer for LAYER of this [out, in] shape, run by vLLM's interpreter."""
    vllm = require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    python = engines.script_python(vllm.executable) or vllm.executable.with_name("python3")
    result = subprocess.run([str(python), str(PROBE), str(artifact), LAYER, str(shape[0]), str(shape[1]),
                             str(free_port())], capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-2000:]
    return json.loads(lines[-1])


def on_cpu() -> bool:
    from quantkit.serve.support import accelerator

    return accelerator().kind == "cpu"


def test_vllm_loads_w4a8_int8_into_its_w4a8_int_scheme(w4a8):
    if not on_cpu():
        pytest.skip("the kernel checked is the CPU build's")
    artifact = w4a8("int8")
    stored = stored_tensors(artifact)
    shape = stored[f"{LAYER}.weight"][1]
    found = vllm_probe(artifact, shape)
    assert found.get("scheme") == "CompressedTensorsW4A8Int", found
    assert found["kernel"] == "Dynamic4bitLinearKernel"
    # the checkpoint's tensors are exactly the parameters vLLM's scheme creates (same dtype and shape)
    assert stored[f"{LAYER}.weight"] == ("I8", shape) and found["params"]["weight"] == ["int8", shape]
    assert stored[f"{LAYER}.weight_scale"][0] == "BF16"
    assert found["params"]["weight_scale"] == ["bfloat16", stored[f"{LAYER}.weight_scale"][1]]


def test_vllm_cpu_has_no_scheme_for_w4a8_fp8(w4a8):
    if not on_cpu():
        pytest.skip("the refusal is the CPU build's")
    from safetensors import safe_open

    artifact = w4a8("fp8")
    with safe_open(next(artifact.glob("*.safetensors")), "pt") as f:
        shape = f.get_tensor(f"{LAYER}.weight_shape").tolist()
    found = vllm_probe(artifact, shape)
    assert found["error"].startswith("NotImplementedError: No compressed-tensors compatible scheme was found")


def test_vllm_cpu_w4a8_kernel_quantizes_each_token_asymmetrically():
    """What the docs say of the gate's reading against vLLM's CPU kernel: torch's _dyn_quant_matmul_4bit rounds
    activations to int8 per token asymmetrically (whatever the config's `symmetric`)."""
    if not on_cpu():
        pytest.skip("the kernel checked is the CPU build's")
    vllm = require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    python = engines.script_python(vllm.executable) or vllm.executable.with_name("python3")
    result = subprocess.run([str(python), str(PROBE.with_name("vllm_dynamic_4bit_probe.py"))], capture_output=True,
                            text=True, timeout=300, check=False)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["asymmetric"] < 1e-4, found
    assert found["symmetric"] > 1e-2 and found["float"] > 1e-2, found


def test_vllm_cpu_serves_w4a8_int8_as_gated(cli, w4a8, tmp_path):
    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    artifact = w4a8("int8")
    code, data, stderr = serve_check(cli, artifact, tmp_path)
    check_passed(code, data, stderr, artifact, "vllm")


def test_serve_check_refuses_w4a8_fp8_on_a_cpu(cli, w4a8, tmp_path):
    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    if not on_cpu():
        pytest.skip("the refusal is the CPU build's")
    code, data, stderr = serve_check(cli, w4a8("fp8"), tmp_path)
    assert code == 2 and data is None
    assert "W4A8 with FP8 activations on Hopper GPUs only" in stderr and "this is a CPU" in stderr
