"""Recipes: the validated description of one run (model, calibration, targets, gate).

A recipe is YAML checked by pydantic models with extra="forbid". Each target's `options` are
checked by its method's own `Options` model, once (target_options then returns that object). CLI flags
are applied to the raw data (Overrides) and the method flags (MethodOptions, a typed record) to the
targets whose method has each option, so a recipe and its overrides are checked together, before any
work starts.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from quantkit.errors import InputError, RecipeError, UnsupportedError
from quantkit.eval.tasks import TaskGate
from quantkit.methods import get_method, registered
from quantkit.run.auto import AUTO_GATE, AutoOptions, parse_for
from quantkit.run.auto import AUTO as AUTO_METHOD
from quantkit.serve.engines import AUTO, ENGINES

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Calibration(Strict):
    """What text to use and how to cut it into windows (quantkit.run.calibration.make_windows)."""

    source: str = Field("default", description="bundled set name, local file, or hf:NAME[:CONFIG][:SPLIT]")
    num_samples: int = Field(64, ge=0, le=100_000, description="calibration windows (0: none)")
    seq_len: int = Field(512, ge=8, le=131_072)
    seed: int = 0
    chat_template: bool = True
    text_field: str = "text"
    eval_windows: int = Field(16, ge=0, le=100_000, description="held-out windows for the quality gate")


class ServeGate(Strict):
    """The gate's serving check (quantkit.serve.check): the staged artifact loaded by the engine that serves
    it, as a real server on 127.0.0.1, before anything is published; a failed check fails the gate."""

    engine: str = Field("auto", description="auto (by the artifact's format) or an engine of quantkit.serve.engines")
    windows: int = Field(4, ge=1, le=1024, description="held-out windows sent to the engine (the first of the gate's)")
    logprobs: int = Field(20, ge=0, description="candidates per position asked of the engine (0: the whole vocabulary)")
    max_reading_kld: float = Field(0.02, ge=0, description="KL divergence of the engine from quantkit's reading")
    max_ppl_drift: float = Field(0.05, ge=0, description="|ppl engine / ppl quantkit's reading - 1|")
    min_reading_top1: float | None = Field(None, ge=0, le=1, description="top-1 agreement with quantkit's reading")
    max_base_kld: float | None = Field(None, ge=0, description="KL divergence of the engine from the base "
                                       "(default: the gate's max_kld)")
    concurrency: list[int] = Field(default_factory=lambda: [1], description="load test rounds (concurrent requests)")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value != AUTO and value not in ENGINES:
            raise ValueError(f"unknown engine '{value}'; allowed: {AUTO}, {', '.join(ENGINES)}")
        return value


class Gate(Strict):
    enabled: bool = True
    max_ppl_increase: float | None = Field(None, ge=0, description="relative, 0.05 = +5%")
    max_ppl_delta: float | None = Field(None, ge=0, description="absolute: artifact ppl - base ppl")
    max_kld: float | None = Field(None, ge=0, description="mean KL divergence")
    max_kld_median: float | None = Field(None, ge=0)
    max_kld_p90: float | None = Field(None, ge=0)
    max_kld_p99: float | None = Field(None, ge=0)
    max_kld_max: float | None = Field(None, ge=0)
    max_delta_p: float | None = Field(None, ge=0, le=1, description="mean |Δp| of the token that followed")
    min_top1: float | None = Field(None, ge=0, le=1, description="same top-1 (llama.cpp's same top p)")
    max_flips: float | None = Field(None, ge=0, le=1, description="share of greedy tokens after the first divergence")
    flip_prompts: int = Field(0, ge=0, le=1024, description="held-out prompts generated greedily for `flips`")
    flip_tokens: int = Field(16, ge=1, le=1024, description="tokens generated per prompt for `flips`")
    tasks: list[TaskGate] = Field(default_factory=list, description="lm-eval tasks and their recovery rule")
    task_limit: int | None = Field(None, ge=1, description="samples per task (lm-eval --limit); None: all")
    serve: ServeGate | None = Field(None, description="also check the artifact in the engine that serves it")
    kv_cache: str | None = Field(None, description="KV-cache types measured on the artifact: TYPE[,TYPE...] "
                                 "(vllm:fp8, llama.cpp:q8_0/q4_0, mlx:4, ...), auto (the smallest passing type of "
                                 "the target engine goes into the serve command; measured smallest first, the "
                                 "larger ones not measured) or all (every type measured)")
    kv_engine: str | None = Field(None, description="the engine --kv-cache auto targets: vllm | vllm-cpu | "
                                  "llama.cpp | mlx (default: the artifact's)")
    kv_context: int | None = Field(None, ge=8, description="tokens per held-out window the KV-cache types are "
                                   "measured on (the cache's damage grows with the context); None: the gate's "
                                   "windows (seq_len)")

    @model_validator(mode="after")
    def _flips_need_prompts(self) -> "Gate":
        if self.max_flips is not None and self.flip_prompts == 0:
            raise ValueError("max_flips needs generations: set flip_prompts (command line: --flip-prompts, e.g. 8)")
        return self

    @model_validator(mode="after")
    def _kv_context_needs_types(self) -> "Gate":
        if self.kv_context is not None and self.kv_cache is None:
            raise ValueError("kv_context sets the windows of the KV-cache measurement: set kv_cache too (command "
                             "line: --kv-cache, e.g. auto)")
        return self


HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def check_repo_template(value: str) -> str:
    """A Hub repo id, where `{name}` stands for a target's name."""
    if not HUB_REPO.match(value.replace("{name}", "x")):
        raise ValueError(f"'{value}' is not a Hub repo id org/name ({{name}} is the only placeholder)")
    return value


