"""Errors that teach: every QuantkitError a user can meet says what was wrong and carries a hint, the one next
command or change that fixes it. The catalogue is the package's own source: every place that builds one of
quantkit's errors is found with ast and checked, so an error added without a hint fails here."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import quantkit
import quantkit.errors as errors

PACKAGE = Path(quantkit.__file__).parent


def error_classes() -> dict[str, type]:
    """quantkit's error classes by name: those in quantkit.errors and their subclasses elsewhere in the package."""
    found = {name: cls for name, cls in vars(errors).items()
             if isinstance(cls, type) and issubclass(cls, errors.QuantkitError)}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ClassDef) and node.name not in found
                    and any(getattr(b, "id", None) in found for b in node.bases)):
                base = next(found[b.id] for b in node.bases if getattr(b, "id", None) in found)
                found[node.name] = type(node.name, (base,), {})  # the hint rules follow the base's
    return found


def hinted_by_class(cls: type) -> bool:
    """Classes whose every instance gets a hint without the caller giving one: a default hint, or a
    constructor that builds it (MissingExtraError: the pip extra to install)."""
    if cls.default_hint:
        return True
    init = cls.__dict__.get("__init__")
    return init is not None and "hint" not in inspect.signature(init).parameters


def is_none_or_empty(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value is None or (isinstance(node.value, str) and not node.value.strip())
    if isinstance(node, ast.IfExp):
        return is_none_or_empty(node.body) or is_none_or_empty(node.orelse)
    return False


def assignments(scope: ast.AST, name: str) -> list[ast.AST]:
    return [node.value for node in ast.walk(scope) if isinstance(node, ast.Assign)
            for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name) and t.id == name]


def name_may_be_none(name: str, function: ast.AST | None, module: ast.Module) -> bool:
    """A hint passed as a variable: it must be a required argument of the enclosing function, or assigned
    there or at module level, never to None."""
    if function is None:
        assigned = assignments(module, name)
        return not assigned or any(is_none_or_empty(value) for value in assigned)
    args = function.args
    positional = args.posonlyargs + args.args
    required = {a.arg for a in positional[:len(positional) - len(args.defaults)]}
    required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None}
    defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    if name in defaults:
        return is_none_or_empty(defaults[name])
    if name in required:
        return False
    assigned = assignments(function, name) or [node.value for node in module.body if isinstance(node, ast.Assign)
                                               and any(getattr(t, "id", None) == name for t in node.targets)]
    return not assigned or any(is_none_or_empty(value) for value in assigned)


def error_sites() -> list[tuple[str, int, str, ast.Call, ast.AST | None, ast.Module]]:
    """(file, line, class name, the call, its enclosing function, its module) of every place that builds a
    quantkit error."""
    classes = error_classes()
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name not in classes:
                continue
            enclosing = min((f for f in functions if f.lineno <= node.lineno <= f.end_lineno),
                            key=lambda f: f.end_lineno - f.lineno, default=None)
            sites.append((str(path.relative_to(PACKAGE.parent)), node.lineno, name, node, enclosing, tree))
    return sites


def test_the_catalogue_is_the_whole_package():
    """The walk finds the errors users meet most (a guard against a walk that finds nothing)."""
    names = [site[2] for site in error_sites()]
    assert len(names) > 200
    assert {"InputError", "ModelError", "UnsupportedError", "RecipeError", "GateFailedError"} <= set(names)


def test_every_error_a_user_can_meet_has_a_hint():
    classes = error_classes()
    lacking = []
    for path, line, name, call, function, module in error_sites():
        if hinted_by_class(classes[name]):
            continue
        hint = next((k.value for k in call.keywords if k.arg == "hint"), None)
        if any(k.arg is None for k in call.keywords):  # **kwargs: checked where they are built
            continue
        if (hint is None or is_none_or_empty(hint)
                or (isinstance(hint, ast.Name) and name_may_be_none(hint.id, function, module))):
            lacking.append(f"{path}:{line} {name}")
    assert lacking == [], "raise these with hint= (the one next command or change that fixes it)"


def test_no_error_message_is_empty():
    empty = [f"{path}:{line}" for path, line, _, call, _, _ in error_sites()
             if call.args and is_none_or_empty(call.args[0])]
    assert empty == []


def test_internal_errors_say_how_to_report():
    assert "QUANTKIT_DEBUG=1" in errors.InternalError("a check of quantkit's own output failed").hint
    assert errors.InternalError("x", hint="a specific step").hint == "a specific step"
    assert errors.InputError("x").hint is None  # user-facing errors name their own hint at the raise


def test_missing_extra_names_the_install_command():
    exc = errors.MissingExtraError("bitsandbytes", "nf4", "nf4 quantization")
    assert exc.hint == "pip install 'quantkit[nf4]'" and "bitsandbytes" in exc.message


@pytest.mark.parametrize("args, needle", [
    (["quantize", "./no-such-model", "--method", "fp8", "-o", "out"], "hint: give a local checkpoint directory"),
    (["quantize", "./m", "--method", "fp8", "--max-size", "+10%", "-o", "out"], "hint: add --fallback"),
    (["recipes", "show", "no-such-recipe"], "hint: quantkit recipes list"),
])
def test_the_hint_reaches_the_terminal(cli, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    result = cli(*args)
    assert result.exit_code == 2 and needle in result.stderr
