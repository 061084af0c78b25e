"""Llama 4's text model (Llama4ForCausalLM) on a tiny random checkpoint built from transformers' Llama4TextConfig:
four layers (the fourth NoPE and attending to every position, the others chunked with RoPE: the pattern llama.cpp's
and mlx-lm's llama4 fix), a mixture of experts in every second layer (4 experts 512 wide, one per token, beside a
shared expert) and a dense MLP 768 wide in the others (the widths tell the experts' transposition and the
intermediate sizes' swap apart), a llama3 RoPE, rms_norm_eps 1e-6 (the eps mlx-lm's llama4 normalizes queries and
keys with).

Fast: GGUF Q4_K_M through the CLI with llama.cpp's llama4 keys and tensors, the bf16 file read back as stored, what
llama.cpp's llama4 would run otherwise refused key by key; MLX 4-bit through the CLI cut as mlx-lm's llama4 holds it
and read by mlx-lm as quantkit reads it, its tensors those mlx_lm.convert writes of the same checkpoint (quantized:
names, shapes, dtypes; 16-bit: every value), what mlx-lm's llama4 would compute otherwise refused key by key; nf4 with each expert a bitsandbytes
Linear of its own, reloaded strictly and bit for bit bitsandbytes' NF4 of the fused tensors' cut; fp8 with every
expert its own quantized Linears, reloaded strictly and read by the gate as transformers reloads it, bit for bit;
AWQ and SmoothQuant refused. Slow: llama.cpp's runtime scores the file as
transformers scores the checkpoint, bf16 / Q4_K_M / IQ4_XS equal to convert_hf_to_gguf.py + llama-quantize, the
imatrix equal to llama-imatrix's, MLX with Scout's rms_norm_eps (1e-5) read by mlx-lm as quantkit reads it, gptq,
fp8-block, nvfp4 and mxfp4 as fp8 is, gptq's routed-token counts, nf4 with an ignored expert 16-bit, LLM.int8's
experts split as nf4's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.families import common

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=16.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=1024)
SHAPE = dict(num_hidden_layers=4, interleave_moe_layer_step=2, head_dim=64, num_local_experts=4, num_experts_per_tok=1,
             intermediate_size=512, intermediate_size_mlp=768, rms_norm_eps=1e-6, rope_parameters=LLAMA3_ROPE)
ARCH = "Llama4ForCausalLM"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return common.build(tmp_path_factory.mktemp("llama4_text") / "model", "Llama4TextConfig", ARCH, **SHAPE)


# ---------------------------------------------------------------- GGUF


def test_gguf_of_llama4_through_the_cli(cli, model, tmp_path):
    """Q4_K_M through the CLI: llama.cpp's llama4 keys (the dense layers' width as feed_forward_length, the experts'
    as expert_feed_forward_length, the MoE step), gate_up_proj transposed and cut into ffn_gate_exps / ffn_up_exps
    [experts, intermediate, hidden] and down_proj transposed, the shared expert and the dense MLP, the router F32,
    the llama3 RoPE factors; the gate reads every tensor back."""
    import gguf

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
    (path,) = out.glob("*.gguf")
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama4" and fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["llama4.feed_forward_length"] == 768 and fields["llama4.expert_feed_forward_length"] == 512
    assert fields["llama4.interleave_moe_layer_step"] == 2
    assert fields["llama4.expert_count"] == 4 and fields["llama4.expert_used_count"] == 1
    assert "llama4.attention.sliding_window" not in fields
    tensors = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in reader.tensors}
    assert tensors["rope_freqs.weight"] == ("F32", (32,))
    for layer in (1, 3):  # ggml order: [columns, rows, experts]
        blk = f"blk.{layer}."
        assert tensors[blk + "ffn_gate_exps.weight"][1] == tensors[blk + "ffn_up_exps.weight"][1] == (256, 512, 4)
        assert tensors[blk + "ffn_down_exps.weight"][1] == (512, 256, 4)
        assert {tensors[blk + f"ffn_{p}_exps.weight"][0] for p in ("gate", "up", "down")} <= {"Q4_K", "Q5_K", "Q6_K"}
        assert tensors[blk + "ffn_gate_inp.weight"] == ("F32", (256, 4))
        assert tensors[blk + "ffn_gate_shexp.weight"][1] == (256, 512)
        assert tensors[blk + "ffn_down_shexp.weight"][1] == (512, 256)
        assert not any(n.startswith(blk) and n.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down") for n in tensors)
    for layer in (0, 2):
        assert tensors[f"blk.{layer}.ffn_gate.weight"][1] == (256, 768)
        assert tensors[f"blk.{layer}.ffn_down.weight"][1] == (768, 256)
        assert f"blk.{layer}.ffn_gate_exps.weight" not in tensors


def test_gguf_of_llama4_reads_back_as_stored(model, tmp_path):
    """The bf16 file read back (the gate's reading) is the checkpoint, tensor for tensor: the experts joined and
    transposed back, the router, the shared expert and the dense MLP under their own names."""
    import torch
    from safetensors.torch import load_file

    from quantkit.gguf.convert import load_hparams
    from quantkit.gguf.loader import to_hf_state_dict
    from tests.gguf.helpers import convert_to

    convert_to(model, tmp_path / "bf16.gguf", "BF16")
    read = to_hf_state_dict(tmp_path / "bf16.gguf", {**load_hparams(model), "architectures": [ARCH]})
    stored = load_file(model / "model.safetensors")
    assert sorted(read) == sorted(stored)
    for name, tensor in stored.items():
        assert torch.equal(read[name], tensor.float()), name


# config.json values llama.cpp's llama4 does not follow (it fixes RoPE and chunks by the layer's index, the chunk,
# the attention temperature, the query-key norm by the expert count, SiLU, no output bias)
# the layer pattern both runtimes fix (RoPE and chunks every fourth layer, experts every second)
PATTERN_OTHERWISE = {
    "no-rope-everywhere": dict(no_rope_layers=[1, 1, 1, 1]),
    "all-full": dict(layer_types=["full_attention"] * 4),
    "experts-elsewhere": dict(moe_layers=[3]),
}
LLAMA_CPP_OTHERWISE = {
    **PATTERN_OTHERWISE,
    "chunk": dict(attention_chunk_size=4096),
    "no-temperature": dict(attn_temperature_tuning=False),
    "floor": dict(floor_scale=4096),
    "temperature-scale": dict(attn_scale=0.2),
    "no-qk-norm": dict(use_qk_norm=False),
    "bias": dict(attention_bias=True),
    "gelu": dict(hidden_act="gelu"),
}


@pytest.mark.parametrize("change", list(LLAMA_CPP_OTHERWISE.values()), ids=list(LLAMA_CPP_OTHERWISE))
def test_gguf_of_llama4_llama_cpp_would_run_otherwise_refused(cli, model, tmp_path, change):
    """A checkpoint llama.cpp's llama4 would compute otherwise than transformers does (or not load): exit 2 before
    work, naming the key and llama.cpp's llama4."""
    changed = common.copy_with_config(model, tmp_path / "model", **change)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, changed, out, "gguf"), out, next(iter(change)), "llama.cpp's llama4")


