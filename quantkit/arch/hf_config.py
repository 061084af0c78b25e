"""config.json completed as transformers' AutoConfig.to_dict() gives it, without transformers.

transformers' configuration classes import torch (through its generation module), which costs a
conversion that needs none of it about 200 MiB. For the families in quantkit.arch.config_defaults
(generated from transformers by scripts/make_config_defaults.py) `complete` fills in what the
configuration class would: its field defaults, then the rules its __post_init__ applies (head_dim
from the widths, key/value heads, sliding windows and layer types) and the standardization of the
RoPE parameters into `rope_parameters` (rope_scaling / rope_theta of older files moved in, rope_type
from `type`, original_max_position_embeddings for scaled types). tests/arch/test_hf_config.py
checks the table and the rules against transformers.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

from quantkit.arch.config_defaults import BASE, DEFAULTS

SCALED_ROPE = ("llama3", "yarn", "longrope")
# keys PreTrainedConfig.__post_init__ consumes (the generation parameters among them are not read here)
CONSUMED = ("torch_dtype", "name_or_path", "_commit_hash", "output_attentions", "attn_implementation",
            "experts_implementation", "_attn_implementation_internal", "_experts_implementation_internal")


def known(config: dict) -> bool:
    """Whether `complete` knows the config's family."""
    return config.get("model_type") in DEFAULTS


def complete(config: dict) -> dict:
    """config.json's dict with the family's defaults and rules applied (a family `known` to quantkit)."""
    entry = DEFAULTS[config["model_type"]]
    kwargs = copy.deepcopy(config)
    if "torch_dtype" in kwargs and kwargs.get("dtype") is None:
        kwargs["dtype"] = kwargs["torch_dtype"]
    fields = {**BASE, **entry["fields"]}
    hp = {key: copy.deepcopy(kwargs.pop(key, value)) for key, value in fields.items()}
    for rule in RULES.get(config["model_type"], ()):
        rule(hp, kwargs)
    if "rope_parameters" in fields:
        ROPE.get(config["model_type"], rope_dict)(hp, kwargs, entry)
    for key in CONSUMED:
        kwargs.pop(key, None)
    for alias, name in entry["attribute_map"].items():  # stored under another name (to_dict() uses it)
        for values in (hp, kwargs):
            if alias in values:
                values[name] = values.pop(alias)
    return {**hp, **kwargs, "model_type": config["model_type"]}


