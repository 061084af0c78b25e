def test_list_shows_bundled(cli):
    result = cli("recipes", "list")
    assert result.exit_code == 0 and "fp8-dynamic" in result.stdout
    assert "FP8 E4M3 with per-channel weight scales" in result.stdout  # the description line


def test_show_prints_yaml(cli):
    result = cli("recipes", "show", "fp8-dynamic")
    assert result.exit_code == 0 and "method: fp8" in result.stdout


def test_validate_ok_and_bad(cli, tmp_path):
    assert cli("recipes", "validate", "fp8-dynamic").exit_code == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets:\n  - name: a\n    method: fp8\n    options: {scheme: fp9}\n")
    result = cli("recipes", "validate", bad)
    assert result.exit_code == 2
    assert "targets.0.options.scheme" in result.stderr and "fp8-dynamic" in result.stderr


def test_show_unknown(cli):
    result = cli("recipes", "show", "nope")
    assert result.exit_code == 2 and "quantkit recipes list" in result.stderr
