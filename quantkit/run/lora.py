"""Merge LoRA adapters (peft) into a full-precision base: `quantkit merge` and `quantize --lora`.

Arithmetic. The base loads in float32 (an exact upcast) and the adapters merge in the order
given, each through peft's own merge with its scaling multiplied by the adapter's weight w:

    LoRA    W' = W + w·s·B·A            s = lora_alpha / r
    rsLoRA  W' = W + w·s·B·A            s = lora_alpha / sqrt(r)
    DoRA    W' = m ⊙ V / ‖V‖ (per output row),  V = W + w·s·B·A

all in float32, each adapter on the result of the previous one; the result is rounded once to
the base's dtype when saved. `modules_to_save` (and embedding layers peft saved whole) replace
the base module outright, so they take no weight other than 1.

Before anything loads, `plan_merge` reads the adapter configs and safetensors headers and checks
them against the base's module shapes (a meta-device model, no weights): a module the base
lacks, a shape or rank that disagrees, a pickle or truncated adapter file are bad input.

Embeddings. Adapters that carry embedding rows for added tokens set the size the base is
resized to before they load. A tied base whose embedding or head the adapter changes is untied
first, so each keeps what the adapter did to it. The tokenizer (and its chat template) comes
from the last adapter directory that has one, else from the base.

QLoRA bases (bitsandbytes 4-bit): `dequantized` merges into the weights the adapter was trained
against, dequantized by bitsandbytes into a 16-bit checkpoint; `original` merges into a given
16-bit original instead (see docs/lora.md for the trade-off).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from quantkit.engines.transformers import load_model, torch_dtype
from quantkit.errors import InputError, UnsupportedError, require
from quantkit.io.checkpoint import ModelInfo, check_model_dir
from quantkit.io.safetensors import read_safetensors_header
from quantkit.run.cache import sha256_file

ADAPTER_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
MERGE_BASES = ("dequantized", "original")
# peft's names for the parts of a LoRA layer, as saved: key = module + part
LORA_PARTS = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".lora_embedding_A", ".lora_embedding_B",
              ".lora_magnitude_vector")
SAVED_LAYER = ".base_layer.weight"  # an embedding layer peft saved whole (save_embedding_layers)
# modules_to_save saved with save_embedding_layers keep their wrapper's copies: module + wrapper + ".weight"
WRAPPER_COPIES = (".modules_to_save", ".original_module")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
BNB_STATE = ".quant_state.bitsandbytes__"  # suffix prefix of a bitsandbytes 4-bit weight's packed state


@dataclass(frozen=True)
class Adapter:
    path: Path
    weight: float
    config: dict  # adapter_config.json
    tensors: dict[str, tuple[str, list[int]]]  # the safetensors header, keys without "base_model.model."

    @property
    def replaced_modules(self) -> list[str]:
        """Modules the adapter stores whole (modules_to_save, saved embedding layers)."""
        return sorted({split_key(key)[0] for key in self.tensors if split_key(key)[1] in ("weight", "bias", "base")})


@dataclass(frozen=True)
class MergePlan:
    """Everything checked before work: what merges into what."""

    base: ModelInfo  # the checkpoint as given (a QLoRA base stays 4-bit here)
    adapters: list[Adapter]
    merge_base: str  # "16-bit", "dequantized" or "original"
    original: ModelInfo | None  # the 16-bit original (merge_base "original")
    vocab_size: int | None  # embedding rows after resizing for added tokens; None: unchanged
    untie: bool  # the base ties embeddings and an adapter changes one of them
    tokenizer_dir: Path
    trust_remote_code: bool = False
    warnings: list[str] = field(default_factory=list)


@dataclass
class MergeReport:
    """The `merge` section of quantkit.json."""

    base: str
    merge_base: str
    original_base: str | None
    adapters: list[dict[str, Any]]
    dtype: str
    vocab_size: int | None
    untied_embeddings: bool
    tokenizer_from: str
    arithmetic: str
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ARITHMETIC = ("float32: W + w·s·B·A per adapter in order (DoRA: m·V/‖V‖ with V = W + w·s·B·A), "
              "rounded once to the base dtype")


# ---------------------------------------------------------------- checks (cheap, before work)


def is_bnb(info: ModelInfo) -> bool:
    from quantkit.formats.bitsandbytes import in_config

    return in_config(info.config)


def read_adapter(path: Path, weight: float = 1.0) -> Adapter:
    """adapter_config.json and the safetensors header, checked; never unpickles a .bin adapter."""
    if not path.is_dir():
        raise InputError(f"LoRA adapter directory not found: {path}",
                         hint="give --lora the directory peft's save_pretrained wrote (adapter_config.json, "
                              "adapter_model.safetensors)")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise InputError(f"{path} is not a LoRA adapter (no adapter_config.json)",
                         hint="give --lora the directory peft's save_pretrained wrote (adapter_config.json, "
                              "adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{config_file} is not valid JSON: {exc}",
                         hint="adapter_config.json is damaged: save the adapter again with save_pretrained") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else None
        raise UnsupportedError(f"{path} is a {found or 'unknown'} adapter; quantkit merges LoRA adapters "
                               "(LoRA, rsLoRA, DoRA)",
                               hint="merge other adapter kinds with peft's merge_and_unload, save the result, and "
                                    "quantize that")
    if not (path / ADAPTER_FILE).is_file():
        raise InputError(f"{path} has no {ADAPTER_FILE}",
                         hint="quantkit loads safetensors only (a pickled adapter_model.bin is never loaded); "
                         "re-save the adapter with save_pretrained(dir, safe_serialization=True)")
    header = read_safetensors_header(path / ADAPTER_FILE)
    tensors = {key.removeprefix(ADAPTER_PREFIX): entry for key, entry in header.items()}
    if not tensors:
        raise InputError(f"{path / ADAPTER_FILE} holds no tensors",
                         hint="the adapter file is empty: save the adapter again with save_pretrained")
    return Adapter(path, weight, config, tensors)


def split_key(key: str) -> tuple[str, str]:
    """(module name, part): part is a LoRA part, "base" (a saved embedding layer), "weight" or "bias"."""
    for part in LORA_PARTS:
        if key.endswith(part):
            return key[: -len(part)], part
    if key.endswith(SAVED_LAYER):
        return key[: -len(SAVED_LAYER)], "base"
    module, _, name = key.rpartition(".")
    for copy in WRAPPER_COPIES:
        module = module.removesuffix(copy)
    return module, name


@dataclass(frozen=True)
class BaseShapes:
    """Parameter shapes of the base's modules (from a meta-device model) and its embedding modules."""

    shapes: dict[str, list[int]]  # parameter name -> shape
    embedding: str  # module name of the input embeddings
    head: str | None  # module name of the output embeddings
    tied: bool


