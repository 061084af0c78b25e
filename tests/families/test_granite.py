"""Granite 4 hybrid (GraniteMoeHybridForCausalLM) on a tiny random checkpoint: a Mamba-2 layer and an attention
layer, the shared MLP, Granite's multipliers, no RoPE (as granite-4.0-h checkpoints); every method, each artifact
proven in its consumer. Its MoE variant (4 experts, 2 per token, stored fused as IBM's checkpoints store them)
converts to GGUF as llama.cpp's converter writes it, to MLX as mlx-lm holds it, and through every compressed-tensors
method with each expert quantized on its own under the names vLLM's granitemoehybrid loads (transformers loads no
per-expert Granite experts: quantkit's reading is the reload check).

Fast: fp8, gptq and gguf through the CLI (and --auto-precision measuring the shared MLP's pieces), the MoE variant's
gptq, Q4_K_M GGUF and MLX cut as mlx-lm holds its experts.
Slow: the other methods (the MoE variant's fp8 among them: the same linearized experts as its gptq), GGUF against
llama.cpp's converter and llama-quantize (dense and MoE), MLX of the dense model against mlx-lm, the MoE variant's
--auto-precision measuring its stacked experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.families import common

FAMILY = "granitemoehybrid"
# as IBM's checkpoints store them (transformers 5 reads both; llama.cpp's converter, reading config.json
# itself, only these)
LAYER_TYPES = ["mamba", "attention"]
SIZES = dict(shared_intermediate_size=512, num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=8,
             mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=64,
             embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
             position_embedding_type="nope", tie_word_embeddings=True)


def build(out: Path, layer_types: list[str] = LAYER_TYPES, **config) -> Path:
    """Granite 4 hybrid as its checkpoints are: config.json's layer_types "mamba" / "attention"."""
    common.build(out, "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", layer_types=layer_types,
                 **{**SIZES, **config})
    stored = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**stored, "layer_types": layer_types}, indent=2))
    return out


# the MoE variant: experts narrower than the shared MLP, so a width written for the other shows
MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY + "-moe") / "model", **MOE)


COMPRESSED, FAST = common.COMPRESSED, ("fp8", "gptq")  # gptq calibrates the recurrent layers too


@pytest.mark.parametrize("method", [pytest.param(m, marks=() if m in FAST else pytest.mark.slow) for m in COMPRESSED])
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, method, *COMPRESSED[method]), out)
    common.assert_strict_reload(out)
    if method != "nf4":  # the Mamba projections and the shared MLP are quantized (vLLM takes them quantized)
        kept = [k for k in common.kept_16bit(out) if "mamba" in k or "shared_mlp" in k]
        # auto-round keeps widths that are not multiples of 32 16-bit: in_proj's 2 x 512 + 2 x 64 + 8 rows
        assert kept == (["model.layers.0.mamba.in_proj"] if method == "autoround" else []), kept
        if kept:
            assert "multiples of 32" in entry["details"]["kept_16bit"]["model.layers.0.mamba.in_proj"]


def test_quantkit_s_scorers_divide_the_logits_as_the_model_s_forward_does(model):
    """Granite's forward divides the head's logits by logits_scaling (8 here): quantkit's own head blocks, resident
    and streamed, score the same log-probs (without the divisor the gate and serve-check would read a model eight
    times sharper than the one served)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval import evaluate, scorers

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    windows = torch.randint(0, loaded.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.log_softmax(loaded(windows).logits[:, :-1].float(), -1).reshape(-1, loaded.config.vocab_size)
    for scorer in (evaluate.model_scorer(loaded), scorers.checkpoint_scorer(model, dtype="float32")):
        got = torch.cat([torch.as_tensor(c.logprobs) for c in scorer(windows)])
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_gguf(cli, model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"


def test_gguf_auto_precision_measures_the_shared_mlp_s_pieces(cli, model, tmp_path):
    """The dense hybrid streams (transformers' loading conversion renames only the MoE variant's experts), and the
    shared MLP's input_linear, written as ffn_gate and ffn_up, is measured piece by piece on its own rows."""
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "auto",
                                                 "--auto-precision"), out)
    rows = {t["tensor"]: t for t in entry["details"]["sensitivity"]["tensors"]}
    gate, up = rows["blk.0.ffn_gate.weight"], rows["blk.0.ffn_up.weight"]
    assert gate["shape"] == up["shape"] == [512, 256] and gate["errors"] != up["errors"]
    assert gate["kld"] is not None and up["kld"] is not None


