"""quantkit.arch.hf_config against transformers: the generated defaults table equals what the
configuration classes declare, and a completed config.json equals AutoConfig's to_dict() for each
GGUF test family, as saved and with every default and older-format key variant."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.arch import hf_config
from quantkit.arch.config_defaults import DEFAULTS

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# bookkeeping keys of to_dict(), not hyper-parameters (the converter reads none of them)
IGNORED = {"transformers_version", "dtype", "id2label", "label2id", "_name_or_path", "output_attentions"}
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def auto_config(config: dict) -> dict:
    """What convert_hf_to_gguf.py reads: AutoConfig's to_dict() for the config.json dict."""
    from transformers import AutoConfig

    rest = {k: v for k, v in copy.deepcopy(config).items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **rest).to_dict()


def comparable(config: dict) -> dict:
    from transformers import GenerationConfig

    generation = set(GenerationConfig._get_default_generation_params())
    return {k: v for k, v in config.items() if k not in IGNORED and k not in generation}


def test_table_is_generated_from_installed_transformers():
    """scripts/make_config_defaults.py --check: the committed table equals a fresh generation."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_config_defaults.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, "quantkit/arch/config_defaults.py is stale: run scripts/make_config_defaults.py"


def test_every_family_with_config_rules_is_in_the_table():
    """A family record with `config` rules is completed without transformers: its class's defaults are in the
    generated table (the older converted families among them)."""
    from quantkit.arch.families import FAMILIES

    with_rules = {f.model_type for f in FAMILIES if f.config is not None}
    assert {"llama", "gemma", "gemma2", "gemma3_text", "phi3", "qwen3_moe"} <= with_rules <= set(DEFAULTS)


def family_configs() -> dict[str, dict]:
    """config.json of each GGUF test family (tests/gguf/families.py), as save_pretrained writes it."""
    from tests.gguf.families import FAMILIES, family_config

    out = {}
    for family in FAMILIES:
        config = family_config(family, 512, IDS)
        saved = json.loads(config.to_json_string(use_diff=True))
        if family == "gemma3vlm":
            saved = saved["text_config"]
        out[family] = saved
    return out


def variants(config: dict) -> dict[str, dict]:
    """The saved config.json, the same without every key equal to the family's default (older
    transformers omitted them), and its RoPE parameters in the older keys (rope_scaling with
    `type`, rope_theta at the top level)."""
    entry = DEFAULTS[config["model_type"]]
    sparse = {k: v for k, v in config.items() if k not in entry["fields"] or entry["fields"][k] != v}
    sparse = {k: v for k, v in sparse.items() if k not in ("head_dim", "layer_types", "num_key_value_heads")
              or hf_config.complete({**sparse, k: None})[k] != v}
    out = {"saved": config, "sparse": sparse}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_type" in rope and "full_attention" not in rope:
        legacy = {k: v for k, v in sparse.items() if k != "rope_parameters"}
        scaling = {("type" if k == "rope_type" else k): v for k, v in rope.items() if k != "rope_theta"}
        legacy["rope_scaling"] = None if scaling == {"type": "default"} else scaling
        if "rope_theta" in rope:
            legacy["rope_theta"] = rope["rope_theta"]
        out["legacy rope"] = legacy
        out["no rope keys"] = {k: v for k, v in sparse.items() if k != "rope_parameters"}
    return out


CASES = [(family, name, config) for family, saved in family_configs().items()
         for name, config in variants(saved).items()]


@pytest.mark.parametrize("family,variant,config", CASES, ids=[f"{f}-{v}" for f, v, _ in CASES])
def test_complete_equals_autoconfig(family, variant, config):
    assert comparable(hf_config.complete(config)) == comparable(auto_config(config))


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_complete_of_a_bare_config_equals_autoconfig(model_type):
    """Only model_type and the widths: every other value is the family's default."""
    config = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3,
              "intermediate_size": 512}
    assert comparable(hf_config.complete(config)) == comparable(auto_config(config))


def test_windowed_and_scaled_variants_equal_autoconfig():
    cases = [
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
         "num_hidden_layers": 3},
        {"model_type": "qwen3", "use_sliding_window": False, "sliding_window": 64},
        {"model_type": "gemma3_text", "sliding_window_pattern": 2, "num_hidden_layers": 4, "rope_theta": 5e5,
         "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        {"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
         "original_max_position_embeddings": 4096, "max_position_embeddings": 131072, "hidden_size": 3072,
         "num_attention_heads": 32},
        {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 1e6},
        {"model_type": "mistral", "torch_dtype": "bfloat16", "rope_theta": 1e6, "sliding_window": None},
    ]
    for config in cases:
        assert comparable(hf_config.complete(config)) == comparable(auto_config(config)), config
