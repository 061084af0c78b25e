import json


def test_inspect_table(cli, micro_model):
    result = cli("inspect", micro_model)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "LlamaForCausalLM" in text and "modules by role" in text and "estimated memory" in text
    assert "model.layers.{i}.self_attn.q_proj" in text and "fp8-e4m3" in text


def test_inspect_json_lists_every_linear(cli, micro_model):
    result = cli("inspect", micro_model, "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    names = {m["name"] for m in data["modules"]}
    assert "lm_head" in names and "model.layers.1.mlp.down_proj" in names
    assert len([n for n in names if ".layers." in n]) == 2 * 7
    assert data["roles"]["decoder"]["modules"] == 14
    assert set(data["memory"]) >= {"FP16/BF16", "FP8 (E4M3, per-channel)", "INT8 (per-channel)",
                                   "INT4 (group 128)", "NF4 (double quant)", "GGUF Q4_K_M"}


def test_inspect_with_recipe_and_ignore(cli, micro_model):
    result = cli("inspect", micro_model, "--recipe", "fp8-dynamic", "--ignore", "re:.*down_proj", "--json", "-")
    data = json.loads(result.stdout)
    kept = [m["name"] for m in data["modules"] if "ignore pattern" in m["precision"]]
    assert sorted(kept) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


def test_inspect_bad_model(cli, tmp_path):
    result = cli("inspect", tmp_path)
    assert result.exit_code == 2 and "no config.json" in result.stderr