def base_shapes(info: ModelInfo, trust_remote_code: bool = False) -> BaseShapes:
    """Module names and shapes as transformers builds the model (names as peft sees them)."""
    import torch

    from quantkit.engines.transformers import auto_model_class, hf_config

    config = hf_config(info.path, trust_remote_code)
    with torch.device("meta"):
        model = auto_model_class(info.config).from_config(config, trust_remote_code=trust_remote_code)
    names = {id(module): name for name, module in model.named_modules()}
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    return BaseShapes(
        shapes={name: list(p.shape) for name, p in model.named_parameters(remove_duplicate=False)},
        embedding=names[id(embedding)],
        head=names[id(head)] if head is not None else None,
        tied=head is not None and head.weight is embedding.weight,
    )


def check_adapter_tensors(adapter: Adapter, base: BaseShapes) -> int | None:
    """Every tensor of the adapter fits a module of the base; returns the vocabulary rows the
    adapter's embedding tensors need when they differ from the base's (added tokens), else None."""
    vocab_modules = {base.embedding, base.head}
    rows = set()
    ranks: dict[str, dict[str, int]] = {}
    for key, (_dtype, shape) in adapter.tensors.items():
        module, part = split_key(key)
        target = base.shapes.get(f"{module}.{'bias' if part == 'bias' else 'weight'}")
        if target is None:
            raise InputError(f"adapter {adapter.path} changes {module}, which the base does not have",
                             hint="the adapter was trained on another model; check its base_model_name_or_path")
        expected, vocab_axis, rank_axis = expected_shape(part, target, shape)
        if module in vocab_modules and vocab_axis is not None and len(shape) == len(expected):
            rows.add(shape[vocab_axis])
            expected = [shape[vocab_axis] if i == vocab_axis else d for i, d in enumerate(expected)]
        if shape != expected:
            raise InputError(f"adapter {adapter.path}: {key} has shape {shape}, the base's {module} needs {expected}",
                             hint="the adapter was trained on a model of another size")
        if rank_axis is not None:
            ranks.setdefault(module, {})[part] = shape[rank_axis]
    check_ranks(adapter, ranks)
    base_rows = base.shapes[f"{base.embedding}.weight"][0]
    rows.discard(base_rows)
    if len(rows) > 1:
        raise InputError(f"adapter {adapter.path}: its embedding tensors disagree on the vocabulary size ({sorted(rows)})",
                         hint="the adapter file is damaged or mixed from two adapters: save it again with "
                              "save_pretrained")
    return rows.pop() if rows else None


