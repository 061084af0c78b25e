"""Command-line options, each declared once, and the groups of them several commands share.

A Flag is one option: its names, type, default, help and panel. A group is a frozen dataclass whose fields
carry their Flag (`FLAG.field()`), or a library record paired with a {field: Flag} mapping (a Lazy group:
the record is imported only when the command runs, so `quantkit --help` imports no pydantic, numpy or
torch). `takes` puts each group's flags into the command's signature for typer, and calls the command with
one record per group, built in one place; a record checks what it can on its own (`__post_init__`, exit 2).

Groups: GateFlags (quantize, eval), HeldOutFlags (eval, serve-check; CalibrationFlags for quantize shares
--seq-len and --seed), ResourceFlags (quantize; --device and --max-memory shared with eval and
serve-check), ReportFlags (quantize; --json everywhere), MethodOptions (quantkit.run.recipe: the method
flags), ServeTolerances (quantkit.serve.check.Tolerances: serve-check's verdict).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, get_type_hints

import typer

from quantkit.cli.common import CALIBRATION, GATE, MEASURED, METHOD, MODEL, REPORTS, RESOURCES
from quantkit.serve.engines import choices as engine_choices


@dataclass(frozen=True)
class Flag:
    """One option as typer declares it (no names: typer derives --name from the parameter)."""

    annotation: Any
    default: Any = None
    decls: tuple[str, ...] = ()
    help: str = ""
    panel: str = MODEL
    extra: tuple[tuple[str, Any], ...] = ()  # more typer.Option keywords: min, max, metavar

    def but(self, **changes) -> Flag:
        """This flag with another default, help or panel (a command's own wording of a shared option)."""
        return replace(self, **changes)

    def option(self, **changes):
        """The typer.Option to put as a parameter's default."""
        f = self.but(**changes)
        return typer.Option(f.default, *f.decls, help=f.help, rich_help_panel=f.panel, **dict(f.extra))

    def field(self, **changes):
        """A dataclass field carrying this flag (list defaults through a factory)."""
        f = self.but(**changes)
        if isinstance(f.default, list):
            return field(default_factory=list, metadata={"flag": f})
        return field(default=f.default, metadata={"flag": f})


def flag(annotation, default=None, *decls: str, help: str, panel: str, **extra) -> Flag:
    return Flag(annotation, default, decls, help, panel, tuple(extra.items()))


@dataclass(frozen=True)
class Lazy:
    """A group whose record lives in the library: imported when the command runs. Its flags must name the
    record's fields, all of them (checked on each call and by tests/cli/test_options.py)."""

    record: str  # "module:Class"
    flags: dict[str, Flag]

    def load(self) -> type:
        module, name = self.record.split(":")
        cls = getattr(importlib.import_module(module), name)
        missing = {f.name for f in fields(cls)} ^ set(self.flags)
        if missing:
            raise TypeError(f"{self.record}'s fields and its flags differ: {sorted(missing)}")
        return cls


def group_flags(group) -> list[tuple[str, Flag]]:
    """(parameter name, Flag) of each of a group's options, in declaration order."""
    if isinstance(group, Lazy):
        return list(group.flags.items())
    hints = get_type_hints(group)
    return [(f.name, f.metadata["flag"].but(annotation=hints[f.name])) for f in fields(group) if f.init]


def build(group, values: dict[str, Any]):
    """The group's record from its flags' values."""
    return (group.load() if isinstance(group, Lazy) else group)(**values)


def takes(**groups):
    """Replace each parameter named in `groups` by the group's flags (for typer), and call the command with
    that parameter set to the group's record built from them (module docstring)."""

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        expanded = {name: group_flags(group) for name, group in groups.items()}
        params = []
        for param in signature.parameters.values():
            if param.name not in expanded:
                params.append(param)
                continue
            params += [inspect.Parameter(name, param.kind, default=f.option(), annotation=f.annotation)
                       for name, f in expanded[param.name]]

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            for name, group in groups.items():
                kwargs[name] = build(group, {flag_name: kwargs.pop(flag_name) for flag_name, _ in expanded[name]})
            return command(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


# ------------------------------------------------------------------ flags several commands take


def json_flag(what: str) -> Flag:
    return flag(Optional[str], None, "--json", help=f"Write {what} as JSON to FILE ('-' = stdout).", panel=REPORTS)


MODEL_DIR = "Local checkpoint dir, or a Hub id org/name[@revision]."
AGAINST = flag(Optional[str], None, "--against", "-a", panel=MODEL,
               help="Base checkpoint. Default: the base named in the artifact's quantkit.json.")
TRUST_REMOTE_CODE = flag(bool, False, panel=MODEL, help="Allow custom model code from the model dir.")
OUTPUT = flag(Path, ..., "--output", "-o", panel=MODEL, help="Output directory (must not exist unless --overwrite).")
OVERWRITE = flag(bool, False, panel=MODEL, help="Replace an existing output.")
RECIPE = flag(Optional[str], None, "--recipe", "-r", panel=MODEL, help="Recipe YAML file or bundled recipe name.")
LORA = flag(list[str], [], "--lora", panel=MODEL, help="LoRA adapter dir merged before quantizing; repeatable.")
LORA_WEIGHT = flag(list[float], [], "--lora-weight", panel=MODEL,
                   help="Scale of each adapter's update, one per --lora (default 1.0).")
MERGE_BASE = flag(Optional[str], None, "--merge-base", panel=MODEL,
                  help="QLoRA base: dequantized | original (see quantkit merge --help).")
ORIGINAL_BASE = flag(Optional[str], None, "--original-base", panel=MODEL,
                     help="16-bit original of a QLoRA base (--merge-base original).")
METHOD_NAME = flag(Optional[str], None, "--method", "-m", panel=METHOD,
                   help="fp8 | gptq | awq | autoround | smoothquant | nf4 | gguf | nvfp4 | mxfp4 | mlx | auto (the "
                        "smallest artifact that passes the gate and serves where --for says)")
IGNORE = flag(list[str], [], "--ignore", panel=METHOD, help="Keep modules unquantized (name or re:REGEX); repeatable.")
VISION = flag(Optional[str], None, "--vision", panel=METHOD,
              help="VLM vision encoder: keep (16-bit, default) | int8 | int4 (W/A16; int4 needs --force).")
PROJECTOR = flag(Optional[str], None, "--projector", panel=METHOD,
                 help="VLM projector: keep (16-bit, default) | int8 | int4 (int4 needs --force).")
OFFLOAD_DIR = flag(Optional[str], None, "--offload-dir", panel=RESOURCES,
                   help="Offload decoder layers to disk in this directory while quantizing (gptq/awq/autoround/"
                        "smoothquant/fp8): RAM holds one layer at a time.")
CONTEXT = flag(int, 4096, panel=RESOURCES, help="Tokens of KV cache in the memory estimate.")
DEVICE = flag(Optional[str], None, panel=RESOURCES, help="cpu | cuda | auto")
MAX_MEMORY = flag(Optional[str], None, "--max-memory", panel=RESOURCES,
                  help="Bound the RAM the run may use, e.g. 16GiB: what does not fit under it streams a layer at a "
                       "time, and a bound below even that is refused before work (default: models whole wherever "
                       "they fit the memory available now).")
SEQ_LEN = flag(Optional[int], None, panel=CALIBRATION, help="Tokens per window.", min=8)
SEED = flag(Optional[int], None, panel=CALIBRATION, help="Sampling seed.")
DATA = flag(Optional[str], None, "--data", panel=MEASURED, help="Evaluation text: bundled name, file, or hf:NAME.")
NUM_WINDOWS = flag(Optional[int], None, panel=MEASURED, help="Held-out windows to score.", min=1)


# ------------------------------------------------------------------ groups


@dataclass(frozen=True)
class GateFlags:
    """The gate's thresholds and extra measurements (quantize, eval): fields of the recipe's Gate."""

    max_ppl_increase: Optional[float] = flag(float, panel=GATE, help="Gate: max relative perplexity increase.").field()
    max_kld: Optional[float] = flag(float, panel=GATE, help="Gate: max mean KL divergence.").field()
    min_top1: Optional[float] = flag(float, panel=GATE, help="Gate: min top-1 agreement.").field()
    max_ppl_delta: Optional[float] = flag(
        float, panel=GATE, help="Gate: max absolute perplexity increase (artifact - base).").field()
    tasks: Optional[str] = flag(
        str, None, "--tasks", panel=GATE, metavar="TASK[:METRIC][,...]",
        help="Gate: lm-evaluation-harness tasks whose data is in the local Hugging Face cache, e.g. "
             "hellaswag,arc_easy:acc_norm (needs quantkit[eval]); quantize adds them to the recipe's gate.tasks.").field()
    task_file: list[Path] = flag(
        list[Path], [], "--task-file", panel=GATE,
        help="Gate: a task YAML in lm-eval's format (dataset_path: json, local data_files); repeatable.").field()
    limit: Optional[int] = flag(int, None, "--limit", panel=GATE, min=1,
                                help="Gate: samples per task (gate.task_limit; all without it).").field()
    min_recovery: Optional[float] = flag(
        float, None, "--min-recovery", panel=GATE, min=0,
        help="Gate: artifact task score / base score at least this for --tasks/--task-file (default 0.95).").field()
    flip_prompts: Optional[int] = flag(
        int, None, "--flip-prompts", panel=GATE, min=0,
        help="Gate: greedy continuations of this many held-out prompts, base vs. artifact (the flips metric).").field()
    flip_tokens: Optional[int] = flag(int, None, "--flip-tokens", panel=GATE, min=1,
                                      help="Gate: tokens generated per prompt for flips (default 16).").field()
    max_flips: Optional[float] = flag(
        float, None, "--max-flips", panel=GATE,
        help="Gate: max share of greedy tokens after the first divergence (needs --flip-prompts).").field()

    def gate_fields(self) -> dict[str, Any]:
        """The recipe Gate's fields given (tasks as gate.tasks entries)."""
        from quantkit.run.recipe import cli_tasks

        values = dict(max_ppl_increase=self.max_ppl_increase, max_kld=self.max_kld, min_top1=self.min_top1,
                      max_ppl_delta=self.max_ppl_delta, task_limit=self.limit, flip_prompts=self.flip_prompts,
                      flip_tokens=self.flip_tokens, max_flips=self.max_flips,
                      tasks=cli_tasks(self.tasks, [str(f) for f in self.task_file], self.min_recovery) or None)
        return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class QuantizeGateFlags(GateFlags):
    """The gate as quantize takes it: also the serving check and --no-gate."""

    serve_check: Optional[str] = flag(
        str, None, "--serve-check", panel=GATE, metavar="ENGINE",
        help=f"Gate: also load the staged artifact in the engine that serves it ({engine_choices()}; "
             "scripts/setup_engines.sh installs them) and fail the gate when it reads differently (quantkit "
             "serve-check --help).").field()
    no_gate: bool = flag(bool, False, "--no-gate", panel=GATE,
                         help="Measure but do not enforce the gate (recorded).").field()
    kv_engine: Optional[str] = flag(
        str, None, "--kv-engine", panel=GATE, help="The engine --kv-cache auto targets: vllm | vllm-cpu | llama.cpp "
        "| mlx (default: the artifact's).").field()
    kv_context: Optional[int] = flag(
        int, None, "--kv-context", panel=GATE, min=8,
        help="Tokens per held-out window of the --kv-cache measurement (KV damage grows with context; default: "
             "--seq-len). The base is scored again on these windows, streamed a layer at a time.").field()

    def gate_fields(self) -> dict[str, Any]:
        serve = {"serve": {"engine": self.serve_check}} if self.serve_check else {}
        return {**super().gate_fields(), **serve}


@dataclass(frozen=True)
class HeldOutFlags:
    """Which held-out windows to score (eval, serve-check): None takes the command's default."""

    data: Optional[str] = DATA.field()
    num_windows: Optional[int] = NUM_WINDOWS.field()
    seq_len: Optional[int] = SEQ_LEN.field(panel=MEASURED)
    seed: Optional[int] = SEED.field(panel=MEASURED)


@dataclass(frozen=True)
class CalibrationFlags:
    """The recipe's calibration fields given on quantize's command line."""

    calib: Optional[str] = flag(str, None, "--calib", panel=CALIBRATION,
                                help="Calibration source: bundled name, file, or hf:NAME.").field()
    calib_text_field: Optional[str] = flag(
        str, None, "--calib-text-field", panel=CALIBRATION,
        help="Field holding the text in .jsonl/.json/.parquet/hf: records (default: text).").field()
    num_samples: Optional[int] = flag(int, panel=CALIBRATION, help="Calibration windows.").field()
    seq_len: Optional[int] = SEQ_LEN.field(extra=())
    eval_windows: Optional[int] = flag(int, panel=CALIBRATION, help="Held-out windows for the quality gate.").field()
    seed: Optional[int] = SEED.field()

    def calibration_fields(self) -> dict[str, Any]:
        """The recipe Calibration's fields (None: the recipe's value)."""
        return dict(source=self.calib, text_field=self.calib_text_field, num_samples=self.num_samples,
                    seq_len=self.seq_len, eval_windows=self.eval_windows, seed=self.seed)


@dataclass(frozen=True)
class ResourceFlags:
    """Where quantize runs and how much it may use."""

    device: Optional[str] = DEVICE.field()
    offload_dir: Optional[str] = OFFLOAD_DIR.field()
    dtype: Optional[str] = flag(str, panel=RESOURCES, help="auto | bfloat16 | float16 | float32").field()
    max_memory: Optional[str] = MAX_MEMORY.field()

    def memory_bytes(self) -> int | None:
        """--max-memory in bytes (exit 2 when it does not read as a size)."""
        from quantkit.units import parse_size

        return parse_size(self.max_memory) if self.max_memory else None


@dataclass(frozen=True)
class ReportFlags:
    """What quantize reports, and which targets it runs."""

    json_path: Optional[str] = json_flag("the report").field()
    only: list[str] = flag(list[str], [], "--only", panel=REPORTS, metavar="NAME[,NAME]",
                           help="Run only these targets: NAME[,NAME]; repeatable.").field()
    skip_existing: bool = flag(
        bool, False, "--skip-existing", panel=REPORTS,
        help="Skip a target whose output's quantkit.json shows the same inputs, recipe and quantkit version; re-run "
             "and replace a stale one.").field()
    partial: bool = flag(
        bool, False, "--partial", panel=REPORTS,
        help="Publish the targets that pass; a target that fails or raises does not stop the others (exit code "
             "still non-zero).").field()
    quiet: bool = flag(bool, False, "--quiet", "-q", panel=REPORTS,
                       help="Print only errors and one summary line per target.").field()
    summary: Optional[Path] = flag(Path, None, "--summary", panel=REPORTS, metavar="FILE",
                                   help="Append a Markdown gate table to FILE (e.g. $GITHUB_STEP_SUMMARY).").field()

    def targets(self) -> list[str]:
        """--only's names (each flag a comma-separated list)."""
        return [name.strip() for names in self.only for name in names.split(",") if name.strip()]


def method_flag(annotation, *decls: str, help: str) -> Flag:
    return flag(annotation, None, *decls, help=help, panel=METHOD)


# quantkit.run.recipe.MethodOptions: the method flags, each an option of some methods' Options models.
METHOD_OPTIONS = Lazy("quantkit.run.recipe:MethodOptions", {
    "scheme": method_flag(Optional[str], help="Method scheme: fp8: fp8-dynamic | fp8-static | fp8-block (128x128 "
                          "weight blocks); nvfp4: w4a4 (default) | a16 (weights only)."),
    "bits": method_flag(Optional[int], help="Weight bits (gptq/awq/autoround; mlx: 2 | 3 | 4 | 6 | 8)."),
    "group_size": method_flag(Optional[str], help="gptq/awq/autoround group size: auto (default: the largest of 128, "
                              "64, 32 dividing every layer's input width) | N | -1 (per channel); mlx: 32 | 64 "
                              "(default) | 128."),
    "act_order": method_flag(Optional[str], help="GPTQ activation order: none | static | group."),
    "symmetric": method_flag(Optional[bool], "--symmetric/--asymmetric",
                             help="Integer weights without / with a zero point (gptq/awq/autoround)."),
    "activations": method_flag(Optional[str], "--activations", help="gptq activations: none (W4A16, default) | int8 "
                               "(W4A8 for vLLM's CPU backend) | fp8 (W4A8 for Hopper; group size 128); quantized "
                               "dynamically per token at run time, int4 weights symmetric."),
    "backend": method_flag(Optional[str], help="Engine backend where a method has several."),
    "gguf_type": method_flag(Optional[str], help="GGUF type or mixture, e.g. Q4_K_M, Q6_K, Q8_0, IQ4_XS."),
    "imatrix": method_flag(Optional[str], help="GGUF importance matrix: auto | none | FILE."),
    "mmproj": method_flag(Optional[str], "--mmproj", help="GGUF of a VLM: its vision tower as llama.cpp's mmproj "
                          ".gguf, auto | f16 | bf16 | f32; none = the language model alone (no image input)."),
    "auto_precision": flag(bool, False, "--auto-precision", panel=METHOD, help="Precision chosen per tensor by "
                           "measured sensitivity under a size budget, never exceeded. gguf: the types llama.cpp allows "
                           "for each tensor's rows, at the size of llama.cpp's --gguf-type mixture; gptq, awq: int4, "
                           "int8 or 16-bit per layer at the W4A16 size +5%."),
    "budget_bpw": method_flag(Optional[float], "--budget-bpw", help="--auto-precision budget in bits per weight "
                              "(gguf: of the whole file; gptq, awq: of the quantized layers, scales and zero points "
                              "included)."),
    "fallback": flag(bool, False, "--fallback", panel=METHOD, help="When the gate fails, raise the precision of the "
                     "most damaging tensors and re-measure until it passes or --max-size is reached (gguf: the next "
                     "type; gptq, awq: int4 -> int8 -> 16-bit; fp8, smoothquant, nf4: 16-bit)."),
    "max_size": method_flag(Optional[str], "--max-size", help="--fallback size limit: +N% of the first artifact "
                            "(default +25%) or a size such as 120MB; with --method auto, the artifact's largest "
                            "size (e.g. 4GB)."),
    "smoothing_strength": method_flag(Optional[float], help="SmoothQuant alpha."),
    "preset": method_flag(Optional[str], help="AutoRound preset: default (200 iterations per layer) | light (50)."),
    "iters": method_flag(Optional[int], help="AutoRound tuning iterations per decoder layer (overrides the preset)."),
    "batch_size": method_flag(Optional[int], help="AutoRound calibration windows per tuning step (default 8)."),
    "double_quant": method_flag(Optional[bool], "--double-quant/--no-double-quant", help="NF4 double quantization."),
    "compute_dtype": method_flag(Optional[str], help="NF4 compute dtype."),
    "kv_cache": method_flag(Optional[str], "--kv-cache", help="fp8: calibrated per-layer FP8 k/v scales stored in a "
                            "compressed-tensors artifact (fp8, gptq, nvfp4, mxfp4), served with vLLM's "
                            "--kv-cache-dtype fp8. Any other value is measured by the gate: TYPE[,TYPE...] "
                            "(vllm:turboquant_k3v4_nc, llama.cpp:q8_0/q4_0, mlx:4, ...), auto (the target engine's "
                            "types measured smallest first: the first that passes goes into the serve command) or "
                            "all (every type measured, the smallest passing one chosen)."),
    "rotate": method_flag(Optional[str], "--rotate", help="Rotate before quantizing, through llm-compressor's "
                          "transform modifiers (gptq, autoround, smoothquant, fp8, nvfp4, mxfp4): none (default) | "
                          "hadamard (QuIP: random Hadamard on each quantized Linear's input, applied online by the "
                          "loader) | spinquant (SpinQuant R1+R2, folded into the weights). Refused for gguf, mlx, nf4 "
                          "and awq."),
})
