"""Mixture-of-experts models under the llm-compressor methods: the expert layout of each family's record
(quantkit.arch.families), and what the methods do with it.

transformers 5 loads MoE experts fused (`mlp.experts.gate_up_proj`, one 3-D tensor per layer,
Mixtral's `block_sparse_moe` renamed to `mlp`). llm-compressor's `oneshot` linearizes them into
one `nn.Linear` per expert projection (`mlp.experts.N.{gate,up,down}_proj`), calibrates every
expert on every token (`moe_calibrate_all_experts`: the expert's output is still weighted by the
router, but its Hessian/activation statistics come from all tokens), and quantizes them.

Saving: transformers reverts its load-time conversion; the fused-expert converters no longer
match the linear experts, so only the renamings are reverted. Where the checkpoint names the
expert projections differently (Mixtral's `w1`/`w3`/`w2`), `expert_names` says how, and the
save mapping turns the linear names back into the checkpoint's; transformers then reloads the
artifact strictly, dequantizing the per-expert tensors into its fused experts.

Routed tokens: the router of each MoE block (a module returning logits, top-k weights and top-k
indices; Granite 4's returns the indices first: MoeLayout.router_indices) is hooked during a separate
forward over the calibration windows, counting the tokens the router sends to each expert. An expert routed fewer than MIN_EXPERT_TOKENS tokens is listed
in the report: llm-compressor still calibrates it on every token, but on inputs the router rarely
sends it, so a short calibration set or one far from the model's use shows up there.
"""

from __future__ import annotations

import re

from quantkit.arch.families import FAMILIES, of_config
from quantkit.arch.families.base import ExpertCheckpoint, FusedExperts, MoeLayout
from quantkit.arch.vlm import is_vlm
from quantkit.errors import UnsupportedError

__all__ = ["ExpertCheckpoint", "MoeLayout", "MOE_LAYOUTS", "EXPERT_CHECKPOINTS"]

# An expert routed fewer calibration tokens than this is listed in the report (`details` of the
# target in quantkit.json, and a printed line). A round number: with 64 windows of 512 tokens and
# top-2 of 8 experts, an expert's even share is 8192 tokens, so one under 256 got less than 1/32 of
# it: the calibration text hardly exercises that expert.
MIN_EXPERT_TOKENS = 256


# model_type -> its expert layout, from the family records (quantkit.arch.families: each family's `moe`)
MOE_LAYOUTS: dict[str, MoeLayout] = {f.model_type: f.moe for f in FAMILIES if f.moe is not None}


# config.json keys holding a model's number of routed experts (Qwen-MoE's `num_experts` is written
# `num_local_experts` by transformers 5): a model with one of them > 0 is MoE.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
def is_moe(model_type: str) -> bool:
    return model_type in MOE_LAYOUTS


def moe_model_type(config: dict) -> str:
    """The model_type a checkpoint's expert layout is keyed by: its own, or a VLM's text model's
    (Qwen3_5MoeForConditionalGeneration: qwen3_5_moe_text) where that one has the layout and it holds for the VLM
    (MoeLayout.vlm)."""
    text = config.get("text_config")
    own = config.get("model_type", "")
    if not is_moe(own) and isinstance(text, dict) and is_moe(text.get("model_type", "")) \
            and MOE_LAYOUTS[text["model_type"]].vlm:
        return text["model_type"]
    return own


def expert_count(config: dict) -> int:
    text = config.get("text_config") or config
    return max([int(text.get(key) or 0) for key in EXPERT_COUNT_KEYS])


def moe_layout(config: dict) -> MoeLayout | None:
    """The expert layout the llm-compressor methods take a checkpoint's experts by (its text model's family record's
    `moe`); None for a family without one, and for a dense checkpoint of a family that has both (Granite 4: the
    dense hybrids route to no expert)."""
    return MOE_LAYOUTS.get(moe_model_type(config)) if expert_count(config) else None