def test_llama4_temperature_tuning_stated_as_a_number_is_on(model):
    """Meta's config.json states attn_temperature_tuning as a number (4): on, as transformers, llama.cpp's and
    mlx-lm's llama4 read it; neither conversion refuses it. Off (0) is refused for GGUF (llama.cpp's llama4 always
    tunes), not for MLX (mlx-lm's reads it)."""
    from quantkit.arch.families.llama4 import check_mlx
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.convert import arch_spec

    config = json.loads((model / "config.json").read_text())
    assert arch_spec({**config, "attn_temperature_tuning": 4}).arch == "LLAMA4"
    check_mlx({**config, "attn_temperature_tuning": 4})
    with pytest.raises(UnsupportedError, match="attn_temperature_tuning 0"):
        arch_spec({**config, "attn_temperature_tuning": 0})
    check_mlx({**config, "attn_temperature_tuning": 0})


@pytest.mark.slow
def test_llama_cpp_runs_llama4_as_transformers_does_s(model, tmp_path):
    """What the refusals rest on: llama-perplexity's running perplexity of the F32 file, chunk by chunk, is
    transformers' float32 perplexity of the checkpoint on the same tokens (the second half of each 128-token chunk,
    as llama-perplexity scores it), to llama.cpp's float rounding: RoPE, chunks, NoPE layer and its temperature,
    query-key norm, sigmoid-weighted experts and shared expert as transformers computes them."""
    import re
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM

    from tests.families.test_moe import llama_windows
    from tests.gguf.helpers import convert_to, need_llama
    from tests.gguf.test_families_llamacpp import text_file

    f32, text, n_ctx, chunks = tmp_path / "f32.gguf", text_file(tmp_path / "t.txt"), 128, 3
    convert_to(model, f32, "F32")
    run = subprocess.run([str(need_llama("llama-perplexity")), "-m", str(f32), "-f", str(text), "-c", str(n_ctx),
                          "-b", str(n_ctx), "--chunks", str(chunks), "-t", "2"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", run.stdout + run.stderr)]
    assert theirs
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    nll, count, ours = 0.0, 0, []
    with torch.no_grad():
        for row in llama_windows(model, f32, text, n_ctx, chunks):
            logp = torch.log_softmax(hf(input_ids=row[None]).logits[0].double(), -1)
            scored = range(n_ctx // 2, n_ctx - 1)
            nll -= float(sum(logp[j, row[j + 1]] for j in scored))
            count += len(scored)
            ours.append(float(torch.exp(torch.tensor(nll / count))))
    for mine, llama in zip(ours, theirs):
        assert abs(mine - llama) < 2e-3 * llama, (ours, theirs)


@pytest.mark.slow
def test_gguf_of_llama4_equals_llama_cpp(model, tmp_path):
    """bf16 equal to convert_hf_to_gguf.py's, Q4_K_M and IQ4_XS equal to llama-quantize's, each loaded by
    llama-perplexity."""
    common.assert_gguf_is_llama_cpp_s(model, tmp_path, pre="gpt-2")


@pytest.mark.slow
def test_gguf_of_llama4_imatrix_is_llama_imatrix_s(cli, model, tmp_path):
    """llama-imatrix on the converter's file: quantkit's imatrix of the same windows has the values of every dense
    tensor (attention, the dense MLP, the router, the shared expert) and, for each expert the router sends as many
    tokens to in both, the experts' (the routed rows scaled by the router's sigmoid into ffn_gate_exps /
    ffn_up_exps, act(gate) * up into ffn_down_exps), to float rounding (bf16 activations in llama.cpp): element for
    element up to the first mixture-of-experts layer's experts, on average after them (with random weights a token
    near a tie of the router goes to another expert there, and the later layers' inputs of that token differ). With
    llama-imatrix's file, Q4_K_M and IQ4_XS equal llama-quantize's and the CLI takes it."""
    import numpy as np

    from tests.families.test_moe import assert_quantizes_with_llama_imatrix, imatrices

    bf16, path, llama, computed = imatrices(model, tmp_path, ARCH)
    theirs, ours = llama.weights(), computed.weights()
    assert set(ours) == set(theirs)
    experts = {n for n in theirs if "_exps." in n}
    assert {f"blk.{b}.ffn_{p}_exps.weight" for b in (1, 3) for p in ("gate", "up", "down")} == experts
    for name in sorted(set(theirs) - experts):
        if name.startswith(("blk.0.", "blk.1.")):
            np.testing.assert_allclose(ours[name], theirs[name], rtol=0.03, err_msg=name)
        assert np.abs(ours[name] - theirs[name]).mean() < 0.01 * np.abs(theirs[name]).mean(), name
    compared = 0
    for name in sorted(experts):
        same = np.flatnonzero(computed.counts[name] == llama.counts[name])
        compared += same.size if name.startswith("blk.1.") else 0
        mine, reference = ours[name].reshape(4, -1)[same], theirs[name].reshape(4, -1)[same]
        if name.startswith("blk.1."):
            np.testing.assert_allclose(mine, reference, rtol=0.03, err_msg=name)
        assert np.abs(mine - reference).mean() < 0.02 * np.abs(reference).mean(), name
    assert compared
    assert_quantizes_with_llama_imatrix(cli, model, tmp_path, bf16, path, llama)


# ---------------------------------------------------------------- MLX


def test_mlx_of_llama4_cuts_its_fused_experts_as_mlx_lm_holds_them(cli, model, tmp_path):
    """4-bit calibrated through the CLI: config.json nesting the checkpoint's as text_config of mlx-lm's llama4 (the
    llama3 RoPE as rope_scaling), every tensor under language_model., gate_up_proj [experts, hidden, 2 x
    intermediate] written as the SwitchGLU's feed_forward.experts.gate_proj / up_proj ([experts, intermediate,
    hidden] packed per expert: its first and second half), down_proj as [experts, hidden, intermediate], no fused
    tensor left, the routers 16-bit (entry false); the read-back joins them into the checkpoint's tensors; mlx-lm
    builds every quantized module with exactly quantkit's weights and its float32 logits follow quantkit's
    reading."""
    from quantkit.mlx.checkpoint import MLXWeights

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "mlx", "--bits", "4"), out)
    assert entry["details"]["mlx"]["calibration_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama4" and config["text_config"]["model_type"] == "llama4_text"
    assert config["text_config"]["rope_scaling"]["type"] == "llama3"
    stored, source = common.stored_tensors(out), common.stored_tensors(model)
    assert all(name.startswith("language_model.") for name in stored)
    for layer in (1, 3):
        block = f"language_model.model.layers.{layer}.feed_forward."
        assert stored[block + "experts.gate_proj.weight"].shape == stored[block + "experts.up_proj.weight"].shape \
            == (4, 512, 32)
        assert stored[block + "experts.gate_proj.scales"].shape == (4, 512, 4)
        assert stored[block + "experts.down_proj.weight"].shape == (4, 256, 64)
        assert config["quantization"][block + "router"] is False and block + "router.scales" not in stored
    assert not any("gate_up_proj" in name for name in stored)
    ours = MLXWeights(out)
    assert set(ours.keys()) == set(source)
    for fused in ("model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.3.feed_forward.experts.down_proj"):
        read, original = ours.get(fused).float(), source[fused].float()
        assert ours.shape(fused) == tuple(original.shape)
        assert (read - original).abs().mean() < 0.2 * original.abs().mean(), fused
    common.assert_mlx_lm_reads_as_quantkit(out)


MLX_ALL_16_BIT = """
targets:
  - name: mlx
    method: mlx
    options:
      calibrate: false
      layer_bits: {'re:.*': 16-bit}
"""


def test_mlx_of_llama4_stores_the_tensors_mlx_lm_convert_stores(cli, model, tmp_path):
    """mlx_lm.convert, given the checkpoint as mlx-lm's llama4 loads it (config.json nesting it as text_config with
    the fields quantkit writes mlx-lm, every tensor under language_model., the fused experts as stored: its own
    sanitize cuts them), writes the same tensors as quantkit: quantized (-q), the same names, shapes and dtypes, the
    routers aside (16-bit here, 4-bit there), and the same values of every tensor both keep 16-bit; unquantized,
    every tensor equal to quantkit's artifact with every module kept 16-bit (the experts cut as its sanitize cuts
    them, value for value)."""
    import torch
    from safetensors.torch import save_file

    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    from mlx_lm import convert

    from quantkit.mlx.checkpoint import mlx_config
    from tests.families.test_moe import stored_headers

    source = tmp_path / "source"
    shutil.copytree(model, source)
    config = json.loads((source / "config.json").read_text())
    as_loaded = {k: v for k, v in mlx_config(config, {}).items() if not k.startswith("quantization")}
    (source / "config.json").write_text(json.dumps(as_loaded))
    save_file({f"language_model.{k}": v.contiguous() for k, v in common.stored_tensors(model).items()},
              str(source / "model.safetensors"))
    convert(str(source), str(tmp_path / "theirs"), quantize=True)
    common.assert_passed(common.quantize(cli, model, tmp_path / "ours", "mlx", gate=False), tmp_path / "ours")
    expected, stored = stored_headers(tmp_path / "theirs"), stored_headers(tmp_path / "ours")

    def router(name: str) -> bool:
        return ".feed_forward.router." in name

    assert {k: v for k, v in stored.items() if not router(k)} == {k: v for k, v in expected.items() if not router(k)}
    assert all(stored[r][1] == "BF16" and expected[r][1] == "U32" for r in stored if r.endswith("router.weight"))
    ours, theirs = common.stored_tensors(tmp_path / "ours"), common.stored_tensors(tmp_path / "theirs")
    plain = [k for k in stored if expected.get(k) == stored[k] and stored[k][1] != "U32" and not k.endswith(
        (".scales", ".biases"))]
    assert plain and all(torch.equal(ours[k], theirs[k]) for k in plain), plain

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(MLX_ALL_16_BIT)
    kept = tmp_path / "ours-16"
    common.assert_passed(cli("quantize", model, "--recipe", recipe, *common.CALIB, "--no-gate", "-o", kept), kept)
    convert(str(source), str(tmp_path / "theirs-16"), quantize=False)
    ours, theirs = common.stored_tensors(kept), common.stored_tensors(tmp_path / "theirs-16")
    assert sorted(ours) == sorted(theirs)
    assert "language_model.model.layers.1.feed_forward.experts.up_proj.weight" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]


# config.json values mlx-lm's llama4 does not follow (RoPE, chunks and experts by the layer's index, one expert per
# token, its own output head, the RoPE types quantkit writes it)
MLX_OTHERWISE = {
    **PATTERN_OTHERWISE,
    "two-experts": dict(num_experts_per_tok=2),
    "tied": dict(tie_word_embeddings=True),
    "yarn": dict(rope_parameters=dict(rope_type="yarn", rope_theta=500000.0, factor=4.0,
                                      original_max_position_embeddings=1024)),
}
MLX_KEYS = {"yarn": "rope_parameters.rope_type"}


@pytest.mark.slow  # the same conversion and mlx-lm reading at 1e-6: test_mlx_of_llama4_cuts_its_fused_experts_...
def test_mlx_of_llama4_with_scout_s_norm_eps_reads_as_quantkit(cli, model, tmp_path):
    """rms_norm_eps 1e-5 (Llama 4 Scout's), where mlx-lm's llama4 normalizes queries and keys with 1e-6: written, and
    mlx-lm's logits still follow quantkit's reading within the tolerance every family is held to."""
    changed, out = common.copy_with_config(model, tmp_path / "model", rms_norm_eps=1e-5), tmp_path / "out"
    common.assert_passed(common.quantize(cli, changed, out, "mlx", "--bits", "4"), out)
    common.assert_mlx_lm_reads_as_quantkit(out)


@pytest.mark.parametrize("case", list(MLX_OTHERWISE))
def test_mlx_of_llama4_mlx_lm_would_compute_otherwise_refused(cli, model, tmp_path, case):
    """A checkpoint mlx-lm's llama4 would compute otherwise than transformers does (or not load): exit 2 before work,
    naming the key and mlx-lm's llama4."""
    change = MLX_OTHERWISE[case]
    changed = common.copy_with_config(model, tmp_path / "model", **change)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, changed, out, "mlx"), out, MLX_KEYS.get(case, next(iter(change))),
                          "mlx-lm's llama4")


