"""Options declared once (quantkit.cli.options): the groups' flags name their records' fields, a group shared
by two commands reads the same in both, and each command gets one record per group."""

import pytest
from typer.main import get_command

from quantkit.cli import options
from quantkit.cli.app import app


def command(name: str):
    return get_command(app).commands[name]


def help_records(name: str) -> dict[str, tuple]:
    """Each option of a command: its first name -> (help line, panel)."""
    ctx = command(name).make_context(name, ["--help"], resilient_parsing=True)
    return {p.opts[0]: (p.get_help_record(ctx), getattr(p, "rich_help_panel", None))
            for p in command(name).params if p.param_type_name == "option"}


def test_library_records_and_their_flags_name_the_same_fields():
    from quantkit.cli.serve_check import TOLERANCES

    for group in (options.METHOD_OPTIONS, TOLERANCES):
        assert group.load()  # raises TypeError naming the fields that differ


def test_a_lazy_group_whose_flags_miss_a_field_is_refused():
    broken = options.Lazy("quantkit.serve.check:Tolerances", {"max_reading_kld": options.SEED})
    with pytest.raises(TypeError, match="max_base_kld"):
        broken.load()


def test_the_gate_group_reads_the_same_in_quantize_and_eval():
    gate = [name for name, _ in options.group_flags(options.GateFlags)]
    quantize, evaluate = help_records("quantize"), help_records("eval")
    flags = [f"--{name.replace('_', '-')}" for name in gate]
    assert len(flags) == 11 and all(quantize[f] == evaluate[f] for f in flags)


def test_the_engine_choices_come_from_the_registry():
    from quantkit.serve.engines import ENGINES

    names = " | ".join(("auto", *ENGINES))
    assert names in help_records("serve-check")["--engine"][0][1]
    assert names in " ".join(help_records("quantize")["--serve-check"][0][1].split())


def test_each_group_becomes_one_record(monkeypatch):
    """quantize's callback receives one typed record per group, built from its flags."""
    from quantkit.cli import quantize
    from quantkit.run.recipe import MethodOptions

    seen = {}

    def fake_parse(model, source, target, method_options, calibration, gate, resources, reports, log):
        seen.update(source=source, target=target, options=method_options, calibration=calibration, gate=gate,
                    resources=resources, reports=reports)
        raise SystemExit(0)

    monkeypatch.setattr(quantize, "parse", fake_parse)
    from typer.testing import CliRunner

    CliRunner().invoke(app, ["quantize", "m", "--method", "gptq", "--group-size", "64", "--fallback", "--max-size",
                             "+10%", "--seq-len", "128", "--max-kld", "0.1", "--tasks", "arc_easy", "--only", "a,b",
                             "--device", "cpu", "-o", "out"])
    assert seen["target"].method == "gptq" and str(seen["source"].output) == "out"
    assert seen["options"] == MethodOptions(group_size=64, fallback=True, max_size="+10%")
    assert seen["options"].given() == {"group_size": 64, "fallback": {"max_size": "+10%"}}
    assert seen["calibration"].calibration_fields()["seq_len"] == 128
    assert seen["gate"].gate_fields() == {"max_kld": 0.1, "tasks": [{"name": "arc_easy"}]}
    assert seen["reports"].targets() == ["a", "b"] and seen["resources"].device == "cpu"


@pytest.mark.parametrize("args, message", [
    (["--group-size", "big"], "--group-size big: give auto or a whole number"),
    (["--max-size", "+10%"], "--max-size is the --fallback size limit"),
    (["--concurrency", "1,x"], "--concurrency takes positive integers separated by commas"),
])
def test_a_record_refuses_what_it_cannot_read(cli, tmp_path, args, message):
    name = "serve-check" if args[0] == "--concurrency" else "quantize"
    rest = [tmp_path] if name == "serve-check" else [tmp_path, "--method", "gptq", "-o", tmp_path / "out"]
    result = cli(name, *rest, *args)
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