def check_target_modules(adapter: Adapter, base: BaseShapes) -> None:
    """The adapter's config targets at least one module of the base, by peft's own matching rule
    (target_modules as names or suffixes, or one regex; exclude_modules, layers_to_transform); an
    adapter whose targets the base lacks was trained on another architecture."""
    from peft import PeftConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    try:
        config = PeftConfig.from_pretrained(str(adapter.path), local_files_only=True)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{adapter.path / 'adapter_config.json'} is not a config the installed peft reads: {exc}",
                         hint="re-save the adapter with the peft version quantkit pins") from None
    if config.target_modules is None:
        return  # target_parameters only: its tensors were checked against the base's parameters
    modules = module_names(base)
    if any(check_target_module_exists(config, name) for name in modules):
        return
    targets = config.target_modules if isinstance(config.target_modules, str) else ", ".join(sorted(config.target_modules))
    raise InputError(f"adapter {adapter.path} targets {targets}, which the base has no module of",
                     hint="the adapter was trained on another model (check base_model_name_or_path in its "
                     f"adapter_config.json); the base's weights are in modules named like {example_linears(base)}")


def module_names(base: BaseShapes) -> list[str]:
    """Every module name of the base (each prefix of a parameter name), as peft matches them."""
    names = set()
    for parameter in base.shapes:
        parts = parameter.split(".")[:-1]
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(names)


def example_linears(base: BaseShapes) -> str:
    """A few distinct module names of the base's 2-D weights (q_proj, v_proj, ...), for hints."""
    leaves = sorted({name.split(".")[-2] for name, shape in base.shapes.items()
                     if name.endswith(".weight") and len(shape) == 2 and name.count(".") >= 2})
    return ", ".join(leaves[:6])


def expected_shape(part: str, target: list[int], shape: list[int]) -> tuple[list[int], int | None, int | None]:
    """(shape the base module requires, axis holding the vocabulary, axis holding the rank) for one
    adapter tensor; the rank itself is taken from the tensor (checked across A and B separately)."""
    if part in (".lora_A.weight", ".lora_embedding_A") and len(shape) == 2:
        # Linear A: [r, in_features]; Embedding A: [r, num_embeddings]
        return ([shape[0], target[1]], None, 0) if part == ".lora_A.weight" else ([shape[0], target[0]], 1, 0)
    if part in (".lora_B.weight", ".lora_embedding_B") and len(shape) == 2:
        # Linear B: [out_features, r]; Embedding B: [embedding_dim, r]
        return ([target[0], shape[1]], 0, 1) if part == ".lora_B.weight" else ([target[1], shape[1]], None, 1)
    if part == ".lora_magnitude_vector":
        return [target[0]], 0, None
    if part == ".lora_B.bias":
        return [target[0]], 0, None
    return list(target), 0, None  # a whole module: weight, bias, saved embedding layer


