"""Shared fixtures for the method tests: toy models built once per session, and helpers to check an artifact the way a user would load it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Small calibration: 16 x 64 = 1024 tokens, the minimum the calibrated methods accept.
CALIB_ARGS = ["--num-samples", "16", "--seq-len", "64", "--eval-windows", "4"]
# The shared micro fixture (tests/conftest.py) is barely trained (near-flat logits), so top-1
# agreement means little there; the perplexity and KL parts of each method's default gate still apply.
LOOSE_TOP1 = ["--min-top1", "0"]


@pytest.fixture(scope="session")
def gpt2_model(tmp_path_factory, micro_model) -> Path:
    """A tiny GPT-2: an architecture with no AWQ/SmoothQuant mappings."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(micro_model)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=128, n_layer=1, n_head=2, n_positions=256)
    out = tmp_path_factory.mktemp("models") / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def assert_nothing_written(out: Path) -> None:
    """No output and no staging directory left beside it."""
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.staging")]


def quant_config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def report(out: Path) -> dict:
    return json.loads((out / "quantkit.json").read_text())


def assert_metrics(out: Path) -> dict:
    entry = report(out)["targets"][0]
    metrics = entry["metrics"]
    for key in ("ppl_base", "ppl", "ppl_increase", "kld_mean", "top1"):
        assert isinstance(metrics[key], float), key
    return entry


def mean_kld_vs_base(artifact: Path, base: Path, windows: int = 4) -> float:
    """Mean KL(base || artifact) of next-token distributions on bundled-text windows, both
    models reloaded with a plain transformers `from_pretrained` on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    spec = Calibration(num_samples=1, seq_len=64, eval_windows=windows, seed=123)
    ids = make_windows(AutoTokenizer.from_pretrained(base), spec).eval
    with torch.no_grad():
        logp = [AutoModelForCausalLM.from_pretrained(p, device_map="cpu")(ids).logits.float().log_softmax(-1)
                for p in (base, artifact)]
    return float((logp[0].exp() * (logp[0] - logp[1])).sum(-1).mean())


def rtn_artifact(model: Path, scheme: str, out: Path) -> Path:
    """Round-to-nearest of an llm-compressor preset scheme (the baseline GPTQ/AWQ must beat)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype="auto")
    oneshot(model=loaded, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    loaded.save_pretrained(out, save_compressed=True)
    return out


@pytest.fixture(scope="session")
def reference_model(tmp_path_factory) -> Path:
    """The trained reference model with outlier channels (slow tests): $QUANTKIT_REFERENCE_MODEL
    if set (a directory written by scripts/train_reference_model.py), else trained here by that
    script (several minutes)."""
    import os
    import subprocess
    import sys

    prebuilt = os.environ.get("QUANTKIT_REFERENCE_MODEL")
    if prebuilt:
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("models") / "reference"
    script = Path(__file__).resolve().parents[2] / "scripts" / "train_reference_model.py"
    subprocess.run([sys.executable, str(script), str(out)], check=True)
    return out


def assert_beats_rtn(cli, model: Path, tmp_path: Path, method: str, rtn_scheme: str) -> None:
    """On a trained model the calibrated method passes its default gate and beats plain rounding
    of the same format (llm-compressor preset `rtn_scheme`) on KL divergence."""
    out = tmp_path / method
    result = cli("quantize", model, "--method", method, "--num-samples", 32, "--seq-len", 128,
                     "--eval-windows", 8, "-o", out)
    assert result.exit_code == 0, result.output  # the default gate holds
    rtn = rtn_artifact(model, rtn_scheme, tmp_path / "rtn")
    assert mean_kld_vs_base(out, model) < mean_kld_vs_base(rtn, model)


def untrained_llama(tokenizer_from: Path, out: Path, **config) -> Path:
    """An untrained Llama of `config` (float32, as transformers builds it) with a trained model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **config)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def width_72_model(micro_model, tmp_path):
    """An untrained Llama whose hidden width 72 the group of 16 does not divide."""
    return untrained_llama(micro_model, tmp_path / "w72", hidden_size=72, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=36)


def preset_artifact(model: Path, scheme: str, out: Path, kv_cache_scheme: dict | None = None,
                    windows: int = 0) -> Path:
    """Bare llm-compressor: one QuantizationModifier with a preset scheme (and a KV-cache scheme) over every
    Linear but lm_head, saved compressed: what quantkit's output for the same recipe is compared with.
    `windows` > 0 calibrates on that many random 64-token windows (activation and KV scales)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype="auto")
    data = {}
    if windows:
        from datasets import Dataset

        ids = torch.randint(0, 500, (windows, 64), generator=torch.Generator().manual_seed(0))
        data = {"dataset": Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 64] * windows}),
                "num_calibration_samples": windows, "max_seq_length": 64, "pipeline": "sequential"}
    oneshot(model=loaded, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"],
                                                      kv_cache_scheme=kv_cache_scheme), **data)
    loaded.save_pretrained(out, save_compressed=True)
    return out


def stored_tensors(out: Path) -> dict[str, tuple[str, list[int]]]:
    """Every stored tensor's name -> (safetensors dtype, shape), over all shards."""
    from safetensors import safe_open

    found = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                found[key] = (f.get_slice(key).get_dtype(), list(f.get_slice(key).get_shape()))
    return found


def assert_same_as_llmcompressor(ours: Path, bare: Path, equal_values: tuple[str, ...] = ()) -> None:
    """quantkit's artifact against bare llm-compressor's for the same recipe: quantization_config key for key
    (the ignore list may hold more: quantkit adds module names and patterns for transformers), the same
    tensors with the same dtypes and shapes, and those whose names end with `equal_values` bit for bit."""
    from safetensors.torch import load_file

    mine, theirs = quant_config(ours), quant_config(bare)
    assert set(theirs["ignore"]) <= set(mine["ignore"])
    assert {k: v for k, v in mine.items() if k != "ignore"} == {k: v for k, v in theirs.items() if k != "ignore"}
    assert stored_tensors(ours) == stored_tensors(bare)
    a, b = load_file(next(ours.glob("*.safetensors"))), load_file(next(bare.glob("*.safetensors")))
    for key in [k for k in b if k.endswith(equal_values)]:
        assert a[key].view(-1).view(torch_uint8()).equal(b[key].view(-1).view(torch_uint8())), key


def torch_uint8():
    import torch

    return torch.uint8


@pytest.fixture
def narrow_kv_model(micro_model, tmp_path):
    """An untrained Llama whose k and v projections are 64 wide (one KV head of 64): fp8-block's 128-row
    blocks do not tile them; every other width is a multiple of 128."""
    return untrained_llama(micro_model, tmp_path / "kv64", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64)


def probe_window_bound(model, sensitivity: dict, limit: int, windows: int) -> int:
    """The windows a sensitivity pass's probes may use: `limit` at most, and no more than one pass of its
    `windows` through the model pays for (each probe forwards from its layer through the head)."""
    from quantkit.mixed.sensitivity import layer_count, role_and_depth

    layers = layer_count(model)
    starts = [role_and_depth(r["tensor"])[1] or 0 for r in sensitivity["tensors"] if r["kld"] is not None]
    return max(1, min(limit, windows * (layers + 1) // sum(layers + 1 - s for s in starts)))