@pytest.mark.slow
def test_gguf_auto_precision_measures_the_stacked_experts_of_the_moe_variant(cli, moe_model, tmp_path):
    """The MoE variant streams with its stacked experts renamed as transformers' loading renames them
    (input_linear -> experts.gate_up_proj), and its input_linear, written as ffn_gate_exps and ffn_up_exps, is
    measured on the written pieces (one matrix per expert)."""
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, moe_model, out, "gguf", "--gguf-type", "Q4_K_M",
                                                 "--auto-precision"), out)
    rows = {t["tensor"]: t for t in entry["details"]["sensitivity"]["tensors"]}
    gate, up = rows["blk.0.ffn_gate_exps.weight"], rows["blk.0.ffn_up_exps.weight"]
    assert gate["shape"] == up["shape"] == [4, 256, 256] and gate["errors"] != up["errors"]
    assert any(rows[n]["kld"] is not None for n in rows if "_exps." in n)


def test_gguf_refuses_a_dense_model_that_routes_to_experts(cli, model, tmp_path):
    """transformers' default num_experts_per_tok (2) with no experts: a file llama.cpp refuses to load."""
    variant = common.copy_with_config(model, tmp_path / "model", num_experts_per_tok=2)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "gguf"), out, "num_experts_per_tok")


@pytest.mark.slow
def test_gguf_refuses_layer_types_llama_cpp_reads_as_mamba_layers(cli, model, tmp_path):
    """transformers 5 saves layer_types as "linear_attention" / "full_attention"; llama.cpp's converter reads
    config.json and makes every layer not named "attention" a Mamba layer (a file llama.cpp cannot load)."""
    renamed = common.copy_with_config(model, tmp_path / "model", layer_types=["linear_attention", "full_attention"])
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, renamed, out, "gguf"), out, "layer_types", "attention")


def test_gguf_of_the_moe_variant_writes_stacked_experts(cli, moe_model, tmp_path):
    """The MoE variant's Q4_K_M: the experts stacked per projection (input_linear split into gate and up), the
    router, the shared MLP as the shared expert, the expert counts as the converter writes them; the gate read it
    back (exit 0)."""
    import gguf

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, moe_model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    for layer in (0, 1):
        for kind in ("gate", "up"):
            assert shapes[f"blk.{layer}.ffn_{kind}_exps.weight"] == (4, 256, 256)
            assert shapes[f"blk.{layer}.ffn_{kind}_shexp.weight"] == (512, 256)
        assert shapes[f"blk.{layer}.ffn_down_exps.weight"] == (4, 256, 256)
        assert shapes[f"blk.{layer}.ffn_down_shexp.weight"] == (256, 512)
        assert shapes[f"blk.{layer}.ffn_gate_inp.weight"] == (4, 256)
    assert not [n for n in shapes if n.endswith((".ffn_gate.weight", ".ffn_up.weight", ".ffn_down.weight"))]
    keys = {k: reader.fields[f"granitehybrid.{k}"].contents() for k in (
        "expert_count", "expert_used_count", "feed_forward_length", "expert_shared_feed_forward_length")}
    assert keys == {"expert_count": 4, "expert_used_count": 2, "feed_forward_length": 256,
                    "expert_shared_feed_forward_length": 512}
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"


def test_gguf_refuses_an_moe_variant_that_routes_to_more_experts_than_it_has(cli, moe_model, tmp_path):
    variant = common.copy_with_config(moe_model, tmp_path / "model", num_experts_per_tok=8)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "gguf"), out, "num_experts_per_tok = 8",
                          "num_local_experts = 4")