def check_supported(info, method: str) -> None:
    """An MoE architecture the table does not know would save its experts under names transformers
    does not reload, and a known one with an expert missing would load it at random: refused before any work
    (exit 2)."""
    model_type = moe_model_type(info.config)
    if expert_count(info.config) and not is_moe(model_type):
        family = next((f for f in FAMILIES if f.model_type == info.model_type), None)
        if family is not None and family.moe_refusal:
            raise UnsupportedError(family.moe_refusal.format(method=method),
                                   hint="supported MoE model types: " + ", ".join(sorted(MOE_LAYOUTS)))
        raise UnsupportedError(
            f"{method}: mixture-of-experts architecture '{info.model_type}' is not supported",
            hint="supported MoE model types: " + ", ".join(sorted(MOE_LAYOUTS)) + "; or use gguf where it converts it")
    if is_moe(model_type):
        check_experts_stored(info)


# a routed expert's projection stored on its own (`model.layers.3.mlp.experts.5.up_proj.weight`, Mixtral's `w1`)
EXPERT_TENSOR = re.compile(r"^(?P<layer>.*\.)experts\.(?P<expert>\d+)\.(?P<projection>[A-Za-z0-9_]+)\.weight$")


def check_experts_stored(info) -> None:
    """Every layer of an MoE checkpoint that stores experts one tensor per projection stores every projection of
    each of config.json's experts, and no more experts: refused before work (ModelError, exit 2), naming the layer
    and the expert, where transformers would fill a missing one at random."""
    from quantkit.errors import ModelError

    count = expert_count(info.config)
    found: dict[str, dict[int, set[str]]] = {}
    for name in info.tensors:
        if (m := EXPERT_TENSOR.match(name)) is not None:
            found.setdefault(m["layer"], {}).setdefault(int(m["expert"]), set()).add(m["projection"])
    hint = "the checkpoint is incomplete or its config.json is another model's: save it again, or fix the expert count"
    for layer, experts in found.items():
        projections = set().union(*experts.values())
        for expert in range(count):
            if missing := sorted(projections - experts.get(expert, set())):
                raise ModelError(f"{info.path}: {layer}experts.{expert} has no {', '.join(missing)} weight "
                                 f"(config.json: {count} experts per layer)", hint=hint)
        if extra := sorted(e for e in experts if e >= count):
            raise ModelError(f"{info.path}: {layer}experts.{extra[0]} is stored, but config.json has {count} experts "
                             "per layer", hint=hint)


def check_vlm_expert_reload(info, method: str, stored: str, hint: str) -> None:
    """A VLM's towers are proven on transformers' reload of the whole artifact (quantkit.eval.vlm_proof), which
    decompresses the experts into its fused experts: what it cannot decompress there (`stored`: expert zero
    points, NVFP4's global scales) is refused before work on a VLM whose language model is a mixture of experts."""
    if is_vlm(info.config) and is_moe(moe_model_type(info.config)):
        raise UnsupportedError(f"{method}: {stored} in the experts of a VLM ({info.architecture}): its towers are "
                               "proven on transformers' reload of the artifact, which cannot decompress them into "
                               "its fused experts", hint=hint)


def is_expert_weight(name: str) -> bool:
    """A routed expert's projection in the checkpoint (`...experts.3.w1`, `...experts.3.gate_proj`)."""
    return re.search(r"(^|\.)experts\.\d+\.", name) is not None


# transformers 5's fused experts as a checkpoint may store them: `<block>.experts.gate_up_proj` [experts, 2 x
# intermediate, hidden], gate rows then up rows, and `<block>.experts.down_proj` [experts, hidden, intermediate]
TRANSFORMERS_FUSED_EXPERTS = (FusedExperts("experts.gate_up_proj", ("gate_proj", "up_proj"), layout="rows"),
                              FusedExperts("experts.down_proj", ("down_proj",), layout="rows"))