class Push(Strict):
    """Where the targets that pass are published on the Hugging Face Hub (quantkit.run.push)."""

    repo: str = Field(description="org/name; {name} is each target's name (one repo per target)")
    private: bool = Field(False, description="create a missing repo private")
    subfolders: bool = Field(False, description="every target in its own folder (its name) of the one repo")

    @field_validator("repo")
    @classmethod
    def _repo_id(cls, value: str) -> str:
        return check_repo_template(value)


# A VLM tower's weights in a target: 16-bit (the rule), or round-to-nearest W8A16 / W4A16 on request.
TowerPrecision = Literal["keep", "int8", "int4"]


class Target(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)  # `for:` as written
    name: str = Field(pattern=NAME_PATTERN)
    method: str
    destination: str | None = Field(None, alias="for", description="method auto: where the artifact is served, "
                                    "ENGINE[:DEVICE] (vllm:L4, llama.cpp, mlx:M3-Max-64G, transformers)")
    options: dict[str, Any] = Field(default_factory=dict)
    ignore: list[str] = Field(default_factory=list, description="module names or re:REGEX kept unquantized")
    gate: Gate | None = None
    vision: TowerPrecision = Field("keep", description="a VLM's vision encoder: keep (16-bit), int8 or int4 (W/A16)")
    projector: TowerPrecision = Field("keep", description="a VLM's projector: keep (16-bit), int8 or int4 (W/A16)")
    force: bool = Field(False, description="allow 4-bit towers (recorded in the report and the model card)")
    _options: BaseModel | None = PrivateAttr(None)  # `options` validated by the method's Options model (validate)
    push: bool | str = Field(True, description="false: never pushed; org/name: this target's own repo "
                             "({name}: the target's name); true: as the recipe's `push` says")

    @field_validator("push")
    @classmethod
    def _push_repo(cls, value: bool | str) -> bool | str:
        return check_repo_template(value) if isinstance(value, str) else value

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        known = registered()
        if value not in known and value != AUTO_METHOD:
            raise ValueError(f"unknown method '{value}'; allowed: {', '.join(known)}, auto")
        return value

    @model_validator(mode="after")
    def _auto_has_a_destination(self) -> "Target":
        if self.method != AUTO_METHOD:
            if self.destination is not None:
                raise ValueError(f"`for` ({self.destination}) is where method auto serves its choice; method "
                                 f"{self.method} is already chosen: drop `for`, or set method: auto")
            return self
        if not self.destination:
            raise ValueError("method auto needs `for: ENGINE[:DEVICE]` (command line: --for), e.g. vllm:L4, llama.cpp")
        try:
            parse_for(self.destination, 0)  # the names only: the device's memory is read when the run starts
        except InputError as exc:
            raise ValueError(f"{exc.message} ({exc.hint})") from None
        return self

    @field_validator("ignore")
    @classmethod
    def _valid_patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise ValueError(f"bad regex {pattern!r}: {exc}") from exc
        return patterns

    @model_validator(mode="after")
    def _four_bit_towers_need_force(self) -> "Target":
        four_bit = [role for role, value in self.tower_precision().items() if value == "int4"]
        if four_bit and not self.force:
            raise ValueError(f"{' and '.join(four_bit)}: int4 refused: 4-bit towers lose image understanding "
                             "that the text-only gate cannot measure; set `force: true` (--force) to accept that")
        return self

    def tower_precision(self) -> dict[str, str]:
        """The tower roles this target quantizes, and how: {} keeps every tower 16-bit."""
        return {role: value for role, value in (("vision", self.vision), ("projector", self.projector))
                if value != "keep"}