# ---------------------------------------------------------------- the llm-compressor methods and nf4


def reading_and_reload_logits(out: Path):
    """The gate's reading of the artifact (quantkit.eval.experts: llm-compressor's linear experts, each decompressed
    as it runs) and transformers' strict reload of it (its SequentialLlama4TextExperts), over the same tokens."""
    import torch

    from quantkit.formats import gate
    from tests.eval.test_experts import IDS, resident_logits

    with torch.no_grad():
        reloaded = gate.load_artifact(out)(IDS).logits.float()
    return resident_logits(gate.artifact_reading(out)), reloaded


@pytest.mark.parametrize("method,args", [("fp8", []), pytest.param("gptq", [], marks=pytest.mark.slow),
                                         pytest.param("fp8", ["--scheme", "fp8-block"], marks=pytest.mark.slow),
                                         pytest.param("nvfp4", ["--scheme", "a16"], marks=pytest.mark.slow),
                                         pytest.param("mxfp4", [], marks=pytest.mark.slow)])
def test_llm_compressor_methods_write_each_expert_as_vllm_and_transformers_load_it(cli, model, tmp_path, method,
                                                                                   args):
    """llm-compressor's Llama4LinearExperts built for the text model (quantkit.arch.moe.linearize): every expert's
    gate, up and down quantized under `feed_forward.experts.<e>.<projection>` (the names vLLM's llama4 maps into its
    fused experts, and transformers' reload builds as SequentialLlama4TextExperts), the routers 16-bit; transformers
    reloads it strictly and the gate's reading of it equals that reload bit for bit."""
    import torch
    from safetensors import safe_open

    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, method, *args), out)
    common.assert_strict_reload(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118  (a safetensors file, not a dict)
    for layer in (1, 3):
        block = f"model.layers.{layer}.feed_forward."
        assert not any(k.startswith(block + "experts.gate_up_proj") for k in stored)
        assert stored[block + "router.weight"] == "BF16"
        for e in range(4):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                weights = [k for k in stored if k.startswith(f"{block}experts.{e}.{projection}.weight")]
                assert weights and all(stored[k] != "BF16" for k in weights if "scale" not in k), weights
    read, reloaded = reading_and_reload_logits(out)
    assert torch.equal(read, reloaded)


@pytest.mark.slow
def test_gptq_counts_each_experts_routed_tokens(cli, model, tmp_path):
    """Llama 4's router returns (scores, logits): the report counts the top-k of its logits, one expert per token,
    so each router's counts add up to the calibration tokens."""
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gptq"), out)
    counts = entry["details"]["expert_routed_tokens"]
    assert sorted(counts) == ["model.layers.1.feed_forward.router", "model.layers.3.feed_forward.router"]
    samples, seq_len = (int(common.CALIB[i + 1]) for i in (0, 2))
    assert all(len(row) == 4 and sum(row) == samples * seq_len for row in counts.values())


def held_rows(model: Path):
    from quantkit.arch.families import by_model_type
    from quantkit.arch.mappings import holding

    return holding(list(by_model_type("llama4_text").smoothing), json.loads((model / "config.json").read_text()))


def test_smoothing_rows_preserve_the_function(model):
    """Llama 4's rows as this checkpoint holds them (MoE layers 1 and 3, dense 0 and 2): a random per-channel scale
    divided out of each smooth layer and multiplied into its balance layers, the experts linearized as AWQ smooths
    them, leaves the logits as they were at float32 rounding; the router is a balance layer of the MoE layers' norm,
    so the routing is unchanged."""
    from dataclasses import replace

    rows = held_rows(model)
    assert common.smoothed_kld(model, rows, linear_experts=True) < 1e-6
    unrouted = [replace(row, balance=tuple(b for b in row.balance if "router" not in b)) for row in rows]
    assert common.smoothed_kld(model, unrouted, linear_experts=True) > 1e-4  # the routing moves without it


def test_llm_compressor_resolves_each_row_in_the_layers_it_holds_in(model):
    """llm-compressor groups a row's matches layer by layer and fails where a group has several smooth layers (its
    own Llama 4 row, on a checkpoint with dense layers): each held row resolves to one smooth layer per group, the
    MoE layers' norm balancing the router, the shared expert and every routed expert."""
    import torch
    from compressed_tensors.utils.match import match_modules_set
    from transformers import AutoModelForCausalLM

    from quantkit.arch.moe import linearize

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    linearize(loaded, json.loads((model / "config.json").read_text()))
    names = {m: n for n, m in loaded.named_modules()}
    groups = {}
    for row in held_rows(model):
        for smooth, *balance in match_modules_set(loaded, (row.smooth, *row.balance)):
            assert len(smooth) == 1
            groups[names[smooth[0]]] = sorted(names[b].rsplit("feed_forward.", 1)[-1] for layers in balance for b in layers)
    assert groups["model.layers.1.post_attention_layernorm"] == sorted(
        ["router", "shared_expert.gate_proj", "shared_expert.up_proj",
         *(f"experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj"))])
    assert groups["model.layers.2.post_attention_layernorm"] == ["gate_proj", "up_proj"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_smoothing_methods_quantize_every_expert(cli, model, tmp_path, method):
    """AWQ (every row) and SmoothQuant (the attention norm's row: as for every MoE family, not the norm that feeds the
    experts) write every expert quantized; transformers reloads the artifact strictly."""
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, method), out)
    common.assert_strict_reload(out)
    stored = common.stored_tensors(out)
    for e in range(4):
        assert stored[f"model.layers.1.feed_forward.experts.{e}.down_proj.weight_scale"].isfinite().all()