def fused_expert_linears(config: dict, tensors: dict) -> dict[str, tuple[str, list[int]]]:
    """{each routed expert's projection, named as the artifacts that quantize it one Linear per expert name it
    (`<block>.experts.<e>.gate_proj`): (the checkpoint's fused tensor it is cut from, its [out, in])} of a checkpoint
    storing its experts fused across experts (the family record's mlx_experts.fused: GPT-OSS, Llama 4, Granite 4;
    or transformers' own fused layout, TRANSFORMERS_FUSED_EXPERTS, where its mlx_experts.split_fused says the
    family's releases may store it: Qwen3.5-MoE), from the headers (`tensors`: name -> (dtype, shape)); {} for any
    other checkpoint."""
    family = of_config(config)
    layout = family.mlx_experts if family is not None else None
    rows = () if layout is None else layout.fused or (TRANSFORMERS_FUSED_EXPERTS if layout.split_fused else ())
    out = {}
    for name, (_dtype, shape) in tensors.items():
        for fused in (f for f in rows if name.endswith("." + f.tensor) and len(shape) == 3):
            experts, outputs, inputs = fused.piece_shape(shape)
            parent = fused.tensor.removesuffix(".weight").rpartition(".")[0]
            module = name[: -len(fused.tensor)] + (parent if parent.endswith("experts") else
                                                   ".".join(filter(None, (parent, "experts"))))
            out |= {f"{module}.{e}.{projection}": (name, [outputs, inputs])
                    for projection in fused.projections for e in range(experts)}
    return out


def save_renamings(model_type: str) -> list:
    """transformers WeightRenaming rows (checkpoint name -> module name) whose reversal on save writes
    the linear experts under the checkpoint's names; [] where the names already agree."""
    from transformers.core_model_loading import WeightRenaming

    layout = MOE_LAYOUTS[model_type]
    rows = []
    if layout.block_rename:
        old, new = layout.block_rename
        rows.append(WeightRenaming(f".{old}.", f".{new}."))
    rows += [WeightRenaming(rf"\.experts\.(\d+)\.{stored}\.", rf".experts.\1.{linear}.")
             for linear, stored in layout.expert_names.items()]
    return rows


def load_renamings(model_type: str) -> list:
    """transformers' WeightRenaming rows of the model type's loading conversion (checkpoint name -> module name:
    Mixtral's block_sparse_moe -> mlp, ERNIE 4.5's moe_statics moved under the router), in the order it applies
    them; what reads a checkpoint by its tensor names renames them so."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return [row for row in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(row, WeightRenaming)]


def set_save_names(model, model_type: str) -> None:
    """Before save_pretrained: write linearized experts under the checkpoint's tensor names."""
    from llmcompressor.modeling.moe.conversion_mappings import set_save_conversion_mapping

    if is_moe(model_type) and (rows := save_renamings(model_type)):
        set_save_conversion_mapping(model, rows)