def check_ranks(adapter: Adapter, ranks: dict[str, dict[str, int]]) -> None:
    """A and B of each module agree on the rank, and on the config's r unless a rank_pattern varies it."""
    r = adapter.config.get("r")
    for module, found in ranks.items():
        values = set(found.values())
        if len(found) != 2 or len(values) != 1:
            parts = ", ".join(f"{part.lstrip('.')} {rank}" for part, rank in sorted(found.items()))
            raise InputError(f"adapter {adapter.path}: {module} has incompatible LoRA ranks ({parts})",
                             hint="lora_A and lora_B of a module must share the rank r; the file is damaged "
                             "or mixed from two adapters")
        if not adapter.config.get("rank_pattern") and values != {r}:
            raise InputError(f"adapter {adapter.path}: {module} has rank {values.pop()}, adapter_config.json says r={r}",
                             hint="the adapter file and its config disagree: save the adapter again with "
                                  "save_pretrained")


def check_tokenizer(adapter_dir: Path, rows: int, trust_remote_code: bool) -> None:
    """An adapter's tokenizer must fit the embedding rows the merged model will have."""
    tokenizer = load_tokenizer_dir(adapter_dir, trust_remote_code)
    if len(tokenizer) > rows:
        raise InputError(f"the tokenizer in {adapter_dir} has {len(tokenizer)} tokens, but the merged model's "
                         f"embeddings hold {rows} rows and the adapter carries no embedding weights for the rest",
                         hint="save the adapter with its embedding layers (modules_to_save or "
                         "save_embedding_layers=True) after resizing the model for the added tokens")


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def base_name_warnings(adapter: Adapter, base_spec: str) -> list[str]:
    """A warning when adapter_config.json records a base other than the one given."""
    recorded = adapter.config.get("base_model_name_or_path")
    if not recorded:
        return [f"adapter {adapter.path} does not record its base model (base_model_name_or_path)"]
    if recorded == base_spec or Path(recorded).name == Path(base_spec).name:
        return []
    return [f"adapter {adapter.path} was trained on '{recorded}', merged into '{base_spec}'"]


def plan_merge(base: ModelInfo, base_spec: str, adapters: list[str], weights: list[float] | None = None,
               merge_base: str = "dequantized", original_base: str | None = None,
               trust_remote_code: bool = False) -> MergePlan:
    """Read and check every adapter against the base (headers and configs only, no weights)."""
    from quantkit.io.checkpoint import resolve_model

    if not adapters:
        raise InputError("no LoRA adapter given", hint="pass --lora DIR (repeatable)")
    weights = list(weights or [])
    if weights and len(weights) != len(adapters):
        raise InputError(f"{len(weights)} --lora-weight value(s) for {len(adapters)} adapter(s)",
                         hint="give one --lora-weight per --lora, in the same order, or none (all 1.0)")
    original = check_merge_base(base, merge_base, original_base, resolve_model)
    read = [read_adapter(Path(a), w) for a, w in zip(adapters, weights or [1.0] * len(adapters))]
    shapes = base_shapes(original or base, trust_remote_code)
    for adapter in read:
        check_target_modules(adapter, shapes)
    vocab_sizes = {rows for adapter in read if (rows := check_adapter_tensors(adapter, shapes)) is not None}
    if len(vocab_sizes) > 1:
        raise InputError(f"the adapters resize the vocabulary differently ({sorted(vocab_sizes)})",
                         hint="merge adapters trained on the same tokenizer; merge the others in separate runs")
    for adapter in read:
        if adapter.weight != 1.0 and adapter.replaced_modules:
            raise InputError(f"adapter {adapter.path} replaces {', '.join(adapter.replaced_modules)} whole "
                             f"(modules_to_save), which a weight of {adapter.weight:g} cannot scale",
                             hint="use --lora-weight 1 for this adapter")
    vocab_size = vocab_sizes.pop() if vocab_sizes else None
    rows = vocab_size or shapes.shapes[f"{shapes.embedding}.weight"][0]
    with_tokenizer = [a.path for a in read if has_tokenizer(a.path)]
    for path in with_tokenizer:
        check_tokenizer(path, rows, trust_remote_code)
    touched = {split_key(key)[0] for adapter in read for key in adapter.tensors}
    mode = "16-bit" if not is_bnb(base) else merge_base
    warnings = [w for adapter in read for w in base_name_warnings(adapter, base_spec)]
    return MergePlan(base=base, adapters=read, merge_base=mode, original=original, vocab_size=vocab_size,
                     untie=shapes.tied and bool(touched & {shapes.embedding, shapes.head}),
                     tokenizer_dir=with_tokenizer[-1] if with_tokenizer else base.path,
                     trust_remote_code=trust_remote_code, warnings=warnings)