class Recipe(Strict):
    model: str | None = None
    lora: list[str] = Field(default_factory=list)
    lora_weights: list[float] = Field(default_factory=list, description="one per lora entry; empty: all 1.0")
    merge_base: Literal["dequantized", "original"] = "dequantized"  # for a bitsandbytes (QLoRA) base
    original_base: str | None = Field(None, description="16-bit original of a QLoRA base (merge_base original)")
    trust_remote_code: bool = False
    dtype: str = Field("auto", pattern="^(auto|bfloat16|float16|float32)$")
    device: str = Field("cpu", pattern="^(cpu|cuda|auto)$")
    offload_dir: str | None = Field(None, description="offload decoder layers, embeddings and head to disk here while quantizing")
    max_memory: str | None = Field(None, description="bound the run's peak RAM, e.g. 16GiB: it streams what does not fit "
                                   "under it (default: what is available; --max-memory wins)")
    strict_shapes: bool = Field(False, description="refuse a layer whose widths the format cannot tile, instead of "
                                "keeping it 16-bit")
    resume: bool = Field(False, description="keep the run's progress in its staging directory, and continue an "
                         "interrupted run of the same inputs and recipe from it (quantkit.run.resume)")
    offline: bool = Field(False, description="read a Hub model from the local cache only (as HF_HUB_OFFLINE=1)")
    calibration: Calibration = Field(default_factory=Calibration)
    targets: list[Target] = Field(min_length=1)
    gate: Gate = Field(default_factory=Gate)
    push: Push | None = Field(None, description="publish the targets that pass on the Hub")

    @field_validator("max_memory")
    @classmethod
    def _a_size(cls, value: str | None) -> str | None:
        from quantkit.units import parse_size

        if value is not None:
            try:
                size = parse_size(value)
            except InputError as exc:
                raise ValueError(exc.message) from None
            if size <= 0:
                raise ValueError("max_memory must be a size above 0, e.g. 16GiB")
        return value

    @property
    def max_memory_bytes(self) -> int | None:
        """max_memory in bytes (None: not bounded)."""
        from quantkit.units import parse_size

        return parse_size(self.max_memory) if self.max_memory else None

    @field_validator("targets")
    @classmethod
    def _unique_names(cls, targets: list[Target]) -> list[Target]:
        names = [t.name for t in targets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"target names must be unique; repeated: {', '.join(duplicates)}")
        return targets

    @model_validator(mode="after")
    def _one_repo_per_target(self) -> "Recipe":
        places = push_places(self)
        repos = [repo for repo, subfolder in places.values() if subfolder is None]
        shared = sorted({repo for repo in repos if repos.count(repo) > 1})
        if shared:
            names = [name for name, (repo, _) in places.items() if repo == shared[0]]
            raise ValueError(f"targets {listing(names)} would push to the same repo {shared[0]}: put {{name}} in "
                             "push.repo (one repo per target), or set push.subfolders: true")
        return self


