"""serve-check end to end against each installed engine (scripts/setup_engines.sh), on a small trained
Llama (hidden 256, 4 heads of 64: shapes vLLM's CPU kernels, llama.cpp and mlx accept) quantized
through the CLI. Each test checks the exit code, the JSON, the quantkit.json record, and that no server
process outlives the command."""

import json
import shutil
import socket
from pathlib import Path

import pytest

from quantkit.serve import engines, llama_server, mlx_server, vllm_server

pytestmark = pytest.mark.slow
CALIB = ("--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--no-gate")
SETUP = "scripts/setup_engines.sh (or set QUANTKIT_ENGINES / {variable})"


def require(finder, name: str, variable: str):
    found = finder()
    if found is None:
        pytest.skip(f"{name} is not installed: {SETUP.format(variable=variable)}")
    return found


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The micro preset trained long enough (150 steps) for peaked next-token distributions."""
    from quantkit.toy import make_toy_model

    return make_toy_model(tmp_path_factory.mktemp("serve") / "base", "micro", steps=150)


@pytest.fixture(scope="module")
def quantized(trained, tmp_path_factory):
    """quantized("fp8", "--method", "fp8"): the artifact written by `quantkit quantize`, once per name."""
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    root, made = tmp_path_factory.mktemp("artifacts"), {}

    def make(name: str, *args: str) -> Path:
        if name not in made:
            out = root / name
            result = CliRunner().invoke(app, ["quantize", str(trained), "-o", str(out), *args, *CALIB],
                                        catch_exceptions=False)
            assert result.exit_code == 0, result.output
            made[name] = out
        return made[name]

    return make


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def live_processes_naming(needle: str) -> list[str]:
    """Command lines of live (not zombie) processes that contain `needle`."""
    found = []
    for pid in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            cmdline = (pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (pid / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            found.append(cmdline)
    return found


def serve_check(cli, artifact: Path, tmp_path: Path, *args: str):
    """(exit code, JSON or None, stderr) of `quantkit serve-check`; asserts the server is gone after."""
    out = tmp_path / f"{artifact.name}-serve.json"
    result = cli("serve-check", artifact, "--json", out, "--num-windows", "2", "--gen-prompts", "2",
                 "--load-tokens", "8", "--concurrency", "1,4", *args)
    data = json.loads(out.read_text()) if out.exists() else None
    if data:
        command = data["engine"]["command"]
        port = int(command[command.index("--port") + 1])
        assert not listening(port)
        assert not live_processes_naming(f"--port {port}")
    assert not live_processes_naming(str(artifact.resolve()))
    return result.exit_code, data, result.stderr


def check_passed(code: int, data: dict, stderr: str, artifact: Path, engine: str):
    assert code == 0, stderr
    assert data["passed"] and data["engine"]["name"] == engine and data["windows"]["scored"] > 0
    assert data["vs_reading"]["kld_lower_bound"] < 0.01
    tokens = data["tokenization"]  # the engine's own ids of the held-out text: the Hugging Face tokenizer's
    assert tokens["matches"] and tokens["texts"] == data["windows"]["count"] and tokens["tokens"] > 0
    assert all(r["tokens"] > 0 and r["ttft_s"] > 0 for r in data["load"])
    report = artifact if artifact.is_dir() else artifact.parent
    recorded = json.loads((report / "quantkit.json").read_text())["serve_check"][engine]
    assert recorded["passed"] and recorded["engine"]["version"]


@pytest.mark.parametrize("method", [("fp8", "--method", "fp8"), ("gptq", "--method", "gptq"),
                                    ("smoothquant", "--method", "smoothquant")], ids=lambda m: m[0])
def test_vllm_serves_as_gated(cli, quantized, tmp_path, method):
    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    artifact = quantized(*method)
    code, data, stderr = serve_check(cli, artifact, tmp_path)
    check_passed(code, data, stderr, artifact, "vllm")
    assert data["ppl"]["ppl_exact"]  # vLLM gives every prompt token's own log-prob


def test_vllm_reading_that_differs_from_the_gate_fails(cli, quantized, tmp_path):
    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    tampered = tmp_path / "fp8-tied"
    shutil.copytree(quantized("fp8", "--method", "fp8"), tampered)
    config = json.loads((tampered / "config.json").read_text())
    (tampered / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    code, data, stderr = serve_check(cli, tampered, tmp_path)
    assert code == 3, stderr
    assert not data["passed"] and "reading_kld" in data["failed"]


def test_vllm_cpu_refuses_nvfp4_before_starting(cli, quantized, tmp_path):
    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    from quantkit.serve.support import accelerator

    if accelerator().kind != "cpu":
        pytest.skip("the refusal is the CPU build's")
    code, data, stderr = serve_check(cli, quantized("nvfp4", "--method", "nvfp4"), tmp_path)
    assert code == 2 and data is None
    assert "NVFP4" in stderr and "this is a CPU" in stderr


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_K_M"])
def test_llama_server_serves_as_gated(cli, quantized, tmp_path, gguf_type):
    require(llama_server.find, "llama.cpp's llama-server", "QUANTKIT_LLAMA_CPP")
    artifact = quantized(gguf_type, "--method", "gguf", "--gguf-type", gguf_type)
    code, data, stderr = serve_check(cli, artifact, tmp_path, "--logprobs", "0")
    check_passed(code, data, stderr, artifact, "llama.cpp")
    assert data["ppl"]["ppl_exact"]  # the whole vocabulary asked for


def test_mlx_server_serves_as_gated(cli, quantized, tmp_path):
    require(mlx_server.find, "mlx-lm", "QUANTKIT_MLX_PYTHON")
    artifact = quantized("mlx4", "--method", "mlx", "--bits", "4")
    code, data, stderr = serve_check(cli, artifact, tmp_path)
    check_passed(code, data, stderr, artifact, "mlx")
    assert data["logprobs"] == 11 and not data["logprobs_normalized"]  # mlx_lm.server: at most 11, bfloat16


def test_the_gate_serves_the_staged_artifact_before_publishing(cli, trained, tmp_path):
    """quantize --serve-check vllm: the check runs on the staged artifact, its result is in quantkit.json and
    the gate, and the server is gone when the command ends."""
    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    out = tmp_path / "fp8-served"
    result = cli("quantize", trained, "--method", "fp8", "-o", out, "--num-samples", "16", "--seq-len", "64",
                 "--eval-windows", "2", "--serve-check", "vllm")
    assert result.exit_code == 0, result.stderr
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert entry["details"]["serve_check"]["passed"] and entry["details"]["serve_check"]["engine"]["name"] == "vllm"
    assert any(c["name"] == "serve" and c["passed"] for c in entry["gate"]["checks"])
    assert not live_processes_naming("vllm.entrypoints")
