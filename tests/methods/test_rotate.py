"""--rotate (recipe option `rotate`): llm-compressor's transform modifiers before quantizing, the gate reading
the rotated artifact as its loader computes it, and the methods that cannot rotate refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.methods.conftest import CALIB_ARGS, LOOSE_TOP1, assert_nothing_written, quant_config, report, untrained_llama

NOT_ROTATING = ("gguf", "mlx", "nf4", "awq")


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("method", NOT_ROTATING)
def test_rotate_refused_before_any_work(cli, micro_model, tmp_path, method):
    from quantkit.methods import get_method

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", method, "--rotate", "hadamard", "-o", out)
    assert result.exit_code == 2, result.output
    said = one_line(result.output)
    assert "--rotate" in said and f"method {method} cannot rotate" in said
    assert one_line(get_method(method).rotation_refused) in said  # why, in the method's own words
    assert "use a method that rotates: fp8, gptq, autoround, smoothquant, nvfp4 and mxfp4" in said  # what to do
    assert_nothing_written(out)


def test_recipe_rotate_refused(cli, micro_model, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("targets:\n  - name: q4\n    method: gguf\n    options: {rotate: spinquant}\n")
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", out)
    assert result.exit_code == 2, result.output
    assert "method gguf cannot rotate" in one_line(result.output)
    assert_nothing_written(out)


def test_rotate_none_is_no_refusal():
    from quantkit.run.recipe import validate

    recipe = validate({"model": "m", "targets": [{"name": "g", "method": "gguf", "options": {}},
                                                 {"name": "n", "method": "nvfp4", "options": {"rotate": "none"}}]})
    assert [t.options for t in recipe.targets] == [{}, {"rotate": "none"}]


def test_rotation_without_a_hadamard_matrix_refused(cli, micro_model, tmp_path):
    """down_proj's input width 50 is no power of two times a Hadamard order compressed-tensors knows."""
    model = untrained_llama(micro_model, tmp_path / "m", hidden_size=64, intermediate_size=50, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    out = tmp_path / "out"
    result = cli("quantize", model, "--method", "fp8", "--rotate", "hadamard", "-o", out)
    assert result.exit_code == 2, result.output
    assert "fp8: --rotate hadamard: compressed-tensors has no random Hadamard matrix of size 50" in one_line(result.output)
    assert_nothing_written(out)


def test_smoothquant_hadamard_refused(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "smoothquant", "--rotate", "hadamard", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    said = one_line(result.output)
    assert "smoothquant: --rotate hadamard is refused" in said and "--rotate spinquant" in said
    assert_nothing_written(out)


def test_unknown_rotation_is_a_recipe_error(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "gptq", "--rotate", "givens", "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "rotate" in result.output


def logits(model, ids):
    import torch

    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture
def quip_artifact(micro_model, tmp_path):
    """Bare llm-compressor: QuIP's online Hadamard rotation, then W4A16 round-to-nearest, on an untrained Llama
    (widths that are powers of two); (artifact, token ids, the logits of the model llm-compressor left in memory:
    transforms hooked, weights fake-quantized)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import QuIPModifier
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = untrained_llama(micro_model, tmp_path / "base", hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=64, initializer_range=0.2)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    recipe = [QuIPModifier(rotations=["v"], transform_type="random-hadamard", ignore=["lm_head"]),
              QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])]
    oneshot(model=model, recipe=recipe)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    in_memory = logits(model, ids)
    out = tmp_path / "quip"
    model.save_pretrained(out, save_compressed=True)
    return out, ids, in_memory


def test_gate_applies_online_rotation_as_loaded(quip_artifact):
    """transformers 5 drops the transform config (its CompressedTensorsConfig carries none) and would leave the
    stored transform matrices unread; the gate's reading applies the online rotation with compressed-tensors'
    apply_transform_config and the stored matrices, and computes the model llm-compressor left in memory."""
    from transformers import AutoModelForCausalLM

    from quantkit.eval.artifacts import online_transforms
    from quantkit.formats.gate import load_artifact

    out, ids, in_memory = quip_artifact
    config = json.loads((out / "config.json").read_text())
    online = online_transforms(config)
    assert [a.location for s in online.config_groups.values() for a in s.apply] == ["input"]  # weight parts dropped
    gate = logits(load_artifact(out), ids)
    assert (gate - in_memory).abs().max().item() < 1e-4 * in_memory.abs().max().item()
    plain, loading = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert any(k.endswith("v_input.weight") for k in loading["unexpected_keys"])  # the stored rotation, unread
    assert (logits(plain, ids) - in_memory).abs().max().item() > 0.05 * in_memory.abs().max().item()


@pytest.mark.slow
def test_gptq_hadamard_end_to_end(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", "--rotate", "hadamard", *CALIB_ARGS, *LOOSE_TOP1,
                 "-o", out)
    assert result.exit_code == 0, result.output
    groups = quant_config(out)["transform_config"]["config_groups"]
    assert list(groups) == ["v"] and groups["v"]["type"] == "random-hadamard"
    assert {(a["location"], tuple(a["ignore"])) for a in groups["v"]["apply"]} >= {("input", ("lm_head",))}
    entry = report(out)["targets"][0]
    assert report(out)["recipe"]["targets"][0]["options"]["rotate"] == "hadamard"
    assert 0 <= entry["metrics"]["kld_mean"] < 0.1


def held_out_logprobs(model, out: Path, ids=None):
    """Log-probs of a checkpoint read by plain transformers `from_pretrained` (compressed-tensors decompresses
    an artifact) on the gate's held-out windows of the run that wrote `out` (its recipe's calibration)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    if ids is None:
        spec = Calibration(**report(out)["recipe"]["calibration"])
        ids = make_windows(AutoTokenizer.from_pretrained(model), spec).eval
    return logits(AutoModelForCausalLM.from_pretrained(model, dtype="auto"), ids).log_softmax(-1), ids


def test_spinquant_artifact_reloads_as_the_base_rotated(cli, micro_model, tmp_path):
    """fp8 with SpinQuant on the 2-layer micro model, gated: the artifact reloads through transformers and
    compressed-tensors as the gate reads it, and what was folded in is checked from the weights: the stored
    embeddings are the base's, each centred (its mean over the hidden width subtracted), times a Hadamard matrix
    (+-1/sqrt(hidden), exactly orthogonal; recovered here by least squares and rounded to its signs), and the
    head is the base's with the final norm folded in times the same matrix. The KL divergence of the reloaded
    artifact from the base, computed here, is small (a rotation preserves the function; the centring and fp8's
    rounding are what is left) and is the gate's own number."""
    import torch
    from safetensors.torch import load_file

    from quantkit.eval.artifacts import online_transforms
    from quantkit.formats.gate import load_artifact

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "--rotate", "spinquant", "--num-samples", "0",
                 "--seq-len", "32", "--eval-windows", "2", *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert set(config["quantization_config"]["transform_config"]["config_groups"]) == {"R1", "R2"}
    assert online_transforms(config) is None

    base, stored = load_file(micro_model / "model.safetensors"), load_file(out / "model.safetensors")
    embed, rotated = base["model.embed_tokens.weight"].double(), stored["model.embed_tokens.weight"].double()
    hidden = embed.shape[1]
    hadamard = torch.linalg.lstsq(embed, rotated).solution.sign() * hidden ** -0.5
    assert torch.equal(hadamard.T @ hadamard, torch.eye(hidden, dtype=torch.float64))
    centred = embed - embed.mean(-1, keepdim=True)
    # within bfloat16's rounding, of the result and of the centred table llm-compressor rounds before rotating
    # (here at most 0.0004 where the entries reach 0.11; 0.015 without the centring)
    assert (centred @ hadamard - rotated).abs().max() < 0.01 * rotated.abs().max()
    head = base["lm_head.weight"].double() * base["model.norm.weight"].double()
    assert (head @ hadamard - stored["lm_head.weight"]).abs().max() < 0.01 * stored["lm_head.weight"].abs().max()

    artifact, ids = held_out_logprobs(out, out)
    base_logprobs, _ = held_out_logprobs(micro_model, out, ids)
    kld = (base_logprobs.exp() * (base_logprobs - artifact)).sum(-1)[:, :-1].mean().item()
    gate = report(out)["targets"][0]["metrics"]
    assert gate["positions"] == ids.numel() - ids.shape[0]
    assert 0 < kld < 0.01 and kld == pytest.approx(gate["kld_mean"], rel=0.2)
    assert torch.allclose(logits(load_artifact(out), ids).log_softmax(-1), artifact, atol=1e-4)


@pytest.mark.slow
def test_spinquant_reads_alike_in_transformers(cli, micro_model, tmp_path):
    """SpinQuant R1+R2 are folded into the weights: nothing online, so transformers' plain reading is the loader's,
    and the gate's reading equals it."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval.artifacts import online_transforms
    from quantkit.formats.gate import load_artifact

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "nvfp4", "--scheme", "a16", "--rotate", "spinquant",
                 *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert set(config["quantization_config"]["transform_config"]["config_groups"]) == {"R1", "R2"}
    assert online_transforms(config) is None
    ids = torch.randint(0, config["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    plain = logits(AutoModelForCausalLM.from_pretrained(out), ids)
    assert torch.allclose(logits(load_artifact(out), ids), plain, atol=1e-5)


@pytest.mark.slow
def test_spinquant_unties_offloaded_tied_embeddings(cli, micro_model, tmp_path):
    """A CPU run keeps the vocabulary tables on disk; SpinQuant unties tied ones, so the model is loaded again with
    them in memory, and the artifact stores its own rotated head (config untied)."""
    model = untrained_llama(micro_model, tmp_path / "tied", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    out = tmp_path / "out"
    result = cli("quantize", model, "--method", "fp8", "--rotate", "spinquant", "--eval-windows", 2, "--no-gate",
                 "-o", out)
    assert result.exit_code == 0, result.output
    assert "loading the model again with its vocabulary tables in memory" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    from quantkit.io.checkpoint import SafetensorsWeights

    assert "lm_head.weight" in SafetensorsWeights(out).index
