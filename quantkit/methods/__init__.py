"""The method contract, and the registry through which methods are imported lazily.

Each method module (fp8, gptq, awq, autoround, smoothquant, nf4, gguf, nvfp4, mxfp4, mlx) ends with one declaration,

    METHOD = MethodSpec(name=..., format=compressed_tensors.FORMAT, label=..., scheme=..., engine=...,
                        options=Options, quantize=quantize, precision=precision, default_gate=..., ...)

and is light enough to import without torch (heavy imports happen inside its functions). `MethodSpec` holds
what every method has; what only some methods do is a small record they fill (Layers, Sizes, FallbackSteps, Resume,
OnRanks, Towers), each member described where it is declared. Who calls what:

  member             called by                                    when
  name, label        pipeline, report                             the report's method and format text
  format             formats.gate, preflight, report, serving     what the artifact is: read back, served (quantkit.formats)
  scheme             runtimes_for (cli.inspect, run.serving)      the options' scheme within the format (its runtimes)
  engine             report                                       the library that does the work, and its version
  options            recipe.validate, cli.inspect                 validating a target's `options`
  resolve            pipeline.resolve_target, cli.inspect         options completed for the model (group_size auto)
  check              pipeline.prepare                             before any model is loaded
  needs_calibration  pipeline.resolve_target                      deciding whether to cut calibration windows
  needs_model        pipeline.resolve_target, cli.inspect         deciding whether to load the model in memory
  default_gate       pipeline.resolve_target (recipe.target_gate) the gate thresholds of a target
  precision          plan.build_plan                              the plan (`quantkit inspect`, the report)
  support            run.support                                  README's family x method tables
  rotation_refused   recipe.check_rotation                        refusing --rotate (a method with no `rotate` option)
  quantize           pipeline.run_target                          writing the artifact into a staging dir
  layers             pipeline.resolve_target, plan, cli.inspect   lm_head, ignore lists, widths, exact types (Layers)
  sizes              preflight, run.serving                       disk and memory estimates (Sizes)
  fallback           run.fallback                                 the gate-driven fallback's units and rewrite (FallbackSteps)
  resume             run.resume, preflight                        --resume: what it continues from (Resume)
  ranks              engines.llmcompressor.distributed            whether a torchrun launch may run it (OnRanks)
  towers             pipeline                                     a VLM's towers: quantized, proved (Towers)
  auto               run.auto                                     the artifacts --method auto may choose (AutoRung)

The registry: METHODS (name -> module) and the methods other packages declare under the entry-point group
`quantkit.methods` (a name -> "module:METHOD"); `get_method` imports one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from pydantic import BaseModel

from quantkit.engines.llmcompressor.distributed import Ranks
from quantkit.errors import InputError
from quantkit.formats import Format, Runtime

if TYPE_CHECKING:
    from quantkit.arch.families import TextRow, VlmRow
    from quantkit.engines.transformers import Offload
    from quantkit.eval.windows import TokenWindows
    from quantkit.io.checkpoint import ModelInfo
    from quantkit.mixed.budget import Ladder

METHODS: dict[str, str] = {
    "fp8": "quantkit.methods.fp8",
    "gptq": "quantkit.methods.gptq",
    "awq": "quantkit.methods.awq",
    "autoround": "quantkit.methods.autoround",
    "smoothquant": "quantkit.methods.smoothquant",
    "nf4": "quantkit.methods.nf4",
    "gguf": "quantkit.methods.gguf",
    "nvfp4": "quantkit.methods.nvfp4",
    "mxfp4": "quantkit.methods.mxfp4",
    "mlx": "quantkit.methods.mlx",
}

ENTRY_POINTS = "quantkit.methods"  # the entry-point group of the methods other packages declare
GateDefaults = dict[str, float]  # Gate field -> threshold, e.g. {"max_kld": 0.01}


class Calibration(Protocol):
    """The run's calibration settings a method's check reads (the recipe's `calibration`)."""

    num_samples: int
    seq_len: int


@dataclass
class ModelHandle:
    """The full-precision model and tokenizer one target works on, loaded at most once at a time.
    The run owns its lifetime: the pipeline loads the model before `quantize` when the method's
    `needs_model` says so and frees it before the gate; a method that finds late that it needs the
    model calls QuantizeJob.load_model, and a fallback step that quantizes again works on a fresh
    handle it frees itself (quantkit.engines.llmcompressor.llmc.reloaded_model)."""

    model: Any = None
    tokenizer: Any = None

    def free(self) -> None:
        """Drop the loaded model: its weights to the meta device (llm-compressor's offload caches
        emptied too), the reference gone; and whether one was loaded or not, what the step left (a method's
        own forwards: cycles, the heap's free pages) collected and handed back to the OS."""
        import gc

        from quantkit.engines.transformers import drop_weights
        from quantkit.io.memory import release_freed_memory

        if self.model is not None:
            drop_weights(self.model)
            self.model = None
        gc.collect()
        release_freed_memory()


def streamed_placement():
    """quantkit.eval.scorers.STREAMED (imported when a job is made: `quantkit --help` imports no torch)."""
    from quantkit.eval.scorers import STREAMED

    return STREAMED


@dataclass(frozen=True)
class QuantizeJob:
    """Everything a method gets for one target, fixed for the run; the method saves its artifact into
    out_dir. `handle` holds the model the run loaded for it (ModelHandle); `model` and `tokenizer`
    read it (None when the method's `needs_model` said no: the method reads the checkpoint at
    `info.path` itself). `windows` is None when no target of the run uses calibration or evaluation
    windows; `windows.calib` is empty unless the method said it needs calibration.
    """

    info: ModelInfo
    options: BaseModel
    windows: TokenWindows | None
    ignore: list[str]
    out_dir: Path
    workdir: Path
    dtype: str = "auto"  # the recipe's dtype for loading (auto: the checkpoint's)
    device: str = "cpu"
    trust_remote_code: bool = False
    towers: dict[str, str] = field(default_factory=dict)  # tower role -> int8/int4 (Target.tower_precision())
    offload: Offload | None = None  # what the model is loaded with on disk, and where (quantkit.engines.transformers.Offload)
    ranks: Ranks = Ranks()  # under torchrun: this rank's share of the windows; only rank 0 saves (quantkit.engines.llmcompressor.distributed)
    progress: Callable[[str], None] = lambda message: None  # one line per phase of a long step (the CLI shows it)
    handle: ModelHandle = field(default_factory=ModelHandle)
    placement: Any = field(default_factory=streamed_placement)  # where quantkit's own forwards run (quantkit.eval.scorers.Placement)
    resume_dir: Path | None = None  # --resume: where the method keeps its progress (MethodSpec.resume); None: it keeps none

    @property
    def model(self) -> Any:
        return self.handle.model

    @property
    def tokenizer(self) -> Any:
        return self.handle.tokenizer

    def load_model(self, offload: Offload | None) -> Any:
        """The full-precision model in the handle (loaded now unless it is there), the modules `offload`
        names on disk, and its tokenizer."""
        from quantkit.engines.transformers import load_model, load_tokenizer

        if self.handle.model is None:
            where = "decoder layers, embeddings and head" if offload and offload.layers else "embeddings and head"
            self.progress(f"loading {self.info.path}" + (f" ({where} offloaded to {offload.folder})" if offload else ""))
            device = "cpu" if self.placement.onload else self.device  # llm-compressor onloads layers to the GPU
            self.handle.model = load_model(self.info, self.dtype, device, self.trust_remote_code, offload)
        if self.handle.tokenizer is None:
            self.handle.tokenizer = load_tokenizer(self.info, self.trust_remote_code)
        return self.handle.model

    def free_model(self) -> None:
        self.handle.free()


@dataclass
class QuantizeResult:
    """What a method returns: where the artifact to measure is, and method-specific report fields."""

    artifact: Path  # the directory or file the gate loads back (gguf: the .gguf inside out_dir)
    details: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable, copied into the report


def _no_check(info: ModelInfo, options: BaseModel, calibration: Calibration) -> None:
    return None


def _any_ignore(info: ModelInfo, options: BaseModel, ignore: list[str]) -> None:
    return None


def _every_shape_tiles(info: ModelInfo, options: BaseModel, ignore: list[str]) -> dict[str, str]:
    return {}


def _never(options: BaseModel) -> bool:
    return False


def _always(options: BaseModel) -> bool:
    return True


def _loads_model(info: ModelInfo, options: BaseModel) -> bool:
    return True


def _as_given(info: ModelInfo, options: BaseModel) -> tuple[BaseModel, dict[str, str]]:
    return options, {}


def _no_exact_types(info: ModelInfo, options: BaseModel) -> dict[str, str]:
    return {}


def _keeps_fused_experts(info: ModelInfo, options: BaseModel) -> bool:
    return False


def _no_working_set(info: ModelInfo, options: BaseModel) -> int:
    return 0


def _eight_bits(options: BaseModel) -> float:
    return 8.0


def _supports_every_family(family: TextRow | VlmRow) -> str:
    return family.kept()


def _resumes(info: ModelInfo, options: BaseModel) -> str | None:
    return None


def _saves_nothing(info: ModelInfo, options: BaseModel, calibration: Calibration) -> int:
    return 0


def _on_every_rank(options: BaseModel) -> str | None:
    return None


@dataclass(frozen=True)
class Layers:
    """Which layers a method quantizes beyond its `precision`, for the methods whose format decides more."""

    # keeps_lm_head(options) -> True: lm_head stays 16-bit (added to the ignore list); a format that types
    # lm_head itself (gguf's mixture, mlx) says False
    keeps_lm_head: Callable[[BaseModel], bool] = _always
    takes_ignore: bool = True  # False: the format decides every tensor's type (gguf mixtures): `ignore` refused
    # check_ignore(info, options, full ignore list): refuse, before any work, an ignore list the engine
    # cannot take (awq: a smoothing row whose balance layers would all stay 16-bit)
    check_ignore: Callable[[ModelInfo, BaseModel, list[str]], None] = _any_ignore
    # shape_problems(info, options, full ignore list) -> {layer: why}: the quantized layers whose widths the
    # format's blocks or groups cannot tile (fp8-block, FP4 groups, an explicit int group size). The pipeline
    # keeps them 16-bit and lists them, or refuses the first with --strict-shapes.
    shape_problems: Callable[[ModelInfo, BaseModel, list[str]], dict[str, str]] = _every_shape_tiles
    # exact_types(info, options) -> exact per-module precision for the whole model where one tensor's type
    # depends on the others (gguf: llama-quantize's mixture rules); {} where `precision` alone is exact
    exact_types: Callable[[ModelInfo, BaseModel], dict[str, str]] = _no_exact_types
    # quantizes_fused_experts(info, options) -> True: the artifact quantizes the routed experts a checkpoint stores
    # fused across experts (GPT-OSS, Llama 4, Granite 4), and the plan has one weight per expert projection for them
    # (quantkit.arch.moe.fused_expert_linears); False: they stay 16-bit (the default). Asked only of such checkpoints.
    quantizes_fused_experts: Callable[[ModelInfo, BaseModel], bool] = _keeps_fused_experts


@dataclass(frozen=True)
class Sizes:
    """What the artifact and the method's work take, for the preflight and the serving plan."""

    # stored_bits(options) -> bits per quantized weight in the artifact, scales included (roughly)
    stored_bits: Callable[[BaseModel], float] = _eight_bits
    # working_set(info, options) -> bytes the method's own work holds beyond the model it had loaded
    # (GPTQ's Hessians; fp8's model-free slabs, where it loads no model)
    working_set: Callable[[ModelInfo, BaseModel], int] = _no_working_set
    # precision_bits(options, precision) -> bits per weight of a plan entry's precision string, scales
    # included (gguf: its ggml type); None: stored_bits(options) for every quantized entry
    precision_bits: Callable[[BaseModel, str], float] | None = None


@dataclass(frozen=True)
class FallbackSteps:
    """The gate-driven fallback of a method whose options have `fallback` (the loop: quantkit.run.fallback)."""

    # ladder(job, first result) -> quantkit.mixed.budget.Ladder: the units, their precisions in the artifact,
    # their candidates, damages and bytes
    ladder: Callable[[QuantizeJob, QuantizeResult], Ladder]
    # requantize(job, plan, details) writes the artifact again into job.out_dir with a per-unit plan
    # ({unit name: precision}), `details` its report fields
    requantize: Callable[[QuantizeJob, dict[str, str], dict], QuantizeResult]


@dataclass(frozen=True)
class Resume:
    """--resume (quantkit.run.resume): the method keeps its progress in job.resume_dir."""

    unit: str  # what an interrupted run continues from ("the last written tensor")
    # refused(info, options) -> why a target with these options does not resume (fp8: only its model-free path
    # saves progress); None: it resumes
    refused: Callable[[ModelInfo, BaseModel], str | None] = _resumes
    # bytes(info, options, calibration) -> disk its saved progress takes beyond the artifact (preflight), for the
    # run's calibration windows (num_samples x seq_len: the sequential methods save what each layer's inputs are)
    bytes: Callable[[ModelInfo, BaseModel, Calibration], int] = _saves_nothing


@dataclass(frozen=True)
class AutoRung:
    """One artifact `--method auto` may choose (quantkit.run.auto): its name in the ladder and the method's options
    that write it. Rungs of one chain differ only in precision, and a larger one is assumed to measure no worse
    than a smaller one, so a reading of one settles the others on its side."""

    label: str
    options: tuple[tuple[str, Any], ...] = ()
    chain: str = ""  # "": a chain of its own


@dataclass(frozen=True)
class OnRanks:
    """How a method meets a torchrun launch (quantkit.engines.llmcompressor.distributed)."""

    # refused(options) -> why a target with these options runs in one process only, the reason the refusal
    # names; None: it runs on several ranks. A one-process engine (nf4, gguf, mlx) answers its reason for every
    # options, so the refusal says why.
    refused: Callable[[BaseModel], str | None] = _on_every_rank


@dataclass(frozen=True)
class Towers:
    """What a method does with a VLM's towers beyond keeping them 16-bit and proving them after reload."""

    quantizes: bool = False  # True: takes a target's `vision`/`projector` int8/int4 (llmc.tower_modifiers)
    # proof(job, result) -> report fields proving the artifact's towers (exit 3 otherwise); None: the pipeline
    # reloads a checkpoint directory (quantkit.eval.vlm_proof.prove_towers). gguf proves its mmproj file.
    proof: Callable[[QuantizeJob, QuantizeResult], dict] | None = None


@dataclass(frozen=True)
class MethodSpec:
    """What every method has; required members first, the rest default as shown. The records at the end are
    filled by the methods that need them."""

    name: str
    format: Format  # the artifact format written (quantkit.formats: how the gate reads it, who serves it)
    label: str  # the format in the method's words, for reports ("compressed-tensors (pack-quantized, int weights)")
    scheme: Callable[[BaseModel], str]  # scheme(options) -> the options' scheme within the format (its runtimes)
    engine: str  # the library that does the work, for reports ("llmcompressor")
    options: type[BaseModel]  # the method's recipe options (extra="forbid"; every field has a default)
    quantize: Callable[[QuantizeJob], QuantizeResult]  # writes the artifact into job.out_dir
    # precision(role, options, module name, shape) -> text such as "int4 g128 sym (GPTQ)", or
    # None: that role stays in the model's 16-bit dtype.
    precision: Callable[[str, BaseModel, str, list[int]], str | None]
    default_gate: Callable[[BaseModel], GateDefaults]  # the gate's thresholds for these options
    engine_package: str = ""  # the distribution whose version is reported ("quantkit"); "": `engine`
    # resolve(info, options) -> (options, notes): choices left to the model made (gptq's group_size auto),
    # with a line per choice for the report and the model card saying what was chosen and why
    resolve: Callable[[ModelInfo, BaseModel], tuple[BaseModel, dict[str, str]]] = _as_given
    check: Callable[[ModelInfo, BaseModel, Calibration], None] = _no_check  # cheap, before any work
    needs_calibration: Callable[[BaseModel], bool] = _never  # needs_calibration(options)
    # needs_model(info, options) -> True: quantize() gets the model (and tokenizer) loaded in memory;
    # False: it reads the checkpoint itself. Cheap (config.json and safetensors headers, no torch).
    needs_model: Callable[[ModelInfo, BaseModel], bool] = _loads_model
    # support(family) -> "✅ ..." or "refused: why": what the method does with a family of
    # quantkit.arch.families, as its check() decides (README's tables)
    support: Callable[[TextRow | VlmRow], str] = _supports_every_family
    # A method that rotates has a `rotate` option (llmc.Rotate: llm-compressor's transform modifiers before it
    # quantizes); for the others, why --rotate is refused (recipe.check_rotation, exit 2 before any work)
    rotation_refused: str = "its engine does not run llm-compressor's transform modifiers"
    layers: Layers = Layers()
    sizes: Sizes = Sizes()
    fallback: FallbackSteps | None = None  # exactly the methods whose options have `fallback`
    resume: Resume | None = None  # None: --resume is refused before any work
    ranks: OnRanks | None = None  # None: runs in one process only (refused on ranks without a reason)
    towers: Towers = Towers()
    auto: tuple[AutoRung, ...] = ()  # the artifacts --method auto may choose, in the method's order

    @property
    def package(self) -> str:
        """The distribution whose version the report records."""
        return self.engine_package or self.engine


def runtimes_for(method: MethodSpec, options: BaseModel) -> tuple[Runtime, ...]:
    """The runtimes that serve the method's artifact with these options (its format's, for its scheme)."""
    return method.format.runtimes(method.scheme(options))


def ignore_patterns(info: ModelInfo, user_ignore: list[str], keep_lm_head: bool = True,
                    quantized_towers: tuple[str, ...] = ()) -> list[str]:
    """The `ignore` list a method gets (QuantizeJob.ignore; llm-compressor's semantics): lm_head (when kept), every
    VLM tower component (the component itself and everything under it: a projector that is a single Linear, the
    Linear subclasses inside a tower such as nn.MultiheadAttention's out_proj) but those of the roles in
    `quantized_towers`, the MoE routers present in this model, then the user's patterns."""
    import re

    from quantkit.arch.roles import INNER_ROUTER_PATTERN, ROUTER_PATTERN, classify, matches
    from quantkit.arch.vlm import component_pattern, ignore_pattern

    patterns = ["lm_head"] if keep_lm_head else []
    present = {component for _role, component in info.towers.components
               if any(re.search(component_pattern(component), name) for name in info.tensors)}
    quantized = [c for role, c in info.towers.components if role in quantized_towers]
    patterns += [ignore_pattern(c, tuple(q[len(c) + 1:] for q in quantized if q.startswith(c + ".")))
                 for role, c in info.towers.components if c in present and role not in quantized_towers]
    routers = [name for name in info.tensors if classify(name, info.towers) == "router"]
    for pattern in (ROUTER_PATTERN, INNER_ROUTER_PATTERN):
        if any(matches(name.removesuffix(".weight"), [pattern]) for name in routers):
            patterns.append(pattern)
    return patterns + [p for p in user_ignore if p not in patterns]


def on_ranks(method: MethodSpec, options: BaseModel) -> tuple[bool, str | None]:
    """(whether the method declares how it meets torchrun ranks, why these options run in one process: None where
    they run on several ranks)."""
    return method.ranks is not None, method.ranks.refused(options) if method.ranks else None


def fixed_gate(thresholds: GateDefaults) -> Callable[[BaseModel], GateDefaults]:
    """default_gate for a method whose thresholds do not depend on its options."""
    return lambda options: dict(thresholds)


def registered() -> dict[str, str]:
    """name -> "module:METHOD" of every method: the built-in ones (METHODS), then those other packages declare
    under the entry-point group `quantkit.methods` (a built-in name is never replaced)."""
    from importlib.metadata import entry_points

    found = {name: f"{module}:METHOD" for name, module in METHODS.items()}
    for point in sorted(entry_points(group=ENTRY_POINTS), key=lambda p: p.name):
        found.setdefault(point.name, point.value)
    return found


def check_method_name(name: str) -> str:
    if name not in METHODS and name not in registered():
        raise InputError(
            f"unknown method '{name}'",
            hint="choose one of: " + ", ".join(registered()),
        )
    return name


def get_method(name: str) -> MethodSpec:
    """The method's declaration; a method whose module is not written yet fails loudly."""
    check_method_name(name)
    reference = f"{METHODS[name]}:METHOD" if name in METHODS else registered()[name]
    module_name, _, attribute = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise InputError(f"method '{name}' is not available in this version of quantkit",
                             hint="pip install -e . again to bring the install in line with the source; quantkit "
                                  "quantize --help lists the methods") from exc
        raise
    return getattr(module, attribute)