def test_nf4_of_llama4_writes_each_expert_as_transformers_reloads_it(cli, model, tmp_path):
    """nf4: the experts one 4-bit Linear per expert projection, as transformers' bitsandbytes reload builds Llama 4's
    experts (SequentialLlama4TextExperts); transformers reloads the artifact strictly, and each expert's gate, up
    and down weights are bit for bit bitsandbytes' NF4 of the fused tensors' cut (gate the first half of
    gate_up_proj's columns, up the second, each transposed; down_proj transposed); the routers stay 16-bit."""
    import bitsandbytes.functional as bnbf
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "nf4"), out)
    assert entry["details"]["split_moe_experts"] == {"quantized": 2 * 4 * 3, "kept_16bit": []}
    common.assert_strict_reload(out)
    read = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    for layer in (1, 3):
        experts = read.model.layers[layer].feed_forward.experts
        fused = base.model.layers[layer].feed_forward.experts
        assert type(experts).__name__ == "SequentialLlama4TextExperts"
        assert type(read.model.layers[layer].feed_forward.router) is type(base.model.layers[layer].feed_forward.router)
        half = fused.gate_up_proj.shape[-1] // 2
        for e in range(4):
            cut = {"gate_proj": fused.gate_up_proj[e][:, :half].T, "up_proj": fused.gate_up_proj[e][:, half:].T,
                   "down_proj": fused.down_proj[e].T}
            for projection, weight in cut.items():
                stored = getattr(experts[e], projection).weight
                packed, state = bnbf.quantize_4bit(weight.contiguous(), blocksize=64, quant_type="nf4",
                                                   compress_statistics=True)
                assert torch.equal(bnbf.dequantize_4bit(stored.data, stored.quant_state),
                                   bnbf.dequantize_4bit(packed, state)), (layer, e, projection)