def read(model_dir: Path) -> dict:
    """The checkpoint's config.json, completed when its family is known (as it is otherwise)."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return complete(config) if known(config) else config


# ------------------------------------------------------------------ the configuration classes' __post_init__


def head_dim(hp: dict, kwargs: dict) -> None:
    if hp["head_dim"] is None:
        hp["head_dim"] = hp["hidden_size"] // hp["num_attention_heads"]


def kv_heads(hp: dict, kwargs: dict) -> None:
    if hp["num_key_value_heads"] is None:
        hp["num_key_value_heads"] = hp["num_attention_heads"]


def qwen_window(hp: dict, kwargs: dict) -> None:
    """Qwen2/Qwen3(-MoE): the window only where use_sliding_window is set."""
    hp["sliding_window"] = hp["sliding_window"] if hp["use_sliding_window"] else None


def qwen_layer_types(hp: dict, kwargs: dict) -> None:
    if hp["layer_types"] is None:
        hp["layer_types"] = ["sliding_attention" if hp["sliding_window"] is not None and i >= hp["max_window_layers"]
                             else "full_attention" for i in range(hp["num_hidden_layers"])]


def mlp_only_layers(hp: dict, kwargs: dict) -> None:
    if hp["mlp_only_layers"] is None:
        hp["mlp_only_layers"] = []


def alternating_layers(hp: dict, kwargs: dict) -> None:
    """Gemma 2: every other layer a sliding-window one, the first included."""
    if hp["layer_types"] is None:
        hp["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                             for i in range(hp["num_hidden_layers"])]


def gemma3_layers(hp: dict, kwargs: dict) -> None:
    """Gemma 3: every sliding_window_pattern-th layer global (6 when config.json does not say)."""
    pattern = hp["_sliding_window_pattern"] = kwargs.get("sliding_window_pattern", 6)
    if hp["layer_types"] is None:
        hp["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                             for i in range(hp["num_hidden_layers"])]


RULES: dict[str, tuple[Callable[[dict, dict], None], ...]] = {
    "llama": (head_dim, kv_heads),
    "mistral": (head_dim, kv_heads),
    "mixtral": (kv_heads,),
    "qwen2": (qwen_window, kv_heads, qwen_layer_types),
    "qwen3": (qwen_window, kv_heads, qwen_layer_types),
    "qwen3_moe": (qwen_window, mlp_only_layers),
    "gemma2": (alternating_layers,),
    "gemma3_text": (gemma3_layers,),
    "phi3": (kv_heads,),
}


# ------------------------------------------------------------------ RoPE parameters (RotaryEmbeddingConfigMixin)


def rope_dict(hp: dict, kwargs: dict, entry: dict) -> None:
    """convert_rope_params_to_dict: rope_scaling (or rope_parameters) with rope_theta moved in."""
    rope = kwargs.pop("rope_scaling", None) or hp["rope_parameters"] or {}
    rope.setdefault("rope_theta", kwargs.pop("rope_theta", entry["default_theta"]))
    if (partial := kwargs.get("partial_rotary_factor", hp.get("partial_rotary_factor"))) is not None:
        rope.setdefault("partial_rotary_factor", partial)
    hp["rope_parameters"] = rope
    standardize(hp, entry)


def gemma3_rope(hp: dict, kwargs: dict, entry: dict) -> None:
    """Gemma3TextConfig.convert_rope_params_to_dict: one dictionary per layer type."""
    scaling = kwargs.pop("rope_scaling", None)
    rope = hp["rope_parameters"] or {"sliding_attention": {"rope_type": "default"},
                                     "full_attention": {"rope_type": "default"}}
    if scaling is not None:
        rope["full_attention"].update(scaling)
    if rope.get("full_attention") is None:
        rope["full_attention"] = {"rope_type": "default"}
    rope["full_attention"].setdefault("rope_theta", kwargs.pop("rope_theta", entry["default_theta"]["global"]))
    if rope.get("sliding_attention") is None:
        rope["sliding_attention"] = {"rope_type": "default"}
    rope["sliding_attention"].setdefault("rope_theta",
                                         kwargs.pop("rope_local_base_freq", entry["default_theta"]["local"]))
    hp["rope_parameters"] = rope
    standardize(hp, entry)


def phi3_rope(hp: dict, kwargs: dict, entry: dict) -> None:
    """Phi3Config.convert_rope_params_to_dict: partial_rotary_factor 1.0 by default, su / yarn read as longrope."""
    rope = kwargs.pop("rope_scaling", None) or hp["rope_parameters"] or {}
    rope.setdefault("rope_theta", kwargs.pop("rope_theta", 10_000.0))
    rope.setdefault("partial_rotary_factor", kwargs.get("partial_rotary_factor", 1.0))
    hp["rope_parameters"] = rope
    standardize(hp, entry)
    if rope.get("rope_type") in ("su", "yarn"):
        rope["rope_type"] = "longrope"


ROPE = {"gemma3_text": gemma3_rope, "phi3": phi3_rope}


def standardize(hp: dict, entry: dict) -> None:
    """standardize_rope_params: rope_type (from `type`), original_max_position_embeddings for the
    scaled types, one dictionary or one per layer type."""
    rope, layer_types = hp["rope_parameters"], hp.get("layer_types")
    if layer_types is None or not rope or set(rope).isdisjoint(layer_types):
        standardize_one(hp, rope, entry, own_context=True)
        return
    for layer_type in set(layer_types):
        if rope.get(layer_type) is not None:
            standardize_one(hp, rope[layer_type], entry, own_context=False)


def standardize_one(hp: dict, rope: dict, entry: dict, own_context: bool) -> None:
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", None)
    if hp.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", hp["partial_rotary_factor"])
    if entry["default_rope_type"] != "default" and rope["rope_type"] == "default":
        rope["rope_type"] = entry["default_rope_type"]
    if rope["rope_type"] in SCALED_ROPE:
        if own_context and "original_max_position_embeddings" in hp:
            rope["original_max_position_embeddings"] = hp["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", hp["max_position_embeddings"])