def check_merge_base(base: ModelInfo, merge_base: str, original_base: str | None,
                     resolve: Callable[[str], Path]) -> ModelInfo | None:
    """The --merge-base/--original-base combination; returns the checked original for mode original."""
    if merge_base not in MERGE_BASES:
        raise InputError(f"--merge-base must be one of {', '.join(MERGE_BASES)}, not '{merge_base}'",
                         hint="e.g. --merge-base dequantized (the default)")
    if (merge_base == "original") != (original_base is not None):
        raise InputError("--merge-base original and --original-base DIR go together",
                         hint="--merge-base original --original-base ./llama-16bit")
    if merge_base == "original" and not is_bnb(base):
        raise InputError(f"{base.path} is not a bitsandbytes (QLoRA) base; --merge-base original applies to those",
                         hint="drop --merge-base/--original-base to merge into the given 16-bit base")
    qconfig = base.config.get("quantization_config") or {}
    if merge_base == "dequantized" and is_bnb(base) and not (qconfig.get("load_in_4bit") or qconfig.get("_load_in_4bit")):
        raise UnsupportedError(f"{base.path} is an 8-bit bitsandbytes checkpoint; quantkit dequantizes 4-bit "
                               "(QLoRA) bases only", hint="use --merge-base original --original-base DIR")
    if original_base is None:
        return None
    original = check_model_dir(resolve(original_base))
    if original.is_quantized:
        raise InputError(f"--original-base {original.path} is quantized; give the 16-bit original",
                         hint="--original-base takes the 16-bit checkpoint the QLoRA base was quantized from")
    if original.architecture != base.architecture:
        raise InputError(f"--original-base {original.path} is a {original.architecture}, the QLoRA base a "
                         f"{base.architecture}",
                         hint="--original-base takes the 16-bit checkpoint the QLoRA base was quantized from")
    return original


# ---------------------------------------------------------------- the merge


