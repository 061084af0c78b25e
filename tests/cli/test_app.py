import subprocess
import sys


def test_help_does_not_import_torch():
    code = ("import sys; from quantkit.cli.app import app\n"
            "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'llmcompressor', 'numpy', 'matplotlib') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out and "quantize" in out


def test_version(cli):
    from quantkit import __version__

    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"quantkit {__version__}"


COMMANDS = (["quantize"], ["inspect"], ["eval"], ["serve-check"], ["merge"], ["plan"], ["push"], ["recipes", "list"],
            ["recipes", "validate"], ["recipes", "show"])


def test_every_command_opens_with_examples(cli):
    """The help's first paragraph is one line on what the command does; examples come next, before the
    long explanation and the options."""
    for command in COMMANDS:
        result = cli(*command, "--help")
        assert result.exit_code == 0, command
        text = result.stdout.split("\n\n", 1)[1]  # after the usage line
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        assert any(p.startswith("Example") for p in paragraphs[1:3]), (command, paragraphs[:3])
        examples = [line for line in text.splitlines() if line.strip().startswith("quantkit " + " ".join(command))]
        assert examples, command


def test_options_are_grouped_into_panels(cli):
    """Every option of the commands with many options sits in a named panel, and the panels show as sections."""
    from typer.main import get_command

    from quantkit.cli.app import app
    from quantkit.cli.common import PANELS

    root = get_command(app)
    for name in ("quantize", "inspect", "eval", "serve-check", "merge", "plan"):
        command = root.commands[name]
        loose = [param.opts[0] for param in command.params
                 if param.param_type_name == "option" and param.name != "help"
                 and getattr(param, "rich_help_panel", None) not in PANELS]
        assert loose == [], name
    text = cli("quantize", "--help").stdout
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    shown = headings[headings.index("Arguments"):]
    assert shown == ["Arguments", *[p for p in PANELS if p in headings], "Other options"]
    assert text.index("\n  --calib ") > text.index("\nCalibration:") > text.index("\nModel and output:")


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "quantkit", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("quantkit ")


def test_usage_error_exit_code(cli):
    result = cli("quantize", "--no-such-flag")
    assert result.exit_code == 2
