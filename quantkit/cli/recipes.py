"""`quantkit recipes list|show|validate`."""

from __future__ import annotations

import typer

from quantkit.cli.common import handle_errors, out

app = typer.Typer(help="Bundled recipes: list them, print one, validate a recipe file.", no_args_is_help=True)


@app.command("list")
@handle_errors
def list_recipes() -> None:
    """List the bundled recipes.

    Examples:

      quantkit recipes list

      quantkit quantize ./my-model --recipe w4a16-gptq -o ./gptq   (use one by name)
    """
    import yaml

    from quantkit.run.recipe import bundled_recipes_dir

    for path in sorted(bundled_recipes_dir().glob("*.yaml")):
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        methods = ", ".join(f"{t.get('name')}:{t.get('method')}" for t in data.get("targets", []))
        out.print(f"{path.stem:22} {methods:32} {summary(text)}", highlight=False)


def summary(text: str) -> str:
    """The recipe's first comment line (its one-line description)."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


@app.command("show")
@handle_errors
def show(name: str = typer.Argument(..., help="Bundled recipe name or file.")) -> None:
    """Print a recipe.

    Examples:

      quantkit recipes show fp8-dynamic

      quantkit recipes show release > my-release.yaml   (a starting point for your own)
    """
    from quantkit.run.recipe import find_recipe

    path = find_recipe(name)
    if not path.is_file():
        from quantkit.errors import RecipeError

        raise RecipeError(f"recipe file not found: {path}",
                          hint="quantkit recipes list shows the bundled names; or give the path of a .yaml file")
    out.print(path.read_text(), highlight=False, markup=False, end="")


@app.command("validate")
@handle_errors
def validate_cmd(files: list[str] = typer.Argument(..., help="Recipe files to check.")) -> None:
    """Check recipe files against the schema (and every target's method options).

    Examples:

      quantkit recipes validate recipes/fp8-dynamic.yaml

      quantkit recipes validate ci/*.yaml   (every recipe of a repository, in CI)
    """
    from quantkit.run.recipe import find_recipe, load_recipe

    for name in files:
        recipe = load_recipe(find_recipe(name))
        targets = ", ".join(f"{t.name} ({t.method})" for t in recipe.targets)
        out.print(f"ok: {name}: {targets}", highlight=False)
