"""The shape of quantkit's code, measured: lines per package, the imports between its layers (import
circles and back-arrows), and the branches on method, format or engine names outside the modules that own
those names.

    python scripts/structure.py            # a table
    python scripts/structure.py --json -   # the numbers as JSON

Imports are read with ast from every module, at module level and inside functions (a lazy import is still
a dependency). A module's layer is its package under quantkit/ (quantkit/errors.py: "errors"); LAYERS lists
them from the bottom up, and an import from a layer to one above it is a back-arrow. A circle is a cycle
of imports between quantkit modules (strongly connected components of the module graph).

A name branch is a comparison (==, !=, in, not in) with a string literal, or a tuple, list or set of string
literals, that names a method, an artifact format or a serving engine (NAMES), or a dict literal keyed by
such names whose value is looked up by one (a dispatch table). Comparisons of other `kind`s that happen to
share no such name (rope kinds, tokenizer normalizers, CUDA device kinds) are not counted; "fp8" the
KV-cache dtype or a CLI value that happens to equal a method name still is, which is why the count is
reported per line for review.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

# From the bottom up: a module may import from its own layer and the layers before it.
LAYERS = ("__init__", "errors", "units", "arch", "io", "gguf", "mlx", "engines", "eval", "formats", "mixed", "methods",
          "serve", "run", "toy", "toy_moe", "cli", "__main__")
METHOD_NAMES = {"fp8", "gptq", "awq", "autoround", "smoothquant", "nf4", "gguf", "nvfp4", "mxfp4", "mlx"}
FORMAT_NAMES = {"compressed-tensors", "bitsandbytes", "gguf", "mlx", "transformers"}
ENGINE_NAMES = {"vllm", "llama.cpp", "mlx"}
NAMES = METHOD_NAMES | FORMAT_NAMES | ENGINE_NAMES
OWNERS = ("quantkit/methods/", "quantkit/formats/")  # where branching on these names is the point


def modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module of the package at root (quantkit/)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The quantkit modules a module imports, anywhere in it (module level or inside functions); `from
    quantkit.x import y` counts as quantkit.x.y when that is a module, else quantkit.x."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return {m for m in (nearest(f, known) for f in found) if m and m != name}


def nearest(name: str, known: set[str]) -> str | None:
    """The longest known module name that `name` is or lies inside."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def graph(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imported(path, name, set(mods)) for name, path in mods.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def back_arrows(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) where the imported module's layer comes after the importer's in LAYERS."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if rank.get(layer(b), len(LAYERS)) > rank.get(layer(a), len(LAYERS)))


def unknown_layers(edges: dict[str, set[str]]) -> list[str]:
    return sorted({layer(m) for m in edges} - set(LAYERS))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan), or a module
    importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def literal_names(node: ast.AST) -> set[str]:
    """The strings of a string literal, or of a tuple/list/set of string literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return set(items) if len(items) == len(node.elts) else set()
    return set()


def name_branches(path: Path) -> list[tuple[int, str, str]]:
    """(line, "engine" or "method/format", text) of the comparisons with a method, format or engine name, and
    of the dict literals keyed only by such names (dispatch tables), in one file. A hit whose names are all
    engine names, one of them vllm or llama.cpp, is an engine branch; any other a method/format branch ("mlx"
    and "gguf" name a method, a format and, for mlx, an engine)."""
    source = path.read_text()
    lines = source.splitlines()
    found: dict[int, set[str]] = {}
    for node in ast.walk(ast.parse(source, str(path))):
        names: set[str] = set()
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            names = set().union(*(literal_names(side) & NAMES for side in [node.left, *node.comparators]))
        elif isinstance(node, ast.Dict) and node.keys and all(k is not None for k in node.keys):
            keys = set().union(*(literal_names(k) for k in node.keys))
            if len(keys) == len(node.keys) and keys <= NAMES and len(keys) > 1:
                names = keys
        if names:
            found.setdefault(node.lineno, set()).update(names)
    return [(n, kind_of(names), lines[n - 1].strip()) for n, names in sorted(found.items())]


def kind_of(names: set[str]) -> str:
    return "engine" if names <= ENGINE_NAMES and names & {"vllm", "llama.cpp"} else "method/format"


def branches_outside_owners(root: Path) -> dict[str, list[tuple[int, str, str]]]:
    repo = root.parent
    result = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(repo).as_posix()
        if rel.startswith(OWNERS):
            continue
        hits = name_branches(path)
        if hits:
            result[rel] = hits
    return result


def lines_per_package(root: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        key = rel[0] if len(rel) > 1 else "(top-level modules)"
        counts[key] = counts.get(key, 0) + len(path.read_text().splitlines())
    return dict(sorted(counts.items()))


def measure(root: Path) -> dict:
    edges = graph(root)
    branches = branches_outside_owners(root)
    return {"lines": lines_per_package(root), "total_lines": sum(lines_per_package(root).values()),
            "circles": circles(edges), "back_arrows": back_arrows(edges), "unknown_layers": unknown_layers(edges),
            "name_branches": {f: [f"{n}: [{kind}] {t}" for n, kind, t in hits] for f, hits in branches.items()},
            "method_format_branches": sum(kind != "engine" for h in branches.values() for _n, kind, _t in h),
            "engine_branches": sum(kind == "engine" for h in branches.values() for _n, kind, _t in h)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "quantkit")
    parser.add_argument("--json", dest="json_path", help="Write the numbers as JSON to FILE ('-': stdout).")
    args = parser.parse_args(argv)
    data = measure(args.root)
    if args.json_path:
        text = json.dumps(data, indent=1)
        if args.json_path == "-":
            print(text)
        else:
            Path(args.json_path).write_text(text + "\n")
        return 0
    for package, n in data["lines"].items():
        print(f"{package:22} {n:6}")
    print(f"{'total':22} {data['total_lines']:6}")
    print(f"import circles: {len(data['circles'])}" + "".join(f"\n  {' <-> '.join(c)}" for c in data["circles"]))
    print(f"back-arrows: {len(data['back_arrows'])}" + "".join(f"\n  {a} -> {b}" for a, b in data["back_arrows"]))
    print(f"branches on method/format names outside {', '.join(OWNERS)}: {data['method_format_branches']}; "
          f"on engine names: {data['engine_branches']}")
    for file, hits in data["name_branches"].items():
        for hit in hits:
            print(f"  {file}:{hit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
