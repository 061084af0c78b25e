"""Recipes: the validated description of one run (model, calibration, targets, gate).

A recipe is YAML checked by pydantic models with extra="forbid". Each target's `options` are
checked by its method's own `Options` model. CLI flags are applied to the raw data before
validation, so a recipe and its overrides are checked together, before any work starts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quantkit.errors import RecipeError
from quantkit.methods import METHODS, get_method

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Calibration(Strict):
    source: str = Field("default", description="bundled set name, local file, or hf:NAME[:CONFIG][:SPLIT]")
    num_samples: int = Field(64, ge=1, le=100_000)
    seq_len: int = Field(512, ge=8, le=131_072)
    seed: int = 0
    chat_template: bool = True
    text_field: str = "text"
    eval_windows: int = Field(16, ge=0, le=100_000, description="held-out windows for the quality gate")


class Gate(Strict):
    enabled: bool = True
    max_ppl_increase: float | None = Field(None, ge=0, description="relative, 0.05 = +5%")
    max_kld: float | None = Field(None, ge=0)
    min_top1: float | None = Field(None, ge=0, le=1)


class Target(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    method: str
    options: dict[str, Any] = Field(default_factory=dict)
    ignore: list[str] = Field(default_factory=list, description="module names or re:REGEX kept unquantized")
    gate: Gate | None = None

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"unknown method '{value}'; allowed: {', '.join(METHODS)}")
        return value

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


class Recipe(Strict):
    model: str | None = None
    lora: list[str] = Field(default_factory=list)
    trust_remote_code: bool = False
    dtype: str = Field("auto", pattern="^(auto|bfloat16|float16|float32)$")
    device: str = Field("cpu", pattern="^(cpu|cuda|auto)$")
    calibration: Calibration = Field(default_factory=Calibration)
    targets: list[Target] = Field(min_length=1)
    gate: Gate = Field(default_factory=Gate)

    @field_validator("targets")
    @classmethod
    def _unique_names(cls, targets: list[Target]) -> list[Target]:
        names = [t.name for t in targets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"target names must be unique; repeated: {', '.join(duplicates)}")
        return targets


def target_options(target: Target) -> BaseModel:
    """The target's options, validated by its method's Options model."""
    return get_method(target.method).Options.model_validate(target.options)


def target_gate(recipe: Recipe, target: Target) -> Gate:
    """Gate thresholds for a target: method defaults < recipe gate < target gate (set fields win)."""
    method = get_method(target.method)
    defaults = method.default_gate(target_options(target)) if hasattr(method, "default_gate") else method.DEFAULT_GATE
    values = dict(defaults)
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
        raise RecipeError(f"{path}: not valid YAML: {exc}".splitlines()[0]) from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping with a 'targets' list")
    return data


# Sections whose type CLI overrides rely on when merging into raw recipe data.
SECTION_TYPES = {"calibration": dict, "gate": dict, "targets": list, "lora": list}
TARGET_SECTION_TYPES = {"options": dict, "ignore": list, "gate": dict}


def check_structure(data: dict, origin: str = "recipe") -> None:
    """Sections are mappings/lists where a recipe has them (before CLI overrides merge into them)."""
    _check_sections(data, SECTION_TYPES, origin, "")
    for index, target in enumerate(data.get("targets") or []):
        if not isinstance(target, dict):
            raise RecipeError(f"{origin}: targets.{index}: must be a mapping (name, method, options, ...)")
        _check_sections(target, TARGET_SECTION_TYPES, origin, f"targets.{index}.")


def _check_sections(data: dict, types: dict, origin: str, prefix: str) -> None:
    for key, kind in types.items():
        if data.get(key) is not None and not isinstance(data[key], kind):
            what = "a mapping" if kind is dict else "a list"
            raise RecipeError(f"{origin}: {prefix}{key}: must be {what}, not {type(data[key]).__name__}")


def validate(data: dict, origin: str = "recipe") -> Recipe:
    """Validate raw recipe data, including every target's method options."""
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{origin}: {format_errors(exc)}", hint=_hint(exc)) from None
    for index, target in enumerate(recipe.targets):
        try:
            target_options(target)
        except ValidationError as exc:
            prefix = f"targets.{index}.options"
            raise RecipeError(f"{origin}: {format_errors(exc, prefix)}", hint=_hint(exc)) from None
    return recipe


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
    return Path(__file__).resolve().parent.parent / "recipes"


def find_recipe(name_or_path: str) -> Path:
    """A recipe path, or the bundled recipe of that name."""
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".yaml", ".yml"):
        return path
    bundled = bundled_recipes_dir() / f"{name_or_path}.yaml"
    if bundled.is_file():
        return bundled
    raise RecipeError(f"no recipe file or bundled recipe named '{name_or_path}'", hint="quantkit recipes list")