MOE_METHODS = {**COMPRESSED, "fp8-static": ["--scheme", "fp8-static"]}
# fp8-dynamic takes the MoE variant through the same linearized experts as gptq (oneshot, not model-free), whose run
# checks the same and the routed tokens too
MOE_FAST = ("gptq",)


@pytest.mark.parametrize("method", [pytest.param(m, marks=() if m in MOE_FAST else pytest.mark.slow)
                                    for m in MOE_METHODS])
def test_the_moe_variant_through_every_compressed_tensors_method(cli, moe_model, tmp_path, method):
    """Every expert quantized on its own (block_sparse_moe.experts.<e>.{gate,up,down}_proj, as vLLM's
    granitemoehybrid loads them), the router kept 16-bit under its stored name, the shared MLP quantized, the tokens
    routed to each expert reported for the calibrated methods; SmoothQuant refuses it (its norm feeds the router)."""
    import torch

    out = tmp_path / "out"
    if method == "smoothquant":
        common.assert_refused(common.quantize(cli, moe_model, out, method), out, "router")
        return
    name = method.split("-")[0]
    entry = common.assert_moe_artifact(cli, moe_model, tmp_path, name, *MOE_METHODS[method],
                                       transformers_reloads=False)
    stored = common.stored_tensors(out)
    assert "model.layers.1.block_sparse_moe.router.layer.weight" in stored
    if name == "nf4":  # bitsandbytes quantizes Linear modules only: the fused experts stay bf16, as stored
        assert stored["model.layers.1.block_sparse_moe.input_linear.weight"].dtype == torch.bfloat16
    else:
        assert not any("input_linear" in n and "block_sparse_moe" in n for n in stored)
        assert all(f"model.layers.1.block_sparse_moe.experts.{e}.{p}.weight_scale" in stored
                   for e in range(4) for p in ("gate_proj", "up_proj", "down_proj"))
        assert "model.layers.1.shared_mlp.input_linear.weight_scale" in stored
    if method in ("gptq", "fp8-static"):
        counts = entry["details"]["expert_routed_tokens"]["model.layers.1.block_sparse_moe.router"]
        assert sum(counts) == 2 * entry["details"]["calibration_tokens"]  # top-2 of every token


