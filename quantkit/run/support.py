"""The generated tables of docs/models.md and docs/gate.md, each cell what the code says: the family x method tables
(MethodSpec.support over quantkit.arch.families), the architectures each method takes (the smoothing
table, the GGUF converter's table, the MLX table, the expert layouts), the VLM towers
(quantkit.arch.vlm.FAMILIES), the expert layouts (quantkit.arch.moe) and the runtimes that serve each
method's format and scheme (quantkit.formats.Format.runtimes), and each method's default gate
(MethodSpec.default_gate); docs/serving.md's serving engines and their variables (quantkit.serve.engines.ENGINES).
`python scripts/make_docs_tables.py` writes them into the pages; tests/test_docs.py keeps the pages equal
to `docs_tables()`."""

from __future__ import annotations

import re
import typing

from quantkit.arch.families import TextRow, VlmRow, text_rows, vlm_rows
from quantkit.formats import Runtime
from quantkit.methods import METHODS, get_method, runtimes_for


def verdict(model_type: str, method: str) -> str:
    """One cell: what `method` does with the family of the docs' tables whose model_type this is."""
    family = next(f for f in text_rows() + vlm_rows() if f.model_type == model_type)
    return get_method(method).support(family)


def table(header: str, families: list[TextRow] | list[VlmRow]) -> list[str]:
    """Markdown rows: a header cell, one column per method, one row per family."""
    lines = [f"| {header} | " + " | ".join(f"`{m}`" for m in METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
    for family in families:
        cells = [get_method(m).support(family) for m in METHODS]
        lines.append(f"| {family.name} (`{family.model_type}`) | " + " | ".join(cells) + " |")
    return lines


def family_table() -> list[str]:
    """The markdown rows of the text family x method table."""
    return table("family (`model_type`)", text_rows())


def vlm_table() -> list[str]:
    """The markdown rows of the VLM family x method table."""
    return table("VLM family (`model_type`)", vlm_rows())


def code_list(names) -> str:
    return ", ".join(f"`{name}`" for name in names)


def text_only(model_types: list[str]) -> str:
    return f" ({code_list(model_types)}: text models only)" if model_types else ""


def architectures_table() -> list[str]:
    """Which checkpoints each method takes, from the tables its checks read."""
    from quantkit.arch.mappings import supported_model_types
    from quantkit.arch.moe import EXPERT_CHECKPOINTS, MOE_LAYOUTS
    from quantkit.gguf.convert import supported_architectures
    from quantkit.methods.nf4 import moe_model_types
    from quantkit.mlx.checkpoint import MLX_MODEL_TYPES

    return [
        "| method | architectures |",
        "|---|---|",
        "| `fp8`, `gptq`, `autoround` | any transformers causal LM or VLM; mixture-of-experts `model_type`: "
        + code_list(sorted(MOE_LAYOUTS)) + text_only(sorted(t for t, layout in MOE_LAYOUTS.items() if not layout.vlm))
        + " |",
        "| `nf4` | any transformers causal LM or VLM; mixture-of-experts `model_type`: " + code_list(moe_model_types())
        + text_only(sorted(t for t in moe_model_types() if t not in MOE_LAYOUTS or not MOE_LAYOUTS[t].vlm)) + " |",
        "| `nvfp4`, `mxfp4` | any transformers causal LM or VLM without experts |",
        ("| `fp8` fp8-block, `nvfp4` a16, `mxfp4` on mixture-of-experts | model-free, by checkpoint names "
         "(no model object, no GPU): `model_type` " + code_list(sorted(EXPERT_CHECKPOINTS)) + " |"),
        "| `awq`, `smoothquant` | `model_type` (a VLM: its text model's): " + code_list(supported_model_types()) + " |",
        "| `gguf` | `architectures`: " + code_list(supported_architectures()) + " |",
        "| `mlx` | `model_type`: " + code_list(sorted(MLX_MODEL_TYPES)) + " |",
    ]


def vlm_towers_table() -> list[str]:
    """Each VLM family's components: what stays 16-bit, and where the language model is."""
    from quantkit.arch.vlm import FAMILIES

    lines = ["| VLM family (`model_type`) | architecture | language model | vision | projector | audio "
             "| also 16-bit | vision tower quantizable |",
             "|---|---|---|---|---|---|---|---|"]
    for model_type, f in FAMILIES.items():
        quantizable = f"no: {f.vision_stays_16bit}" if f.vision_stays_16bit else "yes (`--vision int8`)"
        lines.append(f"| {f.name} (`{model_type}`) | `{f.architecture}` | `{f.language}` | {code_list(f.vision) or '—'} "
                     f"| {code_list(f.projector) or '—'} | {code_list(f.audio) or '—'} "
                     f"| {f'cross-attention layers (`{f.cross_attention}`)' if f.cross_attention else '—'} "
                     f"| {quantizable} |")
    return lines


def moe_table() -> list[str]:
    """The expert layouts quantkit knows: the router kept 16-bit, the experts' names."""
    from quantkit.arch.moe import MIN_EXPERT_TOKENS, MOE_LAYOUTS

    lines = ["| `model_type` | router (kept 16-bit) | expert projections as stored | block renamed on load |",
             "|---|---|---|---|"]
    for model_type, layout in sorted(MOE_LAYOUTS.items()):
        names = (", ".join(f"`{ours}` = `{stored}`" for ours, stored in layout.expert_names.items())
                 or "`gate_proj`, `up_proj`, `down_proj`")
        rename = " → ".join(f"`{name}`" for name in layout.block_rename) if layout.block_rename else "—"
        lines.append(f"| `{model_type}` | `{layout.router}` | {names} | {rename} |")
    lines.append(f"| (every layout) | experts routed fewer than {MIN_EXPERT_TOKENS} calibration tokens are listed "
                 "in the report | | |")
    return lines


def scheme_variants(name: str) -> list[tuple[str, tuple[Runtime, ...]]]:
    """(label, runtimes) per value of the method's `scheme` (else `activations`) option, whose runtimes its
    format gives for the scheme it writes (quantkit.methods.runtimes_for); consecutive values served by the
    same runtimes share a label, and a method served alike whatever the value is one row."""
    spec = get_method(name)
    fields = [f for f in ("scheme", "activations") if f in spec.options.model_fields]
    if not fields:
        return [(f"`{name}`", runtimes_for(spec, spec.options()))]
    field = fields[0]
    groups: list[tuple[list[str], tuple[Runtime, ...]]] = []
    for value in typing.get_args(spec.options.model_fields[field].annotation):
        served = runtimes_for(spec, spec.options.model_construct(**{field: value}))
        if groups and groups[-1][1] == served:
            groups[-1][0].append(value)
        else:
            groups.append(([value], served))
    if len(groups) == 1:
        return [(f"`{name}`", groups[0][1])]
    prefix = "" if field == "scheme" else f"{field} "
    return [(f"`{name}` " + ", ".join(f"{prefix}`{v}`" for v in values), served) for values, served in groups]


def capability(runtime: Runtime) -> str:
    if "cuda" not in runtime.kinds:
        return "—"
    if runtime.max_capability == runtime.min_capability:
        return f"{runtime.min_capability:.1f} only"
    if runtime.max_capability:
        return f"{runtime.min_capability:.1f} to {runtime.max_capability:.1f}"
    return f"{runtime.min_capability:.1f}+" if runtime.min_capability else "any"


def widths(runtime: Runtime) -> str:
    rules = [f"{side} a multiple of {n}" for side, n in (("out", runtime.out_multiple), ("in", runtime.in_multiple))
             if n > 1]
    return ", ".join(rules) or "any"


def runtimes_table() -> list[str]:
    """Which runtime and kernel serve each method's artifact, where, and on which layer widths (in order of
    preference: the first that runs on a device serves there); `quantkit plan` reads the same table."""
    lines = ["| format | runtime and kernel | devices | CUDA compute capability | layer widths | source |",
             "|---|---|---|---|---|---|"]
    for name in METHODS:
        for label, served in scheme_variants(name):
            for runtime in served:
                lines.append(f"| {label} | {runtime.name} | {', '.join(runtime.kinds)} | {capability(runtime)} "
                             f"| {widths(runtime)} | {runtime.source} |")
    return lines


def kind_with_methods(kind: str) -> str:
    """An artifact kind and the methods that write it: 'compressed-tensors (fp8, gptq, ...)'."""
    methods = [name for name in METHODS if get_method(name).format.kind == kind]
    return f"{kind} ({', '.join(methods)})" if methods and methods != [kind] else kind


def engines_table() -> list[str]:
    """Each serving engine: the artifacts it loads (and the methods that write them) and how it is started."""
    from quantkit.serve.engines import ENGINES, get_engine, kinds_served

    lines = ["| engine (`--engine`) | artifacts | started as |", "|---|---|---|"]
    for name in ENGINES:
        engine = get_engine(name)
        lines.append(f"| {engine.LABEL} (`{name}`) | {', '.join(kind_with_methods(k) for k in kinds_served(name))} "
                     f"| {engine.STARTED_AS} |")
    return lines


def engine_variables_table() -> list[str]:
    """The environment variables that point at each engine's installation."""
    from quantkit.serve.engines import ENGINES, get_engine

    lines = ["| variable | what |", "|---|---|",
             "| `QUANTKIT_ENGINES` | the directory setup_engines.sh installed into (default `~/.cache/quantkit/engines`) |"]
    for name in ENGINES:
        engine = get_engine(name)
        lines.append(f"| `{engine.VARIABLE}` | {engine.VARIABLE_HELP} |")
    return lines


def option_values(name: str) -> tuple[str | None, list]:
    """The option a method's default gate depends on, and its values: a scheme, mlx's bits, gguf's types."""
    from quantkit.gguf.mixture import FILE_TYPES

    fields = get_method(name).options.model_fields
    for field in ("scheme", "bits", "gguf_type"):
        if field in fields:
            values = list(FILE_TYPES) if field == "gguf_type" else list(typing.get_args(fields[field].annotation))
            if values:
                return field, values
    return None, [None]


def gate_table() -> list[str]:
    """Each method's default thresholds (MethodSpec.default_gate) by the option they depend on; a recipe's `gate:`
    or --max-ppl-increase, --max-kld, --min-top1 override them."""
    lines = ["| method | options | max ppl increase | max KLD | min top-1 |", "|---|---|---|---|---|"]
    for name in METHODS:
        spec = get_method(name)
        field, values = option_values(name)
        groups: dict[tuple, list] = {}
        for value in values:
            options = spec.options.model_construct(**({field: value} if field else {}))
            gate = spec.default_gate(options)
            groups.setdefault((gate["max_ppl_increase"], gate["max_kld"], gate["min_top1"]), []).append(value)
        for (ppl, kld, top1), members in sorted(groups.items()):
            label = "" if len(groups) == 1 else ", ".join(f"`{v}`" for v in members)
            if label and field == "bits":
                label = ", ".join(f"{v}-bit" for v in members)
            lines.append(f"| `{name}` | {label or 'all'} | {ppl:.0%} | {kld:.2f} | {top1:.0%} |")
    return lines


def auto_table() -> list[str]:
    """The candidates of `--method auto` per engine: each method's AutoRungs that a kernel of the engine serves
    somewhere (quantkit.run.auto; which kernel serves where: the runtimes table)."""
    from quantkit.run.auto import ENGINES, candidates

    lines = ["| --for | an engine alone means | candidates |",
             "|---|---|---|"]
    for engine in ENGINES.values():
        served = []
        for c in candidates():
            method = get_method(c.method)
            runtimes = runtimes_for(method, method.options.model_validate(c.option_dict()))
            if any(r.name.startswith(engine.prefix) for r in runtimes):
                served.append(c.label)
        lines.append(f"| `{engine.name}` | {engine.device} | {', '.join(served)} |")
    return lines


def docs_tables() -> dict[str, list[str]]:
    """Every generated block of the docs pages by name."""
    return {"architectures": architectures_table(), "families": family_table(), "vlm-families": vlm_table(),
            "vlm-towers": vlm_towers_table(), "moe": moe_table(), "runtimes": runtimes_table(),
            "gates": gate_table(), "engines": engines_table(), "engine-variables": engine_variables_table(),
            "auto-candidates": auto_table()}


BEGIN = re.compile(r"^<!-- generated: ([a-z-]+) \(python scripts/make_docs_tables.py\) -->$")
END = "<!-- end generated -->"


def generated_blocks(text: str) -> dict[str, list[str]]:
    """The lines between each `<!-- generated: NAME ... -->` marker and its end marker, by NAME."""
    blocks: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if name is None and (match := BEGIN.match(line)):
            name = match.group(1)
            blocks[name] = []
        elif name is not None and line == END:
            name = None
        elif name is not None:
            blocks[name].append(line)
    return blocks


def render(text: str) -> str:
    """`text` with every generated block replaced by the table of its name (an unknown name is kept as is)."""
    tables = docs_tables()
    lines, name = [], None
    for line in text.splitlines():
        if name is None:
            lines.append(line)
            if (match := BEGIN.match(line)) and match.group(1) in tables:
                name = match.group(1)
                lines.extend(tables[name])
        elif line == END:
            lines.append(line)
            name = None
    return "\n".join(lines) + "\n"
