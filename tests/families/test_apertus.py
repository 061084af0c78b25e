"""Apertus (ApertusForCausalLM) on a tiny random checkpoint (xIELU MLP with per-layer parameters, q/k norms, Llama
3.1 RoPE): every method, each artifact proven in its consumer.

Fast: fp8, gptq and gguf through the CLI. Slow: the other methods, GGUF against llama.cpp's converter (the xIELU
parameters as its metadata arrays) and llama-quantize, MLX against mlx-lm, vLLM serving.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.families import common

FAMILY = "apertus"


def build(out: Path, **config) -> Path:
    out = common.build(out, "ApertusConfig", "ApertusForCausalLM", **{"max_position_embeddings": 16384, **config})
    spread_xielu(out)
    return out


def spread_xielu(out: Path) -> None:
    """Each layer's xIELU parameters made different (a trained model's are), so a reading that mixed up the
    layers or ignored them would show."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    state = load_file(path)
    for name in sorted(state):
        if ".act_fn.alpha" in name:
            layer = int(name.split(".")[2])
            state[name] = state[name] + 0.25 * (layer + 1) * (1 if name.endswith("alpha_p") else -1)
    save_file(state, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


COMPRESSED, FAST = common.COMPRESSED, common.FAST


@pytest.mark.parametrize("method", common.method_params(COMPRESSED, FAST))
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    common.assert_reloads_strictly(cli, model, tmp_path, method, *COMPRESSED[method])


def test_gguf_writes_xielu_as_metadata_and_reads_it_back(cli, model, tmp_path):
    import gguf
    from safetensors.torch import load_file

    from quantkit.gguf.loader import GGUFTensors

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
    path = next(out.glob("*.gguf"))
    reader, source = gguf.GGUFReader(str(path)), load_file(model / "model.safetensors")
    assert not [t.name for t in reader.tensors if "act_fn" in t.name or "xielu" in t.name]
    config = __import__("json").loads((model / "config.json").read_text())
    read = GGUFTensors(path, config)
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        stored = [source[f"model.layers.{i}.mlp.act_fn.{name}"].float() for i in range(2)]
        assert reader.fields[f"xielu.{name}"].contents() == pytest.approx([float(s.reshape(-1)[0]) for s in stored])
        for i in range(2):
            assert np.array_equal(read.get(f"model.layers.{i}.mlp.act_fn.{name}").numpy(), stored[i].numpy())


def test_awq_has_no_up_to_down_row_through_xielu():
    from quantkit.arch.families import by_model_type

    rows = by_model_type(FAMILY).smoothing
    assert not [r for r in rows if r.smooth == "re:.*up_proj$"]
    assert [r.balance for r in rows if r.smooth == "re:.*feedforward_layernorm$"] == [("re:.*up_proj$",)]


@pytest.mark.slow
def test_gguf_equals_llama_cpp(model, tmp_path):
    common.assert_gguf_is_llama_cpp_s(model, tmp_path)


@pytest.mark.slow
def test_mlx_lm_reads_it_as_quantkit(cli, model, tmp_path):
    common.assert_mlx_lm_reads_it(cli, model, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_vllm_serves_it_as_the_gate_read_it(cli, model, tmp_path, method):
    common.assert_vllm_serves_it(cli, model, tmp_path, method)
