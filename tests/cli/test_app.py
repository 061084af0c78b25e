import subprocess
import sys


def test_help_does_not_import_torch():
    code = ("import sys; from quantkit.cli.app import app\n"
            "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'llmcompressor', 'numpy') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out and "quantize" in out


def test_version(cli):
    from quantkit import __version__

    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"quantkit {__version__}"


def test_every_command_has_examples(cli):
    for command in (["quantize"], ["inspect"], ["eval"], ["recipes", "validate"], ["recipes", "show"]):
        result = cli(*command, "--help")
        assert result.exit_code == 0
        assert "Example" in result.stdout, command


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "quantkit", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("quantkit ")


def test_usage_error_exit_code(cli):
    result = cli("quantize", "--no-such-flag")
    assert result.exit_code == 2
