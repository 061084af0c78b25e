"""--method mlx end to end on the micro model: an mlx-lm directory that mlx_lm.load reads on the CPU with
the weights quantkit's gate measured, per-module overrides in config.json, refusals before work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.methods.conftest import CALIB_ARGS, LOOSE_TOP1, assert_nothing_written, report
from tests.methods.test_families import family_models  # noqa: F401  (the fixture)

RECIPE = """
targets:
  - name: mlx
    method: mlx
    options:
      bits: 3
      group_size: 32
      layer_bits: {"re:.*down_proj": 6, "model.layers.0.self_attn.q_proj": "16-bit"}
"""


@pytest.fixture(scope="module")
def artifact(micro_model, tmp_path_factory, cli) -> Path:
    root = tmp_path_factory.mktemp("mlx")
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    out = root / "out"
    result = cli("quantize", micro_model, "--recipe", recipe, *CALIB_ARGS, *LOOSE_TOP1, "--ignore", "lm_head",
                 "-o", out)
    assert result.exit_code == 0, result.output
    return out


def test_writes_an_mlx_lm_directory_with_per_module_entries(artifact):
    config = json.loads((artifact / "config.json").read_text())
    block = config["quantization"]
    assert block == config["quantization_config"]
    assert {k: block[k] for k in ("bits", "group_size", "mode")} == {"bits": 3, "group_size": 32, "mode": "affine"}
    assert block["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 6, "mode": "affine"}
    assert block["model.layers.0.self_attn.q_proj"] is False and block["lm_head"] is False
    assert "model.layers.0.self_attn.k_proj" not in block  # the top-level precision
    assert (artifact / "model.safetensors").is_file() and (artifact / "tokenizer.json").is_file()
    entry = report(artifact)["targets"][0]
    assert entry["details"]["mlx"]["modules"] == {"3-bit": 12, "6-bit": 2, "16-bit": 2}
    assert entry["metrics"]["kld_mean"] < 0.1
    card = (artifact / "README.md").read_text()
    assert "mlx_lm.generate --model ." in card and "library_name: mlx" in card


def test_rows_of_a_quantized_module_are_those_of_the_whole(artifact):
    """A gathered embedding's rows dequantized alone (their words, scales and biases): the rows of the whole."""
    import torch

    from quantkit.mlx.checkpoint import MLXWeights

    weights = MLXWeights(artifact)
    name = "model.embed_tokens.weight"
    assert name.removesuffix(".weight") in weights.quantized
    index = np.array([0, 3, 17, 400])
    assert torch.equal(weights.rows(name, index), weights.get(name)[torch.from_numpy(index)])