def push_places(recipe: Recipe) -> dict[str, tuple[str, str | None]]:
    """Target name -> (Hub repo, folder in it or None) for every target the recipe pushes: a target's own
    `push: org/name`, else the recipe's push.repo, `{name}` replaced by the target's name."""
    places = {}
    for target in recipe.targets:
        template = target.push if isinstance(target.push, str) else recipe.push.repo if recipe.push else None
        if template is None or target.push is False:
            continue
        subfolder = target.name if recipe.push is not None and recipe.push.subfolders else None
        places[target.name] = (template.replace("{name}", target.name), subfolder)
    return places


def cli_tasks(names: str | None, files: list[str], min_recovery: float | None = None) -> list[dict]:
    """--tasks NAME[:METRIC][,...] and --task-file FILE as gate.tasks entries."""
    extra = {} if min_recovery is None else {"min_recovery": min_recovery}
    entries = []
    for item in [n.strip() for n in (names or "").split(",") if n.strip()]:
        name, _, metric = item.partition(":")
        entries.append({"name": name, **({"metric": metric} if metric else {}), **extra})
    return entries + [{"file": str(f), **extra} for f in files]


def target_options(target: Target) -> BaseModel:
    """The target's options as its method's Options model validated them (once: validate keeps the result);
    method auto's are quantkit.run.auto.AutoOptions."""
    if target._options is None:
        model = AutoOptions if target.method == AUTO_METHOD else get_method(target.method).options
        target._options = model.model_validate(target.options)
    return target._options


def target_gate(recipe: Recipe, target: Target) -> Gate:
    """Gate thresholds for a target: method defaults (method auto: one bar for every candidate, AUTO_GATE) <
    recipe gate < target gate (set fields win)."""
    method = None if target.method == AUTO_METHOD else get_method(target.method)
    values = dict(method.default_gate(target_options(target)) if method else AUTO_GATE)  # never the method's own table
    for layer in (recipe.gate, target.gate):
        if layer is not None:
            values.update(layer.model_dump(exclude_unset=True))
    return Gate(**values)


def load_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}", hint="quantkit recipes list shows the bundled ones")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}".splitlines()[0],
                          hint="quantkit recipes validate FILE points at the line; quantkit recipes show fp8-dynamic "
                               "prints a valid recipe") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping with a 'targets' list",
                          hint="quantkit recipes show fp8-dynamic prints a recipe to start from")
    return data


# Sections whose type CLI overrides rely on when merging into raw recipe data.
SECTION_TYPES = {"calibration": dict, "gate": dict, "targets": list, "lora": list, "lora_weights": list,
                 "push": dict}
TARGET_SECTION_TYPES = {"options": dict, "ignore": list, "gate": dict}


def check_structure(data: dict, origin: str = "recipe") -> None:
    """Sections are mappings/lists where a recipe has them (before CLI overrides merge into them)."""
    _check_sections(data, SECTION_TYPES, origin, "")
    for index, target in enumerate(data.get("targets") or []):
        if not isinstance(target, dict):
            raise RecipeError(f"{origin}: targets.{index}: must be a mapping (name, method, options, ...)",
                              hint="e.g. targets: [{name: fp8, method: fp8}]")
        _check_sections(target, TARGET_SECTION_TYPES, origin, f"targets.{index}.")


def _check_sections(data: dict, types: dict, origin: str, prefix: str) -> None:
    for key, kind in types.items():
        if data.get(key) is not None and not isinstance(data[key], kind):
            what = "a mapping" if kind is dict else "a list"
            raise RecipeError(f"{origin}: {prefix}{key}: must be {what}, not {type(data[key]).__name__}",
                              hint="quantkit recipes show release prints a recipe with every section")


def validate(data: dict, origin: str = "recipe", method_options: MethodOptions | None = None) -> Recipe:
    """Validate raw recipe data, then put the method flags into its targets (apply_method_options), then
    check every target's method options once."""
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{origin}: {format_errors(exc)}", hint=_hint(exc)) from None
    if method_options is not None:
        recipe = apply_method_options(recipe, method_options)
    for index, target in enumerate(recipe.targets):
        check_mixed_precision(target.method, target.options)
        check_rotation(target.method, target.options)
        try:
            target_options(target)
        except ValidationError as exc:
            prefix = f"targets.{index}.options"
            raise RecipeError(f"{origin}: {format_errors(exc, prefix)}", hint=_hint(exc)) from None
    return recipe