def linear_experts(module, model_config, layout: MoeLayout | None, copy: bool):
    """llm-compressor's linear experts (LinearExperts2D) of a fused-experts module: built by the family's layout where
    it says how (MoeLayout.linear_experts: Llama 4), else by their class from the module's config or the model's;
    the module's weights copied into them (copy) or not (a model on the meta device)."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    linear = LinearExperts2D.get_linear_experts_cls(type(module))
    config = getattr(module, "config", model_config)
    if layout is not None and layout.linear_experts is not None:
        return layout.linear_experts(linear, module, config, copy)
    return linear.from_experts_module(module, config) if copy else linear(config)


def linearize(model, config: dict) -> None:
    """Replace each fused-experts module by llm-compressor's linear experts where the family's layout builds them
    (MoeLayout.linear_experts: Llama 4's text model, whose class oneshot's linearize_moe cannot build); a no-op for
    every other model, which oneshot linearizes itself."""
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    layout = moe_layout(config)
    if layout is None or layout.linear_experts is None:
        return
    for name, module in get_non_linearized_moes(model):
        model.set_submodule(name, linear_experts(module, model.config, layout, copy=True))


def routers(model, layout: MoeLayout) -> dict[str, object]:
    pattern = re.compile(layout.router)
    return {name: module for name, module in model.named_modules() if pattern.match(name)}


def count_routed_tokens(model, layout: MoeLayout, num_experts: int, windows, device: str = "cpu",
                        batch_size: int = 4) -> dict[str, list[int]]:
    """{router module name: tokens routed to each expert} over the calibration windows (top-k
    choices of every token), from forward hooks on the routers during one no-grad forward. `device`
    is where the embeddings live (decoder layers may be offloaded; accelerate onloads them)."""
    import torch

    found = routers(model, layout)
    counts = {name: torch.zeros(num_experts, dtype=torch.long) for name in found}

    def hook(name):
        def record(module, args, output):
            indices = output[layout.router_indices]  # (tokens, top_k) expert indices
            if layout.router_logits:  # (tokens, experts) logits: the top_k the router takes
                indices = torch.topk(indices, module.top_k, dim=-1).indices
            counts[name] += torch.bincount(indices.reshape(-1).cpu(), minlength=num_experts)
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in found.items()]
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                model(windows[start:start + batch_size].to(device))
    finally:
        for handle in handles:
            handle.remove()
    return {name: [int(n) for n in row] for name, row in counts.items()}


def starved_experts(counts: dict[str, list[int]], minimum: int = MIN_EXPERT_TOKENS) -> list[dict]:
    """The experts routed fewer than `minimum` tokens: [{"router", "expert", "tokens"}]."""
    return [{"router": name, "expert": expert, "tokens": tokens}
            for name, row in counts.items() for expert, tokens in enumerate(row) if tokens < minimum]


def routing_details(model, info, windows, device: str = "cpu") -> dict:
    """Report fields for a calibrated method on an MoE model (empty for a dense model)."""
    layout = moe_layout(info.config)
    if layout is None:
        return {}
    counts = count_routed_tokens(model, layout, expert_count(info.config), windows, device)
    return {"expert_routed_tokens": counts, "min_expert_tokens": MIN_EXPERT_TOKENS,
            "experts_under_min_tokens": starved_experts(counts)}


# ---------------------------------------------------------------- read by tensor names (no model object)


# model_type -> how its checkpoint stores the experts (each family's `experts_by_name`)
EXPERT_CHECKPOINTS: dict[str, ExpertCheckpoint] = {f.model_type: f.experts_by_name for f in FAMILIES
                                                   if f.experts_by_name is not None}


def expert_checkpoint(model_type: str) -> ExpertCheckpoint | None:
    return EXPERT_CHECKPOINTS.get(model_type)


def expert_projection(module: str, layout: ExpertCheckpoint) -> tuple[str, int, str] | None:
    """(the experts' module, expert index, projection) of a routed expert's projection module
    (`model.layers.3.mlp.experts.5.up_proj` -> ("model.layers.3.mlp.experts", 5, "up_proj")); None otherwise."""
    found = re.fullmatch(rf"(.*\.mlp\.experts)\.(\d+)\.({'|'.join(layout.projections)})", module)
    return (found.group(1), int(found.group(2)), found.group(3)) if found else None


def mtp_prefixes(config: dict, names, layout: ExpertCheckpoint) -> list[str]:
    """`model.layers.<i>.` of each multi-token-prediction layer config.json declares and the checkpoint holds."""
    text = config.get("text_config") or config
    count = max([int(text.get(key) or 0) for key in layout.mtp_keys], default=0)
    first = int(text.get("num_hidden_layers") or 0)
    prefixes = [f"model.layers.{i}." for i in range(first, first + count)]
    names = list(names)
    return [p for p in prefixes if any(n.startswith(p) for n in names)]