def merge(plan: MergePlan, out_dir: Path, workdir: Path, progress: Callable[[str], None] = lambda m: None
          ) -> MergeReport:
    """Merge the planned adapters and save a safetensors checkpoint with its tokenizer in out_dir."""
    require("peft", "lora", "merging LoRA adapters")
    from quantkit.engines.patches import plain_writes
    from quantkit.io.export import copy_side_files

    base = plan.original if plan.merge_base == "original" else plan.base
    if plan.merge_base == "dequantized":
        progress(f"dequantizing the 4-bit base {plan.base.path} with bitsandbytes")
        base = dequantize_checkpoint(plan.base, workdir / "dequantized")
    dtype = torch_dtype("auto", base)
    model = load_model(base, "float32", trust_remote_code=plan.trust_remote_code)
    if plan.vocab_size is not None:
        model.resize_token_embeddings(plan.vocab_size, mean_resizing=False)
    if plan.untie:
        untie_embeddings(model)
    for adapter in plan.adapters:
        progress(f"merging {adapter.path} (weight {adapter.weight:g})")
        model = apply_adapter(model, adapter)
    out_dir.mkdir(parents=True, exist_ok=True)
    with plain_writes():  # no memory map of the output beside the merged model (quantkit.io.shards.save_file)
        model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    del model
    load_tokenizer_dir(plan.tokenizer_dir, plan.trust_remote_code).save_pretrained(out_dir)
    copy_side_files(plan.tokenizer_dir, out_dir)  # a chat_template.jinja the tokenizer did not write
    copy_side_files(base.path, out_dir)  # generation config, processor files
    return MergeReport(
        base=str(plan.base.path), merge_base=plan.merge_base,
        original_base=str(plan.original.path) if plan.original else None,
        adapters=[adapter_record(a) for a in plan.adapters], dtype=str(dtype).removeprefix("torch."),
        vocab_size=plan.vocab_size, untied_embeddings=plan.untie, tokenizer_from=str(plan.tokenizer_dir),
        arithmetic=ARITHMETIC, warnings=list(plan.warnings),
    )


def apply_adapter(model, adapter: Adapter):
    """Load one adapter onto the float32 model, scale it by its weight, merge it with peft."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from quantkit.io.offline import offline

    with offline():
        peft_model = PeftModel.from_pretrained(model, adapter.path, local_files_only=True)
    if adapter.weight != 1.0:
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                module.set_scale("default", adapter.weight)
    return peft_model.merge_and_unload()


def untie_embeddings(model) -> None:
    """Give the output embeddings their own copy of the tied weight, and record it in the config."""
    import torch

    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False


def load_tokenizer_dir(path: Path, trust_remote_code: bool):
    """The tokenizer saved in a directory (an adapter's or the base's); InputError when unusable."""
    from transformers import AutoTokenizer

    from quantkit.engines.transformers import custom_code_error, needs_remote_code
    from quantkit.io.offline import offline

    try:
        with offline():
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - tokenizers/transformers raise many kinds on damaged files
        if needs_remote_code(exc):
            raise custom_code_error(path, "custom tokenizer") from exc
        raise InputError(f"the tokenizer in {path} does not load: {type(exc).__name__}: {exc}".splitlines()[0],
                         hint="its tokenizer files are incomplete or damaged") from exc


def adapter_record(adapter: Adapter) -> dict[str, Any]:
    config = adapter.config
    return {
        "path": str(adapter.path), "weight": adapter.weight, "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"), "use_rslora": bool(config.get("use_rslora")),
        "use_dora": bool(config.get("use_dora")), "target_modules": config.get("target_modules"),
        "modules_to_save": config.get("modules_to_save"), "replaced_modules": adapter.replaced_modules,
        "base_model_name_or_path": config.get("base_model_name_or_path"),
        "sha256": sha256_file(adapter.path / ADAPTER_FILE),
    }


# ---------------------------------------------------------------- QLoRA base


def dequantize_checkpoint(info: ModelInfo, out_dir: Path) -> ModelInfo:
    """A bitsandbytes 4-bit checkpoint as a 16-bit one: every packed weight dequantized by
    bitsandbytes (the values a QLoRA forward computes with), one shard at a time."""
    require("bitsandbytes", "nf4", "dequantizing a bitsandbytes 4-bit base")
    from safetensors.torch import save_file

    from quantkit.io.export import copy_side_files

    dtype = torch_dtype("auto", info)
    out_dir.mkdir(parents=True)
    for file in info.weight_files:
        save_file(dequantize_file(file, dtype), out_dir / file.name, metadata={"format": "pt"})
    config = {k: v for k, v in info.config.items() if k != "quantization_config"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = info.path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        weight_map = {k: v for k, v in data["weight_map"].items() if k in dequantized_names(info)}
        (out_dir / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    copy_side_files(info.path, out_dir)
    return check_model_dir(out_dir)


def dequantized_names(info: ModelInfo) -> set[str]:
    """Tensor names of the dequantized checkpoint: the 4-bit state tensors fold into their weight."""
    packed = {name.split(BNB_STATE)[0] for name in info.tensors if BNB_STATE in name}
    return {n for n in info.tensors if not any(n.startswith(p + ".") for p in packed)}


def dequantize_file(file: Path, dtype) -> dict:
    import bitsandbytes.functional as F
    import torch
    from safetensors import safe_open

    tensors = {}
    with safe_open(file, "pt") as f:
        names = list(f.keys())
        packed = {name.split(BNB_STATE)[0] for name in names if BNB_STATE in name}
        for name in names:
            if name in packed:
                state = {n[len(name) + 1:]: f.get_tensor(n) for n in names if n.startswith(name + ".")}
                quant_state = F.QuantState.from_dict(state, torch.device("cpu"))
                tensors[name] = F.dequantize_4bit(f.get_tensor(name), quant_state).to(dtype)
            elif not any(name.startswith(p + ".") for p in packed):
                tensor = f.get_tensor(name)
                tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return tensors


# ---------------------------------------------------------------- `quantkit merge`


def write_merged(plan: MergePlan, out: Path, overwrite: bool,
                 progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Merge into a staging dir beside OUT, add quantkit.json and a model card, rename to OUT."""
    import platform

    from quantkit import __version__
    from quantkit.io import export
    from quantkit.run.report import package_version

    versions = {"python": platform.python_version(),
                **{p: package_version(p) for p in ("torch", "transformers", "peft", "bitsandbytes")}}

    staging = export.make_staging(out, progress)
    try:
        report = merge(plan, staging, staging / ".work", progress)
        shutil.rmtree(staging / ".work", ignore_errors=True)
        record = {
            "schema_version": 1, "command": "merge", "quantkit_version": __version__, "versions": versions,
            "model": {"path": str(plan.base.path), "architecture": plan.base.architecture,
                      "sha256": {p.name: sha256_file(p) for p in plan.base.weight_files}},
            "merge": report.to_dict(),
            "files": sorted(p.name for p in staging.iterdir()) + ["README.md", "quantkit.json"],
        }
        (staging / "README.md").write_text(merge_card(report, __version__))
        export.write_json(staging / "quantkit.json", record)
        export.publish(staging, out, overwrite)
    except BaseException:
        export.discard(staging)
        raise
    return record


