"""The method contract, and the static name -> module map through which methods are imported lazily.

Each method module (fp8, gptq, awq, autoround, smoothquant, nf4, gguf, nvfp4, mxfp4, mlx) ends with one declaration,

    METHOD = MethodSpec(name=..., engine=..., engine_package=..., format=..., options=Options,
                        quantize=quantize, precision=precision, default_gate=..., ...)

and is light enough to import without torch (heavy imports happen inside its functions).
`MethodSpec` below names every member a method provides, required and optional, with the
defaults for the optional ones in one place. Who calls what:

  member             called by                                    when
  options            recipe.validate, cli.inspect                 validating a target's `options`
  resolve            pipeline.resolve_target, cli.inspect         options completed for the model (group_size auto)
  check              pipeline.prepare                             before any model is loaded
  needs_calibration  pipeline.resolve_target                      deciding whether to cut calibration windows
  needs_model        pipeline.resolve_target, cli.inspect         deciding whether to load the model in memory
  default_gate       pipeline.resolve_target (recipe.target_gate) the gate thresholds of a target
  keeps_lm_head      pipeline.resolve_target, cli.inspect         building the ignore list
  supports_ignore    pipeline.resolve_target                      refusing `ignore` where a format fixes every type
  check_ignore       pipeline.resolve_target                      refusing an ignore list the engine cannot take
  shape_problems     pipeline.resolve_target, cli.inspect         layers whose widths the format cannot tile (kept 16-bit)
  precision          plan.build_plan                              the plan (`quantkit inspect`, the report)
  plan_types         plan.build_plan                              exact per-tensor types (gguf's mixture)
  fallback_ladder    pipeline.run_fallback                        the units a failed gate raises (quantkit.mixed.budget.Ladder)
  requantize         pipeline.run_fallback                        writing the artifact again with a per-unit plan
  artifact           preflight, report, pipeline                  the artifact's kind: how the gate reads it back
  stored_bits        preflight                                    disk and memory estimates of the artifact
  working_set        preflight                                    memory the method's own work holds
  distributed        engines.llmcompressor.distributed            whether a torchrun launch may run it
  support            run.support                                  README's family x method tables
  tower_proof        pipeline.tower_proof                         proving a VLM artifact's towers (gguf: its mmproj)
  precision_bits     run.serving                                  bits of one plan entry's precision (gguf: its ggml type)
  runtimes           run.serving (quantkit plan, model cards)     which runtime and kernel serve the artifact, where
  scheme_runtimes    runtimes_for (cli.inspect, run.serving)      the runtimes of one scheme of the method
  serve_command      run.serving                                  the command line that serves the artifact
  quantize           pipeline.run_target                          writing the artifact into a staging dir
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from pydantic import BaseModel

from quantkit.engines.llmcompressor.distributed import Ranks
from quantkit.errors import InputError

if TYPE_CHECKING:
    from quantkit.arch.families import Family
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
        emptied too), the reference gone, the freed memory handed back to the OS."""
        import gc

        from quantkit.engines.transformers import drop_weights
        from quantkit.io.memory import release_freed_memory

        if self.model is None:
            return
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
    resume_dir: Path | None = None  # --resume: where the method keeps its progress (MethodSpec.resume_unit); None: it keeps none

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


def _no_working_set(info: ModelInfo, options: BaseModel) -> int:
    return 0


def _supports_every_family(family: Family) -> str:
    return family.kept()


@dataclass(frozen=True)
class Runtime:
    """One way to serve a method's artifact: the runtime and its kernel, the device kinds it runs on
    ("cuda", "apple", "cpu"), the CUDA compute capabilities the kernel runs on, where that is stated, and the
    widths of a Linear ([out, in]) the kernel takes: multiples of out_multiple and in_multiple."""

    name: str
    kinds: tuple[str, ...]
    min_capability: float = 0.0
    source: str = ""
    out_multiple: int = 1
    in_multiple: int = 1
    max_capability: float = 0.0  # the newest compute capability the kernel runs on (0: no limit)

    def serves(self, kind: str, capability: float = 0.0) -> bool:
        newest = self.max_capability or capability
        return kind in self.kinds and (kind != "cuda" or self.min_capability <= capability <= newest)

    def accepts(self, shape: list[int]) -> bool:
        """Whether the kernel takes a Linear of this [out, in] shape."""
        return shape[0] % self.out_multiple == 0 and shape[1] % self.in_multiple == 0