# mixed-precision options some methods have: option -> its label in messages
MIXED_PRECISION = {"auto_precision": "--auto-precision / auto_precision", "fallback": "--fallback / fallback"}


def methods_with(option: str) -> list[str]:
    """The methods whose options have `option` (their declared contract says so)."""
    return [name for name in registered() if option in get_method(name).options.model_fields]


def check_mixed_precision(method: str, options: dict) -> None:
    """auto_precision / fallback for a method that has no such option: a clear refusal (exit 2)."""
    for key, label in MIXED_PRECISION.items():
        methods = methods_with(key)
        if key in options and method in registered() and method not in methods:
            raise UnsupportedError(f"{label} is implemented for method {listing(methods)} only, not {method}",
                                   hint=f"use --method {methods[0]}, or drop the option")


def check_rotation(method: str, options: dict) -> None:
    """--rotate / rotate (other than none) for a method that cannot rotate: refused with the method's own
    reason (MethodSpec.rotation_refused, exit 2)."""
    rotating = methods_with("rotate")
    if options.get("rotate", "none") == "none" or method not in registered() or method in rotating:
        return
    raise UnsupportedError(f"--rotate / rotate: method {method} cannot rotate: {get_method(method).rotation_refused}",
                           hint=f"drop --rotate, or use a method that rotates: {listing(rotating)}")


def listing(names) -> str:
    """'a', 'a and b', 'a, b and c'."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def load_recipe(path: str | Path) -> Recipe:
    data = load_yaml(path)
    check_structure(data, str(path))
    return validate(data, origin=str(path))


def format_errors(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem: the field path and what is wrong."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        parts.append(f"{loc or '(top level)'}: {message}")
    return "; ".join(parts)


def _hint(exc: ValidationError) -> str | None:
    err = exc.errors()[0]
    if err["type"] == "extra_forbidden":
        return "check the spelling; `quantkit recipes show fp8-dynamic` prints a complete recipe"
    return None


def bundled_recipes_dir() -> Path:
    """`recipes/` of a source checkout (editable install), else the `quantkit/_recipes` package data."""
    from importlib.resources import files

    package = Path(str(files("quantkit")))
    checkout = package.parent / "recipes"
    if (checkout / "fp8-dynamic.yaml").is_file():
        return checkout
    return package / "_recipes"


def find_recipe(name_or_path: str) -> Path:
    """A recipe path, or the bundled recipe of that name."""
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".yaml", ".yml"):
        return path
    bundled = bundled_recipes_dir() / f"{name_or_path}.yaml"
    if bundled.is_file():
        return bundled
    raise RecipeError(f"no recipe file or bundled recipe named '{name_or_path}'", hint="quantkit recipes list")


# ---------------------------------------------------------------- command-line overrides


@dataclass(frozen=True)
class MethodOptions:
    """Method flags given on the command line (None: not given). Each is a field of some methods' Options
    models (tests/test_recipe.py checks it) and goes into the options of every target whose method has it
    (apply_method_options), where that method's Options model validates it with the rest."""

    scheme: str | None = None
    bits: int | None = None
    group_size: int | str | None = None  # auto or a whole number (a string of digits is read as one)
    act_order: str | None = None
    symmetric: bool | None = None
    activations: str | None = None
    backend: str | None = None
    gguf_type: str | None = None
    imatrix: str | None = None
    mmproj: str | None = None
    auto_precision: bool = False  # with budget_bpw: the auto_precision option
    budget_bpw: float | None = None
    fallback: bool = False  # with max_size: the fallback option
    max_size: str | None = None
    smoothing_strength: float | None = None
    preset: str | None = None
    iters: int | None = None
    batch_size: int | None = None
    double_quant: bool | None = None
    compute_dtype: str | None = None
    kv_cache: str | None = None
    rotate: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.group_size, str) and self.group_size != "auto":
            try:
                object.__setattr__(self, "group_size", int(self.group_size))
            except ValueError:
                raise InputError(f"--group-size {self.group_size}: give auto or a whole number",
                                 hint="e.g. --group-size 64") from None

    def given(self) -> dict[str, Any]:
        """The method option fields given: auto_precision and fallback as the option records they set."""
        values = {k: v for k, v in asdict(self).items()
                  if v is not None and k not in ("auto_precision", "budget_bpw", "fallback", "max_size")}
        if self.auto_precision or self.budget_bpw is not None:
            values["auto_precision"] = {"budget_bpw": self.budget_bpw} if self.budget_bpw is not None else {}
        if self.fallback:
            values["fallback"] = {"max_size": self.max_size} if self.max_size else {}
        elif self.max_size is not None:
            values["max_size"] = self.max_size  # method auto's size limit (AutoOptions.max_size)
        return values