def merge_card(report: MergeReport, version: str) -> str:
    """README.md of a merged checkpoint: front matter, the adapters and how they were merged."""
    import yaml

    front = {"base_model": report.original_base or report.base, "library_name": "transformers",
             "tags": ["quantkit", "lora", "merged"]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]
    lines += [f"# {Path(report.base).name} + {len(report.adapters)} LoRA adapter(s), merged", ""]
    lines += [f"Merged with quantkit {version} into `{report.original_base or report.base}` "
              f"(merge base: {report.merge_base}), saved as {report.dtype}.", ""]
    lines += ["| adapter | weight | r | alpha | rsLoRA | DoRA | replaced modules |", "|---|---|---|---|---|---|---|"]
    for a in report.adapters:
        lines.append(f"| {a['path']} | {a['weight']:g} | {a['r']} | {a['lora_alpha']} | {a['use_rslora']} | "
                     f"{a['use_dora']} | {', '.join(a['replaced_modules']) or '-'} |")
    lines += ["", f"Arithmetic: {report.arithmetic}.", ""]
    if report.warnings:
        lines += ["Warnings:", ""] + [f"- {w}" for w in report.warnings] + [""]
    lines += ["Produced by `quantkit merge`; the full record is in `quantkit.json`.", ""]
    return "\n".join(lines)