def vllm_serve(path: str) -> str:
    return f"vllm serve {path}"


@dataclass(frozen=True)
class MethodSpec:
    """Every member a method provides. Required members first; the rest default as shown."""

    name: str
    engine: str  # the library that does the work, for reports ("llmcompressor")
    engine_package: str  # distribution whose version is reported ("llmcompressor", "quantkit")
    format: str  # the artifact format written
    options: type[BaseModel]  # the method's recipe options (extra="forbid")
    quantize: Callable[[QuantizeJob], QuantizeResult]
    # precision(role, options, module name, shape) -> text such as "int4 g128 sym (GPTQ)", or
    # None: that role stays in the model's 16-bit dtype.
    precision: Callable[[str, BaseModel, str, list[int]], str | None]
    default_gate: Callable[[BaseModel], GateDefaults]
    # resolve(info, options) -> (options, notes): choices left to the model made (gptq's group_size auto),
    # with a line per choice for the report and the model card saying what was chosen and why
    resolve: Callable[[ModelInfo, BaseModel], tuple[BaseModel, dict[str, str]]] = _as_given
    check: Callable[[ModelInfo, BaseModel, Calibration], None] = _no_check  # cheap, before any work
    # check_ignore(info, options, full ignore list): refuse, before any work, an ignore list the engine
    # cannot take (awq: a smoothing row whose balance layers would all stay 16-bit)
    check_ignore: Callable[[ModelInfo, BaseModel, list[str]], None] = _any_ignore
    # shape_problems(info, options, full ignore list) -> {layer: why}: the quantized layers whose widths the
    # format's blocks or groups cannot tile (fp8-block, FP4 groups, an explicit int group size). The pipeline
    # keeps them 16-bit and lists them, or refuses the first with --strict-shapes.
    shape_problems: Callable[[ModelInfo, BaseModel, list[str]], dict[str, str]] = _every_shape_tiles
    needs_calibration: Callable[[BaseModel], bool] = _never
    # needs_model(info, options) -> True: quantize() gets the model (and tokenizer) loaded in memory;
    # False: it reads the checkpoint itself. Cheap (config.json and safetensors headers, no torch).
    needs_model: Callable[[ModelInfo, BaseModel], bool] = _loads_model
    # True: lm_head stays 16-bit (added to the ignore list); a format that types lm_head itself says False.
    keeps_lm_head: Callable[[BaseModel], bool] = _always
    supports_ignore: bool = True  # False: the format decides every tensor's type (gguf mixtures)
    quantizes_towers: bool = False  # True: takes a target's `vision`/`projector` int8/int4 (llmc.tower_modifiers)
    # A method that rotates has a `rotate` option (llmc.Rotate: llm-compressor's transform modifiers before it
    # quantizes); for the others, why --rotate is refused (recipe.check_rotation, exit 2 before any work)
    rotation_refused: str = "its engine does not run llm-compressor's transform modifiers"
    # Exact per-module precision for the whole model where one tensor's type depends on the others
    # (gguf: llama-quantize's mixture rules); {} where `precision` alone is exact.
    plan_types: Callable[[ModelInfo, BaseModel], dict[str, str]] = _no_exact_types
    # Gate-driven fallback (a method whose options have `fallback`; the loop is quantkit.run.pipeline.run_fallback):
    # fallback_ladder(job, first result) -> quantkit.mixed.budget.Ladder: the units, their precisions in the
    # artifact, their candidates, damages and bytes; requantize(job, plan, details) writes the artifact
    # again into job.out_dir with a per-unit plan ({unit name: precision}), `details` its report fields.
    fallback_ladder: Callable[[QuantizeJob, QuantizeResult], Ladder] | None = None
    requantize: Callable[[QuantizeJob, dict[str, str], dict], QuantizeResult] | None = None
    # How the gate reads the artifact back: "compressed-tensors" (streamed for a text decoder, else
    # loaded whole), "bitsandbytes" (loaded whole by transformers), "gguf" (streamed in float32),
    # "mlx" (an mlx-lm directory, dequantized as mlx does and streamed in its stored dtype).
    artifact: str = "compressed-tensors"
    # stored_bits(options) -> bits per quantized weight in the artifact, scales included (roughly)
    stored_bits: Callable[[BaseModel], float] = lambda options: 8.0
    # working_set(info, options) -> bytes the method's own work holds beyond the model it had loaded
    # (GPTQ's Hessians; fp8's model-free slabs, where it loads no model)
    working_set: Callable[[ModelInfo, BaseModel], int] = _no_working_set
    distributed: bool = False  # True: one target may run on several torchrun ranks
    # --resume (quantkit.run.resume): what an interrupted run continues from ("the last written tensor"), the
    # method keeping its progress in job.resume_dir; None: the method does not resume (refused before work)
    resume_unit: str | None = None
    # resume_bytes(info, options, tokens) -> disk its saved progress takes beyond the artifact (preflight), for
    # `tokens` calibration tokens (the sequential methods save the hidden states after each layer)
    resume_bytes: Callable[[ModelInfo, BaseModel, int], int] = lambda info, options, tokens: 0
    # resume_refused(info, options) -> why a target of a method that resumes does not with these options (fp8:
    # only its model-free path saves progress); None: it resumes
    resume_refused: Callable[[ModelInfo, BaseModel], str | None] = lambda info, options: None
    # ranks_refused(options) -> why a target with these options runs in one process only (None: it may run
    # on ranks where `distributed`): the reason the torchrun refusal names (quantkit.engines.llmcompressor.distributed)
    ranks_refused: Callable[[BaseModel], str | None] = lambda options: None
    # support(family) -> "✅ ..." or "refused: why": what the method does with a family of
    # quantkit.arch.families, as its check() decides (README's tables)
    support: Callable[[Family], str] = _supports_every_family
    # tower_proof(job, result) -> report fields proving a VLM artifact's towers (exit 3 otherwise);
    # None: the pipeline reloads a checkpoint directory (quantkit.eval.vlm_proof.prove_towers)
    tower_proof: Callable[[QuantizeJob, QuantizeResult], dict] | None = None
    # precision_bits(options, precision) -> bits per weight of a plan entry's precision string, scales
    # included; None: stored_bits(options) for every quantized entry
    precision_bits: Callable[[BaseModel, str], float] | None = None
    runtimes: tuple[Runtime, ...] = ()  # in order of preference: the first that runs on a device serves there
    # scheme_runtimes(options) -> the runtimes of the options' scheme (a weight-only scheme has fewer
    # kernels); None: `runtimes` for every scheme. Read through `runtimes_for`.
    scheme_runtimes: Callable[[BaseModel], tuple[Runtime, ...]] | None = None
    serve_command: Callable[[str], str] = vllm_serve  # serve_command(artifact path) -> a command line


def runtimes_for(method: MethodSpec, options: BaseModel) -> tuple[Runtime, ...]:
    """The runtimes that serve the method's artifact with these options (its scheme's)."""
    return method.scheme_runtimes(options) if method.scheme_runtimes else method.runtimes


def fixed_gate(thresholds: GateDefaults) -> Callable[[BaseModel], GateDefaults]:
    """default_gate for a method whose thresholds do not depend on its options."""
    return lambda options: dict(thresholds)


def check_method_name(name: str) -> str:
    if name not in METHODS:
        raise InputError(
            f"unknown method '{name}'",
            hint="choose one of: " + ", ".join(METHODS),
        )
    return name


def get_method(name: str) -> MethodSpec:
    """The method's declaration; a method whose module is not written yet fails loudly."""
    check_method_name(name)
    try:
        module = importlib.import_module(METHODS[name])
    except ModuleNotFoundError as exc:
        if exc.name == METHODS[name]:
            raise InputError(f"method '{name}' is not available in this version of quantkit",
                             hint="pip install -e . again to bring the install in line with the source; quantkit "
                                  "quantize --help lists the methods") from exc
        raise
    return module.METHOD
