"""Finding the engines, choosing one per artifact, refusing what this device cannot serve (exit 2)."""

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from quantkit.errors import InputError, UnsupportedError
from quantkit.eval import llamacpp
from quantkit.serve import engines, mlx_server, support, vllm_server
from quantkit.serve.support import Accelerator

CPU = Accelerator("cpu", "test CPU")
GPU = Accelerator("cuda", "test GPU", 9.0)


@pytest.fixture
def no_engines(tmp_path, monkeypatch):
    """Nothing installed: an empty engines dir, no engine variables, a PATH without engines."""
    empty = tmp_path / "engines"
    empty.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("QUANTKIT_ENGINES", str(empty))
    monkeypatch.setenv("PATH", str(bin_dir))
    for name in ("QUANTKIT_VLLM", "QUANTKIT_LLAMA_CPP", "QUANTKIT_MLX_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mlx_server, "imports_mlx_lm", lambda: False)
    monkeypatch.setattr(llamacpp, "find_binary", lambda name="llama-perplexity": None)
    return empty


def executable(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def compressed_dir(path: Path, groups: dict, kv: dict | None = None) -> Path:
    """A directory that reads as a compressed-tensors checkpoint (config.json and a safetensors header)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups,
                                      "kv_cache_scheme": kv}}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": np.zeros((2, 2), np.float32)}, str(path / "model.safetensors"))
    return path


def group(bits, kind, acts=None, strategy="channel", fmt="float-quantized", group_size=None):
    return {"format": fmt, "weights": {"num_bits": bits, "type": kind, "strategy": strategy, "group_size": group_size},
            "input_activations": acts}


FP8_DYNAMIC = group(8, "float", {"num_bits": 8, "type": "float", "dynamic": True})
FP8_STATIC = group(8, "float", {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"})
W4A16 = group(4, "int", fmt="pack-quantized", strategy="group", group_size=128)
W8A16 = group(8, "int", fmt="pack-quantized", strategy="group", group_size=128)
W8A8 = group(8, "int", {"num_bits": 8, "type": "int", "dynamic": True}, fmt="int-quantized")
NVFP4 = group(4, "float", {"num_bits": 4, "type": "float"}, strategy="tensor_group", fmt="nvfp4-pack-quantized",
              group_size=16)
NVFP4_A16 = group(4, "float", None, strategy="tensor_group", fmt="nvfp4-pack-quantized", group_size=16)
MXFP4 = group(4, "float", None, strategy="group", fmt="mxfp4-pack-quantized", group_size=32)
FP8_BLOCK = group(8, "float", {"num_bits": 8, "type": "float", "dynamic": True, "strategy": "group"}, strategy="block")


def test_vllm_found_by_variable_then_engines_dir_then_path(no_engines, tmp_path, monkeypatch):
    assert vllm_server.find() is None
    on_path = executable(tmp_path / "bin" / "vllm")
    assert vllm_server.find().executable == on_path
    installed = executable(no_engines / "vllm" / "bin" / "vllm")
    assert vllm_server.find().executable == installed and vllm_server.find().found_in == "QUANTKIT_ENGINES"
    chosen = executable(tmp_path / "custom" / "vllm")
    monkeypatch.setenv("QUANTKIT_VLLM", str(chosen))
    assert vllm_server.find().executable == chosen


def test_mlx_found_by_variable_then_engines_dir_then_this_python(no_engines, tmp_path, monkeypatch):
    assert mlx_server.find() is None
    monkeypatch.setattr(mlx_server, "imports_mlx_lm", lambda: True)
    assert mlx_server.find().executable == Path(sys.executable)
    installed = executable(no_engines / "mlx" / "bin" / "python")
    assert mlx_server.find().executable == installed
    chosen = executable(tmp_path / "py" / "python3")
    monkeypatch.setenv("QUANTKIT_MLX_PYTHON", str(chosen))
    assert mlx_server.find().executable == chosen


def test_llama_cpp_binaries_found_in_the_engines_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANTKIT_LLAMA_CPP", raising=False)
    monkeypatch.setenv("QUANTKIT_ENGINES", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    server = executable(tmp_path / "llama.cpp" / "bin" / "llama-server")
    repo_build = Path(llamacpp.__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "bin" / "llama-server"
    if not repo_build.exists():
        assert llamacpp.find_binary("llama-server") == server
    chosen = executable(tmp_path / "mine" / "llama-server")
    monkeypatch.setenv("QUANTKIT_LLAMA_CPP", str(chosen.parent))
    assert llamacpp.find_binary("llama-server") == chosen


def test_missing_engine_names_the_setup_script(no_engines):
    with pytest.raises(UnsupportedError, match="vllm is not installed") as info:
        engines.find_engine("vllm")
    assert info.value.exit_code == 2
    assert "scripts/setup_engines.sh" in info.value.hint and "QUANTKIT_VLLM" in info.value.hint
    with pytest.raises(InputError, match="unknown engine"):
        engines.find_engine("tgi")


def test_engine_by_kind():
    assert engines.engine_for("compressed-tensors") == "vllm"
    assert engines.engine_for("gguf") == "llama.cpp"
    assert engines.engine_for("mlx") == "mlx"
    assert engines.engine_for("bitsandbytes") == "vllm"


def test_script_python_reads_the_shebang(tmp_path):
    python = executable(tmp_path / "venv" / "bin" / "python3")
    script = executable(tmp_path / "venv" / "bin" / "vllm", f"#!{python}\nimport sys\n")
    assert engines.script_python(script) == python
    assert engines.script_python(executable(tmp_path / "tool", "#!/bin/sh\n")) is None


@pytest.mark.parametrize("groups, scheme", [
    (FP8_DYNAMIC, "fp8-dynamic"), (FP8_STATIC, "fp8-static"), (W4A16, "w4a16"), (W8A16, "w8a16"),
    (W8A8, "w8a8-int8"), (NVFP4, "nvfp4"), (NVFP4_A16, "nvfp4-a16"), (MXFP4, "mxfp4"), (FP8_BLOCK, "fp8-block"),
])
def test_schemes_from_config(groups, scheme):
    from quantkit.formats import compressed_tensors

    assert compressed_tensors.schemes({"config_groups": {"group_0": groups}}) == {scheme}


@pytest.mark.parametrize("groups, served", [
    (FP8_DYNAMIC, True), (W4A16, True), (W8A8, True), (FP8_STATIC, False), (W8A16, False), (NVFP4, False),
    (NVFP4_A16, False), (MXFP4, False), (FP8_BLOCK, False),
])
def test_vllm_cpu_refuses_what_it_cannot_run(tmp_path, groups, served):
    artifact = compressed_dir(tmp_path / "artifact", {"group_0": groups})
    reason = support.refusal("vllm", artifact, "compressed-tensors", CPU)
    assert (reason is None) == served, reason
    assert support.refusal("vllm", artifact, "compressed-tensors", GPU) is None


def test_vllm_cpu_refuses_int_weights_of_an_output_size_its_kernel_does_not_take(tmp_path):
    """vLLM CPU 0.32's CPUWNA16 takes output sizes that are multiples of 32 (a tiny Granite 4 hybrid's Mamba in_proj
    has 1160 rows: the server exits while loading): refused before the engine starts, naming the layer; on a GPU
    it is not, and a layer of 1152 rows is served."""
    from safetensors.numpy import save_file

    for rows, refused in ((1160, True), (1152, False)):
        artifact = compressed_dir(tmp_path / str(rows), {"group_0": W4A16})
        save_file({"model.layers.0.mamba.in_proj.weight_packed": np.zeros((rows, 32), np.int32)},
                  str(artifact / "model.safetensors"))
        reason = support.refusal("vllm", artifact, "compressed-tensors", CPU)
        assert (reason is not None) == refused, reason
        if refused:
            assert "model.layers.0.mamba.in_proj has 1160 rows" in reason and "multiple of 32" in reason
            with pytest.raises(UnsupportedError, match="CPUWNA16") as info:
                support.check_servable("vllm", artifact, "compressed-tensors", CPU)
            assert info.value.exit_code == 2
        assert support.refusal("vllm", artifact, "compressed-tensors", GPU) is None


@pytest.mark.parametrize("groups, stored", [(FP8_DYNAMIC, "weight_scale"), (W4A16, "weight_packed"),
                                           (W8A8, "weight_scale")])
def test_vllm_cpu_refuses_quantized_experts_whatever_the_scheme(tmp_path, groups, stored):
    """vLLM CPU 0.32 has no fused-MoE kernel for quantized experts (fp8, W4A16 and W8A8 all fail while loading, on a
    tiny Qwen3-MoE): an artifact storing a quantized expert is refused before the engine starts, naming it; the same
    scheme without quantized experts (experts kept 16-bit) is not; on a GPU neither is."""
    from safetensors.numpy import save_file

    artifact = compressed_dir(tmp_path / "moe", {"group_0": groups})
    expert = "model.layers.0.mlp.experts.3.up_proj"
    save_file({f"{expert}.{stored}": np.zeros((2, 1), np.float32), "lm_head.weight": np.zeros((2, 2), np.float32)},
              str(artifact / "model.safetensors"))
    reason = support.refusal("vllm", artifact, "compressed-tensors", CPU)
    assert "no fused-MoE kernel for quantized experts" in reason and expert in reason
    assert support.refusal("vllm", artifact, "compressed-tensors", GPU) is None
    save_file({f"{expert}.weight": np.zeros((2, 2), np.float32), "lm_head.weight": np.zeros((2, 2), np.float32)},
              str(artifact / "model.safetensors"))
    assert support.refusal("vllm", artifact, "compressed-tensors", CPU) is None


def test_nvfp4_reason_names_the_device(tmp_path):
    artifact = compressed_dir(tmp_path / "artifact", {"group_0": NVFP4})
    with pytest.raises(UnsupportedError, match="NVFP4 W4A4 on Blackwell GPUs .*this is a CPU") as info:
        support.check_servable("vllm", artifact, "compressed-tensors", CPU)
    assert info.value.exit_code == 2


def test_amx_lifts_the_fp8_refusals(tmp_path):
    amx = Accelerator("cpu", "AMX CPU", flags=frozenset({"amx_tile"}))
    for groups in (FP8_STATIC, FP8_BLOCK):
        artifact = compressed_dir(tmp_path / str(id(groups)), {"group_0": groups})
        assert support.refusal("vllm", artifact, "compressed-tensors", amx) is None


AVX2 = Accelerator("cpu", "AVX2 CPU", flags=frozenset({"sse2", "avx", "avx2", "fma"}))
AVX512 = Accelerator("cpu", "AVX-512 CPU", flags=frozenset({"sse2", "avx", "avx2", "fma", "avx512f", "avx512bw"}))


def test_int4_weights_need_avx512_on_an_x86_cpu(tmp_path):
    """vLLM CPU 0.32's AVX2 build has no cpu_gemm_wna16: refused before the engine starts, naming the feature."""
    artifact = compressed_dir(tmp_path / "w4a16", {"group_0": W4A16})
    reason = support.refusal("vllm", artifact, "compressed-tensors", AVX2)
    assert reason.startswith("vLLM's CPU kernel for w4a16") and "needs avx512f, which this CPU lacks" in reason
    assert "cpu_gemm_wna16" in reason
    assert support.refusal("vllm", artifact, "compressed-tensors", AVX512) is None
    for groups in (FP8_DYNAMIC, W8A8):  # their CPU kernels are not refused for it
        other = compressed_dir(tmp_path / str(id(groups)), {"group_0": groups})
        assert support.refusal("vllm", other, "compressed-tensors", AVX2) is None


def with_transforms(artifact: Path, groups: dict) -> Path:
    config = json.loads((artifact / "config.json").read_text())
    config["quantization_config"]["transform_config"] = {"config_groups": groups}
    (artifact / "config.json").write_text(json.dumps(config))
    return artifact


def test_an_online_rotation_is_refused_on_a_cpu_and_a_folded_one_is_not(tmp_path):
    hadamard = with_transforms(compressed_dir(tmp_path / "hadamard", {"group_0": W4A16}), {  # QuIP, as written
        "u": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "input"},
                                             {"targets": ["Linear"], "location": "weight_input", "inverse": True}]}})
    reason = support.refusal("vllm", hadamard, "compressed-tensors", AVX512)
    assert "online Hadamard rotation" in reason and "transform groups u" in reason and "cpu_linear" in reason
    assert support.refusal("vllm", hadamard, "compressed-tensors", GPU) is None
    spinquant = with_transforms(compressed_dir(tmp_path / "spinquant", {"group_0": FP8_DYNAMIC}), {
        "R1": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "weight_output"},
                                              {"targets": ["Linear"], "location": "weight_input", "inverse": True}]}})
    assert support.refusal("vllm", spinquant, "compressed-tensors", AVX512) is None