@dataclass
class Overrides:
    """Recipe fields given on the command line; None (or empty) leaves the recipe's value."""

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    offload_dir: str | None = None
    strict_shapes: bool = False
    trust_remote_code: bool = False
    resume: bool = False
    offline: bool = False
    push: dict[str, Any] = field(default_factory=dict)  # Push field (repo, private) -> value
    lora: list[str] = field(default_factory=list)
    lora_weights: list[float] = field(default_factory=list)
    merge_base: str | None = None
    original_base: str | None = None
    ignore: list[str] = field(default_factory=list)
    towers: dict[str, Any] = field(default_factory=dict)  # Target tower field (vision, projector, force) -> value
    calibration: dict[str, Any] = field(default_factory=dict)  # Calibration field -> value
    gate: dict[str, Any] = field(default_factory=dict)  # Gate field -> value
    method_options: MethodOptions = field(default_factory=MethodOptions)
    destinations: list[str] = field(default_factory=list)  # --for: one auto target per destination
    auto: dict[str, Any] = field(default_factory=dict)  # AutoOptions field (context, batch) -> value

    def __post_init__(self) -> None:
        if isinstance(self.method_options, dict):  # a library caller's {field: value}
            self.method_options = MethodOptions(**self.method_options)


def build_recipe(recipe_name: str | None, method: str | None, overrides: Overrides) -> Recipe:
    """Recipe data (a file, a bundled name, or a single --method target), overrides applied,
    validated as one."""
    if recipe_name:
        path = find_recipe(recipe_name)
        data, origin = load_yaml(path), str(path)
        check_structure(data, origin)
    elif method:
        data, origin = {"targets": [{"name": method, "method": method}]}, "command line"
    else:
        raise InputError("give --method or --recipe", hint="e.g. quantkit quantize ./model --method fp8 -o ./out")
    if method and recipe_name:
        data = override_method(data, method)
    data = apply_overrides(data, overrides)
    if not data.get("model"):
        raise InputError("no model given", hint="pass MODEL, or set `model:` in the recipe")
    return validate(data, origin, overrides.method_options)


def override_method(data: dict, method: str) -> dict:
    targets = data.get("targets") or []
    if len(targets) != 1:
        raise InputError("--method cannot override a recipe with several targets", hint="edit the recipe instead")
    return {**data, "targets": [{**targets[0], "method": method, "options": {}}]}


def apply_overrides(data: dict, o: Overrides) -> dict:
    data = {**data, **_given({"model": o.model, "device": o.device, "dtype": o.dtype, "offload_dir": o.offload_dir,
                              "merge_base": o.merge_base, "original_base": o.original_base})}
    if o.trust_remote_code:
        data["trust_remote_code"] = True
    if o.strict_shapes:
        data["strict_shapes"] = True
    if o.resume:
        data["resume"] = True
    if o.offline:
        data["offline"] = True
    if _given(o.push):
        if not o.push.get("repo") and not isinstance(data.get("push"), dict):
            raise InputError("--private sets the visibility of a repo quantkit creates to push to",
                             hint="add --push-to-hub org/name, or a `push:` block to the recipe")
        data["push"] = {**(data.get("push") or {}), **_given(o.push)}
    if o.lora:
        data["lora"] = list(data.get("lora") or []) + list(o.lora)
    if o.lora_weights:
        data["lora_weights"] = list(data.get("lora_weights") or []) + list(o.lora_weights)
    data["calibration"] = {**(data.get("calibration") or {}), **_given(o.calibration)}
    gate = {**(data.get("gate") or {}), **_given({k: v for k, v in o.gate.items() if k not in ("tasks", "serve")})}
    if o.gate.get("serve"):  # --serve-check ENGINE: the recipe's serve block, if any, with that engine
        gate["serve"] = {**(gate.get("serve") or {}), **o.gate["serve"]}
    if o.gate.get("tasks"):  # appended to the recipe's tasks
        gate["tasks"] = list(gate.get("tasks") or []) + list(o.gate["tasks"])
    data["gate"] = gate
    if o.ignore:
        data["targets"] = [{**t, "ignore": list(t.get("ignore") or []) + list(o.ignore)}
                           for t in data.get("targets") or []]
    if _given(o.towers):
        data["targets"] = [{**t, **_given(o.towers)} for t in data.get("targets") or []]
    if o.destinations or _given(o.auto):
        data["targets"] = auto_targets(data.get("targets") or [], o.destinations, _given(o.auto))
    return data


