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
    from quantkit.methods import METHODS

    assert list(data["memory"]) == ["source", *METHODS]  # each method's default artifact, as `quantkit plan`
    plan = json.loads(cli("plan", micro_model, "--json", "-").stdout)
    assert {r["method"]: r["weights_bytes"] for r in plan["formats"]} == {
        name: row["weights_bytes"] for name, row in data["memory"].items()}


def test_inspect_estimates_the_run_as_quantize_would_preflight_it(cli, micro_model, tmp_path):
    """The run estimate is the preflight's (quantkit.run.preflight), with --offload-dir as quantize takes it:
    gptq's quantize step then holds the norms and the larger of a table and a layer with its Hessians."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import ram_estimate
    from quantkit.run.recipe import Overrides, build_recipe

    info = check_model_dir(micro_model)
    for offload in (None, str(tmp_path)):
        extra = ("--offload-dir", offload) if offload else ()
        result = cli("inspect", micro_model, "--method", "gptq", "--json", "-", *extra)
        assert result.exit_code == 0, result.output
        run = json.loads(result.stdout)["run"]
        recipe = build_recipe(None, "gptq", Overrides(model=str(micro_model), offload_dir=offload))
        _info, targets, placement = prepare(recipe, RunOptions(model=str(micro_model), out=tmp_path / "x"))
        assert run["offload_dir"] == offload and run["ram_steps"] == ram_estimate(info, recipe, targets, placement).steps
        assert run["gate"].startswith(f"gate: {'resident' if placement.resident else 'streamed'} on cpu")
    assert list(tmp_path.iterdir()) == []  # inspect writes nothing there
    text = cli("inspect", micro_model, "--method", "gptq", "--offload-dir", tmp_path).stdout
    assert "quantize run (default calibration, --offload-dir)" in text and "on this machine, gate: " in text


def test_inspect_with_recipe_and_ignore(cli, micro_model):
    result = cli("inspect", micro_model, "--recipe", "fp8-dynamic", "--ignore", "re:.*down_proj", "--json", "-")
    data = json.loads(result.stdout)
    kept = [m["name"] for m in data["modules"] if "ignore pattern" in m["precision"]]
    assert sorted(kept) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


def test_inspect_bad_model(cli, tmp_path):
    result = cli("inspect", tmp_path)
    assert result.exit_code == 2 and "no config.json" in result.stderr


def test_inspect_names_the_kernels_that_take_each_layer(cli, micro_model):
    """From the format's runtimes table (quantkit.formats.Runtime): nvfp4 W4A4 layers on the Blackwell FP4 kernels
    and Marlin FP4; a16 on Marlin FP4 only; a kept layer on none."""
    data = json.loads(cli("inspect", micro_model, "--method", "nvfp4", "--json", "-").stdout)
    layers = {m["name"]: m for m in data["modules"]}
    assert layers["model.layers.0.mlp.down_proj"]["kernels"] == [
        "vLLM: NVFP4 W4A4 (CUTLASS FP4) (sm 10+)", "vLLM: Marlin FP4, weights only (sm 7.5+)"]
    assert layers["lm_head"]["kernels"] == [] and layers["lm_head"]["kept"]
    assert all(r["source"] for r in data["runtimes"]) and "nvfp4" in data["memory"]
    from quantkit.cli.inspect import kernels
    from quantkit.methods import nvfp4, runtimes_for

    a16, w4a4 = (runtimes_for(nvfp4.METHOD, nvfp4.Options(scheme=scheme)) for scheme in ("a16", "w4a4"))
    assert kernels(a16, [256, 512]) == ["vLLM: Marlin FP4, weights only (sm 7.5+)"]
    assert kernels(w4a4, [96, 256]) == ["vLLM: NVFP4 W4A4 (CUTLASS FP4) (sm 10+)"]  # Marlin: out % 64


def test_inspect_leaves_out_the_cpu_kernels_of_quantized_experts(cli, micro_model, tmp_path):
    """vLLM's CPU kernels serve no mixture of experts whose experts are quantized: an MoE model's gptq layers list
    the GPU kernels only, a dense model's the CPU one too."""
    from tests.families import test_moe

    moe = test_moe.build(tmp_path / "qwen3_moe", "qwen3_moe")
    dense, experts = (json.loads(cli("inspect", m, "--method", "gptq", "--json", "-").stdout) for m in (micro_model, moe))
    assert "vLLM CPU backend: WNA16" in [r["name"] for r in dense["runtimes"]]
    assert [r["name"] for r in experts["runtimes"]] == ["vLLM: Machete WNA16", "vLLM: Marlin WNA16"]
    layer = next(m for m in experts["modules"] if m["name"] == "model.layers.0.mlp.experts.1.down_proj")
    assert layer["kernels"] == ["vLLM: Machete WNA16 (sm 9+)", "vLLM: Marlin WNA16 (sm 7.5+)"]


def test_inspect_drops_a_kernel_whose_tiles_do_not_fit(odd_model, cli):
    """fp8-block on hidden 192: the block kernels take no layer reading the hidden state (128 does not divide it)."""
    data = json.loads(cli("inspect", odd_model, "--method", "fp8", "--json", "-").stdout)
    assert all(m["kernels"] for m in data["modules"] if not m["kept"])  # per-channel fp8: every width
    from quantkit.cli.inspect import kernels
    from quantkit.methods import fp8, runtimes_for

    blocks = runtimes_for(fp8.METHOD, fp8.Options(scheme="fp8-block"))
    assert kernels(blocks, [256, 192]) == [] and len(kernels(blocks, [256, 128])) == 2