def test_the_serving_plan_names_the_cpu_feature_it_lacks():
    from quantkit.formats import compressed_tensors
    from quantkit.run.serving import Device, fit

    w4a16 = compressed_tensors.runtimes("w4a16")
    avx2 = fit(10**8, 1000, 100, w4a16, Device("cpu", 10**10, "cpu", flags=AVX2.flags))
    assert avx2.verdict == "no runtime" and avx2.lacks == ("avx512f",)
    assert fit(10**8, 1000, 100, w4a16, Device("cpu", 10**10, "cpu", flags=AVX512.flags)).runtime.startswith("vLLM CPU")
    unknown = fit(10**8, 1000, 100, w4a16, Device("cpu-64G", 64 * 10**9, "cpu"))  # a CPU named, not this one
    assert unknown.runtime is not None and unknown.lacks == ()


def test_bitsandbytes_needs_a_gpu(tmp_path):
    assert "GPUs only" in support.refusal("vllm", tmp_path, "bitsandbytes", CPU)
    assert support.refusal("vllm", tmp_path, "bitsandbytes", GPU) is None


def test_each_engine_serves_its_kinds(tmp_path):
    assert "llama-server serves gguf artifacts; this artifact is compressed-tensors" in support.refusal(
        "llama.cpp", tmp_path, "compressed-tensors", CPU)
    assert "serves mlx, transformers artifacts; this artifact is gguf" in support.refusal("mlx", tmp_path, "gguf", CPU)
    assert "vLLM serves compressed-tensors, bitsandbytes, transformers artifacts; this artifact is gguf" in \
        support.refusal("vllm", tmp_path, "gguf", CPU)
    assert support.refusal("llama.cpp", tmp_path, "gguf", CPU) is None
    assert support.refusal("mlx", tmp_path, "mlx", CPU) is None


def test_cli_exits_2_when_the_engine_is_missing(no_engines, tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    artifact = compressed_dir(tmp_path / "artifact", {"group_0": FP8_DYNAMIC})
    result = CliRunner().invoke(app, ["serve-check", str(artifact)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "vllm is not installed" in result.stderr and "scripts/setup_engines.sh" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_exits_2_when_this_device_cannot_serve_the_format(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    monkeypatch.setenv("QUANTKIT_VLLM", str(executable(tmp_path / "bin" / "vllm")))
    monkeypatch.setattr(support, "accelerator", lambda: CPU)
    artifact = compressed_dir(tmp_path / "artifact", {"group_0": NVFP4})
    result = CliRunner().invoke(app, ["serve-check", str(artifact)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "this is a CPU" in result.stderr and "hint:" in result.stderr


def test_engine_environment_is_offline_and_drops_python_settings(monkeypatch):
    from quantkit.serve.settings import engine_env

    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the engine stays offline whatever the user's environment says
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # an engine setting: the user's value wins
    env = engine_env({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"})
    assert "PYTHONPATH" not in env and env["TRANSFORMERS_OFFLINE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["OMP_NUM_THREADS"] == "2"
    assert env["PATH"] == os.environ["PATH"]