@pytest.mark.slow
def test_nf4_of_llama4_keeps_the_experts_ignore_names(cli, model, tmp_path):
    """An expert `ignore` names stays a 16-bit Linear, listed in the report and in the skip list, and the artifact
    still reloads strictly with it equal to the fused tensor's cut."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "nf4", "--ignore",
                                                 r"re:.*layers\.1\.feed_forward\.experts\.2\..*"), out)
    kept = [f"model.layers.1.feed_forward.experts.2.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
    assert entry["details"]["split_moe_experts"] == {"quantized": 2 * 4 * 3 - 3, "kept_16bit": kept}
    common.assert_strict_reload(out)
    read = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    fused = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).model.layers[1].feed_forward.experts
    expert = read.model.layers[1].feed_forward.experts[2]
    assert type(expert.gate_proj) is torch.nn.Linear
    assert torch.equal(expert.down_proj.weight, fused.down_proj[2].T)


@pytest.mark.slow
def test_int8_of_llama4_splits_the_experts_too(cli, model, tmp_path):
    """LLM.int8 (`--scheme int8`): the same per-expert Linears, 8-bit, reloaded strictly."""
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "nf4", "--scheme", "int8"), out)
    assert entry["details"]["split_moe_experts"] == {"quantized": 2 * 4 * 3, "kept_16bit": []}
    common.assert_strict_reload(out)