def auto_targets(targets: list[dict], destinations: list[str], fields: dict[str, Any]) -> list[dict]:
    """--for and --context/--batch into the method auto targets: one target per destination (named after it
    where there are several), the others left as they are."""
    if not any(t.get("method") == AUTO_METHOD for t in targets):
        flags = "--for" if destinations else "--context / --batch"
        raise InputError(f"{flags}: where and how method auto serves its choice; no target has method auto",
                         hint="add --method auto (or set `method: auto` in the recipe)")
    expanded = []
    for target in targets:
        if target.get("method") != AUTO_METHOD:
            expanded.append(target)
            continue
        options = {**(target.get("options") or {}), **fields}
        places = destinations or [target.get("for")]
        for place in places:
            name = target["name"] if len(places) == 1 else f"{target['name']}-{str(place).replace(':', '-')}"
            expanded.append({**target, "name": name, "for": place, "options": options})
    return expanded


def apply_method_options(recipe: Recipe, flags: MethodOptions) -> Recipe:
    """Put method flags into the options of every target whose method has that option; a mixed-precision or
    rotate flag that a target's method refuses, or a flag that no target's method has, is an error."""
    given = flags.given()
    if not given:
        return recipe
    check_auto_flags(recipe, given)
    for target in recipe.targets:
        check_mixed_precision(target.method, {k: v for k, v in given.items() if k in MIXED_PRECISION})
        check_rotation(target.method, {k: v for k, v in given.items() if k == "rotate"})
    options = [dict(t.options) for t in recipe.targets]
    for flag, value in given.items():
        takers = [i for i, t in enumerate(recipe.targets) if flag in option_fields(t.method)]
        if not takers and flag == "max_size":
            raise InputError("--max-size is the --fallback size limit (or method auto's)", hint="add --fallback")
        if not takers:
            methods = ", ".join(sorted({t.method for t in recipe.targets}))
            raise InputError(f"--{flag.replace('_', '-')} does not apply to method {methods}",
                             hint="quantkit quantize --help says which methods take each option; drop it, or choose "
                                  "such a --method")
        for i in takers:
            current = options[i].get(flag)
            options[i][flag] = {**current, **value} if isinstance(current, dict) and isinstance(value, dict) else value
    targets = [t.model_copy(update={"options": o}) for t, o in zip(recipe.targets, options)]
    return recipe.model_copy(update={"targets": targets})


def option_fields(method: str) -> dict:
    """The option fields of a target's method (method auto's: AutoOptions)."""
    return (AutoOptions if method == AUTO_METHOD else get_method(method).options).model_fields


def check_auto_flags(recipe: Recipe, given: dict[str, Any]) -> None:
    """Method auto chooses the method and its options: a method flag beside it is a conflict (exit 2)."""
    if not any(t.method == AUTO_METHOD for t in recipe.targets):
        return
    conflict = [flag for flag in given if flag not in AutoOptions.model_fields]
    if conflict:
        flags = ", ".join(f"--{flag.replace('_', '-')}" for flag in conflict)
        raise InputError(f"{flags}: method auto chooses the method and its options itself",
                         hint="drop the flag, or name the method (--method gptq ...); --max-size, --context and "
                              "--batch bound the choice")


def _given(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}
