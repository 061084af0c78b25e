"""config.json completed as transformers' AutoConfig.to_dict() gives it, without transformers.

transformers' configuration classes import torch (through its generation module), which costs a
conversion that needs none of it about 200 MiB. For the families in quantkit.arch.config_defaults
(generated from transformers by scripts/make_config_defaults.py) `complete` fills in what the
configuration class would: its field defaults, then the rules its __post_init__ applies (head_dim
from the widths, key/value heads, sliding windows and layer types: each family record's `config`,
quantkit.arch.families) and the standardization of the RoPE parameters into `rope_parameters`
(rope_scaling / rope_theta of older files moved in, rope_type from `type`,
original_max_position_embeddings for scaled types). tests/arch/test_hf_config.py
checks the table and the rules against transformers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from quantkit.arch.config_defaults import BASE, DEFAULTS
from quantkit.arch.families import by_model_type
from quantkit.arch.families.text import rope_dict

# keys PreTrainedConfig.__post_init__ consumes (the generation parameters among them are not read here)
CONSUMED = ("torch_dtype", "name_or_path", "_commit_hash", "output_attentions", "attn_implementation",
            "experts_implementation", "_attn_implementation_internal", "_experts_implementation_internal")


def known(config: dict) -> bool:
    """Whether `complete` knows the config's family: its record has rules (quantkit.arch.families) and
    config_defaults has its class's defaults."""
    family = by_model_type(config.get("model_type", ""))
    return family is not None and family.config is not None and family.model_type in DEFAULTS


def complete(config: dict) -> dict:
    """config.json's dict with the family's defaults and rules applied (a family `known` to quantkit)."""
    entry = DEFAULTS[config["model_type"]]
    kwargs = copy.deepcopy(config)
    if "torch_dtype" in kwargs and kwargs.get("dtype") is None:
        kwargs["dtype"] = kwargs["torch_dtype"]
    fields = {**BASE, **entry["fields"]}
    hp = {key: copy.deepcopy(kwargs.pop(key, value)) for key, value in fields.items()}
    rules = by_model_type(config["model_type"]).config
    for rule in rules.rules:
        rule(hp, kwargs)
    if "rope_parameters" in fields:
        (rules.rope or rope_dict)(hp, kwargs, entry)
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
