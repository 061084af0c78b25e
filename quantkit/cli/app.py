"""The `quantkit` command. Subcommands live one per module and import heavy libraries lazily,
so `quantkit --help` stays fast and never imports torch."""

from __future__ import annotations

import typer

from quantkit import __version__
from quantkit.cli import eval as eval_cmd
from quantkit.cli import inspect as inspect_cmd
from quantkit.cli import merge as merge_cmd
from quantkit.cli import plan as plan_cmd
from quantkit.cli import push as push_cmd
from quantkit.cli import quantize as quantize_cmd
from quantkit.cli import recipes as recipes_cmd
from quantkit.cli import serve_check as serve_check_cmd
from quantkit.cli.common import PanelledCommand

app = typer.Typer(
    name="quantkit",
    help="Quantize and convert Hugging Face LLMs and VLMs into deployable artifacts, "
    "each checked by a perplexity/KL quality gate before it is written.\n\n"
    "Examples:\n\n"
    "  quantkit quantize ./my-model --method fp8 -o ./my-model-fp8\n\n"
    "  quantkit quantize --recipe recipes/fp8-dynamic.yaml --model ./ckpt -o ./dist --json report.json\n\n"
    "  quantkit inspect ./my-model --method fp8\n\n"
    "  quantkit eval ./my-model-fp8 --against ./my-model\n\n"
    "  quantkit serve-check ./my-model-fp8     (served by vLLM, measured from its own log-probs)\n\n"
    "  quantkit merge ./base --lora ./adapter -o ./merged\n\n"
    "  quantkit plan ./my-model --gpu L4 --context 8192\n\n"
    "  quantkit push ./my-model-fp8 my-org/my-model-fp8     (a passing artifact to the Hub)\n\n"
    "Exit codes: 0 ok, 1 internal error, 2 bad input, 3 quality gate failed, 129 hung up (SIGHUP), "
    "130 interrupted (Ctrl-C), 143 terminated (SIGTERM).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantkit {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """quantkit: quantization toolkit and model converter."""


app.command("quantize", no_args_is_help=True, cls=PanelledCommand)(quantize_cmd.quantize)
app.command("inspect", no_args_is_help=True, cls=PanelledCommand)(inspect_cmd.inspect)
app.command("eval", no_args_is_help=True, cls=PanelledCommand)(eval_cmd.eval_command)
app.command("serve-check", no_args_is_help=True, cls=PanelledCommand)(serve_check_cmd.serve_check_command)
app.command("merge", no_args_is_help=True, cls=PanelledCommand)(merge_cmd.merge)
app.command("plan", no_args_is_help=True, cls=PanelledCommand)(plan_cmd.plan)
app.command("push", no_args_is_help=True, cls=PanelledCommand)(push_cmd.push_command)
app.add_typer(recipes_cmd.app, name="recipes")


def main() -> None:
    app()