def test_granite_s_router_reports_its_indices_first(moe_model):
    """Granite's router returns (indices, weights, logits): the counts are the top-k choices of each token, which
    the other layouts' last-output rule would read from the logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.arch.moe import MOE_LAYOUTS, count_routed_tokens

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    windows = torch.randint(0, model.config.vocab_size, (2, 16))
    counts = count_routed_tokens(model, MOE_LAYOUTS[FAMILY], 4, windows)
    router = model.model.layers[1].block_sparse_moe.router
    seen = {}
    handle = router.register_forward_hook(lambda m, a, out: seen.update(indices=out[0]))
    with torch.no_grad():
        model(windows)
    handle.remove()
    assert counts["model.layers.1.block_sparse_moe.router"] == torch.bincount(seen["indices"].reshape(-1),
                                                                               minlength=4).tolist()


def test_the_dense_hybrid_has_no_expert_layout(model, moe_model):
    """The dense and MoE Granite 4 share a model_type: only a checkpoint with experts takes the expert layout (and
    loses the norm row that would smooth into the router)."""
    from quantkit.arch.mappings import holding, rows_for
    from quantkit.arch.moe import moe_layout

    dense, moe = (json.loads((m / "config.json").read_text()) for m in (model, moe_model))
    assert moe_layout(dense) is None and moe_layout(moe) is not None
    rows = rows_for(FAMILY, "awq")
    assert len(holding(rows, dense)) == 2 and [r.smooth for r in holding(rows, moe)] == ["re:.*v_proj$"]


@pytest.mark.slow
def test_gguf_equals_llama_cpp(model, tmp_path):
    common.assert_gguf_is_llama_cpp_s(model, tmp_path)


@pytest.mark.slow
def test_gguf_of_the_moe_variant_equals_llama_cpp(moe_model, tmp_path):
    common.assert_gguf_is_llama_cpp_s(moe_model, tmp_path)


@pytest.mark.slow
def test_gguf_of_the_moe_variant_with_an_imatrix_equals_llama_quantize(moe_model, tmp_path):
    """llama-imatrix's importance rows (one per expert) weigh each expert's matrix alone, in the split gate/up and
    in the stacked down projection: quantkit's Q4_K_M with llama-imatrix's file holds llama-quantize's tensors."""
    import subprocess

    from quantkit.gguf import imatrix as im
    from tests.gguf.helpers import convert_to, need_llama, run_quantize
    from tests.gguf.test_families_llamacpp import assert_same_tensors, text_file
    from tests.gguf.test_vs_converter import reference_gguf

    reference, imatrix = reference_gguf(moe_model, tmp_path / "theirs-bf16.gguf", "bf16", "gpt-2"), tmp_path / "im.gguf"
    run = subprocess.run([str(need_llama("llama-imatrix")), "-m", str(reference), "-f", str(text_file(tmp_path / "t.txt")),
                          "-c", "128", "-b", "128", "--chunks", "4", "-t", "2", "-o", str(imatrix)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and imatrix.is_file(), run.stderr[-2000:]
    weights = im.read(imatrix).weights()
    assert weights["blk.0.ffn_down_exps.weight"].size == 4 * 256
    theirs, ours = tmp_path / "theirs-Q4_K_M.gguf", tmp_path / "ours-Q4_K_M.gguf"
    run_quantize(reference, theirs, "Q4_K_M", imatrix=imatrix)
    assert convert_to(moe_model, ours, "Q4_K_M", imatrix=weights).imatrix_tensors > 0
    assert_same_tensors(theirs, ours, "Q4_K_M + imatrix")


@pytest.mark.slow
def test_gguf_read_back_of_the_moe_variant_equals_the_model(moe_model, tmp_path):
    """The gate's reading of the MoE variant's float32 file joins ffn_gate_exps / ffn_up_exps into transformers'
    experts.gate_up_proj and names down_proj, the router and the shared MLP as transformers loads them: every tensor
    equals the loaded model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.gguf.convert import reading_config
    from quantkit.gguf.loader import to_hf_state_dict
    from tests.gguf.helpers import convert_to

    convert_to(moe_model, tmp_path / "f32.gguf", "F32")
    config = reading_config(moe_model, AutoConfig.from_pretrained(moe_model).to_dict())
    state = to_hf_state_dict(tmp_path / "f32.gguf", config)
    loaded = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).state_dict()
    assert set(state) == set(loaded)
    for name, value in loaded.items():
        assert state[name].shape == value.shape, name
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
def test_gguf_read_back_equals_the_checkpoint(model, tmp_path):
    """The gate's reading of the float32 file undoes every step (A = -exp(A_log), the squeezed conv1d, the
    grouped norm, the shared MLP split into ffn_gate / ffn_up): each tensor equals the checkpoint's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from quantkit.gguf.convert import reading_config
    from quantkit.gguf.loader import to_hf_state_dict
    from tests.gguf.helpers import convert_to

    convert_to(model, tmp_path / "f32.gguf", "F32")
    config = reading_config(model, AutoConfig.from_pretrained(model).to_dict())
    state, stored = to_hf_state_dict(tmp_path / "f32.gguf", config), load_file(model / "model.safetensors")
    assert set(stored) <= set(state)
    for name, value in stored.items():
        assert state[name].shape == value.shape, name
        torch.testing.assert_close(state[name], value.float(), rtol=1e-6, atol=1e-7, msg=name)


def test_mlx_of_the_moe_variant_cuts_its_experts_as_mlx_lm_holds_them(cli, moe_model, tmp_path):
    """4-bit calibrated through the CLI: input_linear cut into switch_mlp.gate_proj (its first half of each expert's
    rows) and up_proj, output_linear as switch_mlp.down_proj, each [experts, out, in] packed per expert; the router
    16-bit with its entry false; the shared MLP quantized (mlx-lm's MoE layer holds it as stored); the gate passes;
    mlx-lm builds every expert with quantkit's weights and reads the artifact as quantkit does."""
    from quantkit.mlx.affine import dequantize

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, moe_model, out, "mlx", "--bits", "4"), out)
    assert entry["details"]["mlx"]["calibration_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    stored, source = common.stored_tensors(out), common.stored_tensors(moe_model)
    assert not any("input_linear" in n and "block_sparse_moe" in n for n in stored)
    for layer in range(len(LAYER_TYPES)):
        block = f"model.layers.{layer}.block_sparse_moe"
        fused = source[f"{block}.input_linear.weight"].float()
        for projection, rows in (("gate_proj", slice(0, 256)), ("up_proj", slice(256, 512))):
            name = f"{block}.switch_mlp.{projection}"
            assert stored[f"{name}.weight"].shape == (4, 256, 256 * 4 // 32)
            for e in range(4):
                back = dequantize(stored[f"{name}.weight"][e], stored[f"{name}.scales"][e],
                                  stored[f"{name}.biases"][e], 4, 64).float()
                assert (back - fused[e, rows]).abs().max() < 0.2 * fused[e].abs().max(), (name, e)
        assert stored[f"{block}.switch_mlp.down_proj.weight"].shape == (4, 256, 256 * 4 // 32)
        assert config["quantization"][f"{block}.router.layer"] is False
        assert f"{block}.router.layer.scales" not in stored
        assert f"model.layers.{layer}.shared_mlp.input_linear.scales" in stored
    assert not any("shared_mlp" in layer for layer in entry["details"].get("kept_16bit", {}))
    common.assert_mlx_lm_reads_as_quantkit(out)


def test_mlx_importances_of_the_moe_variant_are_each_expert_s_routed_inputs(moe_model):
    """The column importances the mlx method weights each expert's groups by: the mean square of the hidden states
    the router sends that expert (gate and up), recorded on transformers' fused experts module."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.mlx import FusedImportance

    info = check_model_dir(moe_model)
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    fused, seen = FusedImportance(info.config, info.tensors), {}
    moe = model.model.layers[1].block_sparse_moe
    hook = moe.register_forward_hook(lambda m, args, out: seen.update(x=args[0].reshape(-1, args[0].shape[-1])))
    hooks = fused.hooks(model)
    with torch.no_grad():
        model(torch.arange(64).reshape(2, 32))
    for h in [hook, *hooks]:
        h.remove()
    chosen = moe.router(seen["x"])[0]
    imp = fused.importances()["model.layers.1.block_sparse_moe.switch_mlp.up_proj"]
    for e in range(4):
        x = seen["x"][(chosen == e).any(-1)]
        assert torch.allclose(imp[e], (x.double() ** 2).mean(0).float(), rtol=1e-5), e


@pytest.mark.slow
def test_mlx_lm_reads_it_as_quantkit(cli, model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "mlx", "--bits", "4", gate=False), out)
    assert all("mlx-lm" in why for why in entry["details"]["kept_16bit"].values())
    common.assert_mlx_lm_reads_as_quantkit(out)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_vllm_serves_it_as_the_gate_read_it(cli, model, tmp_path, method):
    """vLLM serves the artifact as the gate read it (its CPU build too: fp8 read 1.2e-7 nats from quantkit's
    reading); the tiny model's W4A16 artifact is refused on a CPU before the server starts, naming the Mamba in_proj
    whose 1160 output rows vLLM's CPUWNA16 kernel does not take (Granite 4's own widths are multiples of 32)."""
    from quantkit.serve import vllm_server
    from quantkit.serve.support import accelerator
    from tests.serve.test_serve_check_slow import serve_check

    if accelerator().kind != "cpu" or method == "fp8":
        common.assert_vllm_serves_it(cli, model, tmp_path, method)
        return
    if vllm_server.find() is None:
        pytest.skip("vllm is not installed (scripts/setup_engines.sh)")
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, method), out)
    code, _data, stderr = serve_check(cli, out, tmp_path)
    assert code == 2 and "model.layers.0.mamba.in_proj has 1160 rows" in stderr and "starting vllm" not in stderr
