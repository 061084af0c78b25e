"""The model-free MoE artifacts (fp8-block, nvfp4 a16, mxfp4 on synthetic DeepSeek-V3 and Qwen3-MoE checkpoints)
against the installed vLLM's own code (scripts/setup_engines.sh; skipped without it): tests/serve/vllm_moe_probe.py,
run by vLLM's interpreter, asks vLLM's CompressedTensorsConfig which scheme every linear layer and every fused-experts
layer resolves to, creates their parameters, and maps every stored tensor into them through vLLM's expert-parameter
mapping. vLLM's CPU build has none of these kernels, so this is a check of names, shapes and schemes, not a served
forward."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from quantkit.serve import engines, llama_server, mlx_server, vllm_server
from tests.serve.test_serve_check_slow import require
from tests.serve.test_w4a8_vllm_slow import free_port

pytestmark = pytest.mark.slow
PROBE = Path(__file__).with_name("vllm_moe_probe.py")
METHODS = {"fp8-block": ("CompressedTensorsW8A8Fp8", "CompressedTensorsW8A8Fp8MoEMethod"),
           "nvfp4-a16": ("CompressedTensorsW4A4Fp4", "CompressedTensorsW4A4Nvfp4MoEMethod"),
           "mxfp4": ("CompressedTensorsW4A4Mxfp4", "CompressedTensorsW4A4Mxfp4MoEMethod")}


def vllm_probe(artifacts: list[Path]) -> dict[str, dict]:
    vllm = require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    python = engines.script_python(vllm.executable) or vllm.executable.with_name("python3")
    result = subprocess.run([str(python), str(PROBE), *map(str, artifacts), str(free_port())], capture_output=True,
                            text=True, timeout=600, check=False)
    found = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(found) == len(artifacts), result.stderr[-3000:]
    return {Path(f["artifact"]).name: f for f in found}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """'<kind>-<scheme>' -> the artifact `quantkit quantize` wrote (no gate: vLLM is what is checked here)."""
    from typer.testing import CliRunner

    from quantkit.cli.app import app
    from quantkit.toy_moe import build_moe
    from tests.methods.test_model_free_moe import SCHEMES

    root, made = tmp_path_factory.mktemp("moe-vllm"), {}
    for kind in ("deepseek_v3", "qwen3_moe"):
        model = build_moe(kind, root / kind)
        for scheme, args in SCHEMES.items():
            out = root / f"{kind}-{scheme}"
            result = CliRunner().invoke(app, ["quantize", str(model), "-o", str(out), *args, "--eval-windows", "0"],
                                        catch_exceptions=False)
            assert result.exit_code == 0, result.output
            made[out.name] = out
    return made


def test_vllm_resolves_every_layer_and_takes_every_tensor(artifacts, tmp_path):
    broken = tmp_path / "qwen3_moe-router-quantized"  # a negative control: the routers left out of `ignore`
    shutil.copytree(artifacts["qwen3_moe-mxfp4"], broken)
    config = json.loads((broken / "config.json").read_text())
    q = config["quantization_config"]
    q["ignore"] = [name for name in q["ignore"] if not name.endswith("mlp.gate") and not name.startswith("re:")]
    (broken / "config.json").write_text(json.dumps(config))
    found = vllm_probe([*artifacts.values(), broken])
    for name in artifacts:
        kind, scheme = name.split("-", 1)
        result = found[name]
        assert result["problems"] == [], (name, result["problems"][:5])
        linear, moe = METHODS[scheme]
        assert set(result["moe_methods"].values()) == {moe}, name
        assert len(result["moe_methods"]) == (2 if kind == "deepseek_v3" else 3)  # DeepSeek-V3's layer 0 is dense
        schemes = result["schemes"]
        assert schemes["lm_head"] is None and schemes["model.embed_tokens"] is None
        assert schemes["model.layers.1.mlp.gate"] is None  # the router: unquantized (Qwen3-MoE's takes the config)
        attention = ("model.layers.1.self_attn.kv_b_proj" if kind == "deepseek_v3"
                     else "model.layers.1.self_attn.qkv_proj")
        assert schemes[attention] == linear
    problems = found[broken.name]["problems"]
    assert any(p.startswith("model.layers.0.mlp.gate.weight_packed: vLLM's") for p in problems), problems[:5]


# the loaded path's MoE artifacts: Granite 4's MoE variant through each compressed-tensors method, fp8-static on
# Qwen3-MoE (its experts' weights per tensor: vLLM's fused-MoE fp8 method takes static activation scales only so) and
# nvfp4 w4a4 on GLM-4.5 (a family nvfp4 a16 takes model-free)
LOADED = {"fp8": (["--method", "fp8"], "CompressedTensorsW8A8Fp8MoEMethod"),
          "fp8-static": (["--method", "fp8", "--scheme", "fp8-static"], "CompressedTensorsW8A8Fp8MoEMethod"),
          "gptq": (["--method", "gptq"], "CompressedTensorsWNA16MoEMethod"),
          "awq": (["--method", "awq"], "CompressedTensorsWNA16MoEMethod"),
          "nvfp4": (["--method", "nvfp4", "--scheme", "a16"], "CompressedTensorsW4A4Nvfp4MoEMethod"),
          "mxfp4": (["--method", "mxfp4"], "CompressedTensorsW4A4Mxfp4MoEMethod"),
          "nvfp4-w4a4": (["--method", "nvfp4"], "CompressedTensorsW4A4Nvfp4MoEMethod")}


def test_vllm_takes_every_tensor_of_the_loaded_path_s_moe_artifacts(tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli.app import app
    from tests.families import common
    from tests.families.test_granite import MOE, build
    from tests.families.test_moe import build as build_moe

    models = {"granite": build(tmp_path / "granite", **MOE), "qwen3_moe": build_moe(tmp_path / "qwen3", "qwen3_moe"),
              "glm4_moe": build_moe(tmp_path / "glm", "glm4_moe")}
    cases = [("granite", m) for m in LOADED if m != "nvfp4-w4a4"] + [("qwen3_moe", "fp8-static"),
                                                                     ("glm4_moe", "nvfp4-w4a4")]
    made = {}
    for kind, method in cases:
        out = tmp_path / f"{kind}-{method}"
        result = CliRunner().invoke(app, ["quantize", str(models[kind]), "-o", str(out), *LOADED[method][0],
                                          *common.CALIB, "--no-gate"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        made[out.name] = (kind, method)
    found = vllm_probe([tmp_path / name for name in made])
    for name, (kind, method) in made.items():
        result = found[name]
        assert result["problems"] == [], (name, result["problems"][:5])
        assert set(result["moe_methods"].values()) == {LOADED[method][1]}, (name, result["moe_methods"])
        router = "block_sparse_moe.router.layer" if kind == "granite" else "mlp.gate"  # GLM-4.5's layer 1: MoE
        assert result["schemes"][f"model.layers.1.{router}"] is None