def test_mlx_lm_loads_the_weights_the_gate_read_and_generates(artifact):
    """Every quantized module mlx_lm builds dequantizes (mlx.core) to exactly quantkit's reading; its logits
    are those of quantkit's reading within bfloat16 arithmetic noise; it generates."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'quantkit[mlx]')")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    import torch
    from mlx import nn

    from quantkit.formats.gate import load_artifact
    from quantkit.mlx.checkpoint import MLXWeights

    mx.set_default_device(mx.cpu)
    model, tokenizer = mlx_lm.load(str(artifact))
    ours = MLXWeights(artifact)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert len(quantized) == 14 and quantized["model.layers.0.mlp.down_proj"].bits == 6
    for name, module in quantized.items():
        theirs = mx.dequantize(module.weight, module.scales, module.biases, group_size=module.group_size,
                               bits=module.bits)
        assert np.array_equal(np.array(theirs.astype(mx.float32)), ours.get(name + ".weight").float().numpy()), name

    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog while the model quantizes")
    theirs = np.array(model(mx.array(ids)[None]).astype(mx.float32))[0]
    with torch.no_grad():
        read = load_artifact(artifact)(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(theirs - read).mean() < 0.01 * np.abs(read).mean()  # bfloat16 arithmetic apart
    text = mlx_lm.generate(model, tokenizer, prompt="The quick", max_tokens=8)
    assert isinstance(text, str) and text


def test_unsupported_family_is_refused_before_work(cli, gpt2_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", gpt2_model, "--method", "mlx", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2
    assert "mlx: model_type 'gpt2'" in result.output
    assert_nothing_written(out)


def test_unknown_bits_are_refused(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "mlx", "--bits", "5", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "bits" in result.output


FAMILIES = ("llama31", "mistral", "qwen25", "qwen3", "gemma3", "phi3")


def float32_mlx_model(model):
    """The mlx-lm model in float32 with its quantized modules' weights as mlx dequantizes them (in their stored
    dtype, the values quantkit's reading holds; a stacked expert projection as a SwitchLinear): both forwards then
    run the same weights at float32, where bfloat16's rounding (mlx's and torch's differ by several percent on a
    random model) cannot hide a difference of structure."""
    import mlx.core as mx
    from mlx import nn
    from mlx.utils import tree_map, tree_unflatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    swaps = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            weight = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
            if isinstance(m, QuantizedSwitchLinear):
                plain = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0], bias="bias" in m)
            elif isinstance(m, nn.QuantizedEmbedding):
                plain = nn.Embedding(*weight.shape)
            else:
                plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            plain.weight = weight
            if "bias" in m:
                plain.bias = m.bias
            swaps.append((name, plain))
    model.update_modules(tree_unflatten(swaps))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    return model


def comparable_copy(family: str, source: Path, dest: Path) -> Path:
    """The family model as mlx-lm can run it. Gemma 3: its second layer attends globally (mlx-lm's Gemma 3 needs a
    global layer within its sliding pattern; quantkit refuses two sliding layers). Phi-3 as it is: its short RoPE
    factors differ from the long ones, which mlx-lm applies at every length, and quantkit's reading does so too."""
    import shutil

    if family != "gemma3":
        return source
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_loads_each_family(cli, family_models, tmp_path, family):  # noqa: F811
    """Tiny random models of every family mlx writes: mlx_lm.load builds the quantized modules with exactly
    quantkit's weights, and its logits follow quantkit's reading (RoPE bases, llama3 and longrope scaling as
    mlx-lm reads config.json, Gemma's scaled embedding, 1 + w norms and sliding layers, Phi-3's fused
    projections), compared at float32 on both sides with the same weights."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'quantkit[mlx]')")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    import torch
    from mlx import nn

    from quantkit.formats.gate import load_artifact
    from quantkit.mlx.checkpoint import MLXWeights

    source, out = comparable_copy(family, family_models(family), tmp_path / "source"), tmp_path / "out"
    result = cli("quantize", source, "--method", "mlx", "--bits", "3", "--num-samples", "4", "--seq-len", "64",
                 "--eval-windows", "2", "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    mx.set_default_device(mx.cpu)
    model, _tokenizer = mlx_lm.load(str(out))
    ours = MLXWeights(out)
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert len(modules) >= 8
    for name, m in modules:
        theirs = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        assert np.array_equal(np.array(theirs.astype(mx.float32)), ours.get(name + ".weight").float().numpy()), name
    ids = list(range(3, 40))  # beyond the Gemma 3 model's sliding window of 32
    theirs = np.array(float32_mlx_model(model)(mx.array(ids)[None]))[0]
    with torch.no_grad():
        read = load_artifact(out).float()(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - read).mean() < 1e-4 * np.abs(read).mean()  # float32 arithmetic apart (measured ~1e-6)


def test_config_json_says_what_mlx_lm_reads_at_the_top_level():
    """transformers 5 nests the RoPE base and scaling in rope_parameters (per attention type for Gemma 3) and
    derives Gemma 3's sliding pattern from layer_types; mlx-lm reads them at the top level (else RoPE base 10000,
    no llama3 scaling, a pattern of 6). The artifact's config.json states them; quantkit's own reading takes them
    out again, and a field the checkpoint has is never changed."""
    from quantkit.mlx.checkpoint import mlx_config, without_mlx_lm_fields

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    block = {"bits": 4, "group_size": 64}
    written = mlx_config({"model_type": "llama", "rope_parameters": llama3}, block)
    assert written["rope_theta"] == 500000.0 and written["rope_scaling"]["rope_type"] == "llama3"
    assert "rope_theta" not in written["rope_scaling"]
    gemma = {"model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
             "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    written = mlx_config(gemma, block)
    assert (written["rope_theta"], written["rope_local_base_freq"], written["sliding_window_pattern"]) == (1e6, 1e4, 6)
    assert "rope_scaling" not in written  # default RoPE: nothing to scale
    longrope = {"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                                          "short_factor": [1.0], "long_factor": [2.0]}}
    assert mlx_config(longrope, block)["rope_scaling"] == {"rope_type": "longrope", "type": "longrope",
                                                            "short_factor": [1.0], "long_factor": [2.0]}
    assert mlx_config({"rope_theta": 7.0, "rope_parameters": {"rope_theta": 9.0}}, block)["rope_theta"] == 7.0
    for config in (gemma, {"model_type": "llama", "rope_parameters": llama3}):
        written = {k: v for k, v in mlx_config(config, block).items() if not k.startswith("quantization")}
        assert without_mlx_lm_fields(written) == config


@pytest.mark.parametrize("resident", [False, True])
def test_each_experts_importances_are_the_inputs_routed_to_it(tmp_path, resident):
    """A mixture's stacked projections are weighted per expert by the mean squared inputs of the tokens the router
    sends that expert (llm-compressor's linear experts, hooked as any Linear): those quantkit's GGUF imatrix collects
    from transformers' fused experts by its own hook, streamed and resident alike (Mixtral: its block_sparse_moe
    renamed mlp by transformers, w1 / w3 / w2 stacked as gate / up / down)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval.scorers import Placement
    from quantkit.eval.windows import TokenWindows
    from quantkit.gguf import imatrix as im
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods import QuantizeJob
    from quantkit.methods.mlx import Options, column_importance
    from tests.families.test_moe import build

    model_dir = build(tmp_path / "mixtral", "mixtral")
    windows = torch.randint(4, 500, (3, 32), generator=torch.Generator().manual_seed(1))
    info = check_model_dir(model_dir)
    placement = {"placement": Placement(True, room=2**30)} if resident else {}
    job = QuantizeJob(info=info, options=Options(), windows=TokenWindows(windows, windows[:0], "unit", ""), ignore=[],
                      out_dir=tmp_path, workdir=tmp_path, **placement)
    imp = column_importance(job)
    direct = im.compute(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), windows,
                        info.config)
    for layer in (0, 1):
        for projection, tensor in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                   ("down_proj", "ffn_down_exps")):
            name = f"blk.{layer}.{tensor}.weight"
            expected = direct.sums[name] / np.maximum(direct.counts[name], 1)[:, None]
            ours = imp[f"model.layers.{layer}.block_sparse_moe.switch_mlp.{projection}"].numpy()
            assert ours.shape == (4, expected.shape[1])
            np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-9, err_msg=name)
        assert direct.counts[f"blk.{layer}.ffn_gate_exps.weight"].sum() == 3 * 32 * 2  # top-2 of every token
