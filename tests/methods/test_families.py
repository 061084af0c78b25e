"""The compressed-tensors methods and nf4 on tiny random models of each family people fine-tune:
exit 0 with an artifact that reloads strictly (in transformers; an MoE artifact whose experts transformers cannot
reload, asymmetric or with static activation scales, in quantkit's own reading of it, which vLLM's reading
matches: quantkit.eval.experts), or exit 2 before any work with the reason.

Families come from tests/gguf/families.py (Llama 3.1, Gemma 3 text, Phi-3, Mistral, Mixtral,
Qwen2.5, Qwen3-MoE) plus dense Qwen3 and Qwen2-MoE built here the same way. The full
family x method matrix is slow; a few representative cases stay in the fast suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.methods.conftest import CALIB_ARGS, assert_nothing_written, report

# Random weights: the gate is loosened; strict reload is enforced whatever the gate says.
LOOSE_GATE = ["--max-kld", "1", "--max-ppl-increase", "1", "--min-top1", "0"]
METHOD_ARGS = {"fp8": [], "gptq": [], "awq": [], "smoothquant": ["--smoothing-strength", "0.5"],
               "nf4": [], "autoround": ["--iters", "2"], "nvfp4": [], "mxfp4": []}
MOE = ("mixtral", "qwen3moe", "qwen2moe")
# (family, method) -> the words exit 2 must name, for what a method refuses on a family.
REFUSED: dict[tuple[str, str], str] = {}
FAMILIES = ("llama31", "gemma3", "phi3", "mistral", "mixtral", "qwen25", "qwen3", "qwen3moe", "qwen2moe")
# Fast: the fused Phi-3 rows (asymmetric Mixtral experts: below; the MoE routing report: tests/families/test_moe.py).
FAST = {("phi3", "awq")}


def build_extra(family: str, out: Path) -> Path:
    """Dense Qwen3 and Qwen2-MoE (with a shared expert), shaped as tests/gguf/families.py's models."""
    import torch
    import transformers

    from tests.gguf.families import COMMON, randomize, write_bpe_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = write_bpe_tokenizer(out)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, vocab_size=vocab, **ids, head_dim=64))
    else:
        config = transformers.Qwen2MoeConfig(**COMMON, vocab_size=vocab, **ids, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=256, shared_expert_intermediate_size=512)
        model = transformers.Qwen2MoeForCausalLM(config)
    randomize(model, 0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family name -> a tiny checkpoint, built on first use."""
    from tests.gguf.families import build_family

    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            build = build_extra if family in ("qwen3", "qwen2moe") else build_family
            built[family] = build(family, root / family)
        return built[family]

    return get


def assert_reloads_strictly(out: Path) -> None:
    """transformers reloads the artifact strictly, or (MoE experts it cannot reload) quantkit's reading does."""
    from quantkit.eval import experts
    from quantkit.formats.gate import artifact_reading

    if experts.reads(out):
        artifact_reading(out).open()  # ArtifactReloadError (exit 3 in a run) on any missing or unexpected tensor
        return
    assert strict_reload_info(out) == {}


def strict_reload_info(out: Path) -> dict:
    """transformers' loading info of the artifact: every list empty when it reloads strictly."""
    from transformers import AutoModelForCausalLM

    _model, info = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", output_loading_info=True)
    return {key: list(value) for key, value in info.items() if value}


def assert_routing_reported(out: Path, family: str) -> None:
    """MoE + calibrated method: tokens routed to each expert, summing to tokens x top-k per router
    (tests.families.common.assert_routing_reported), one router per layer, the threshold reported."""
    from quantkit.arch.moe import MIN_EXPERT_TOKENS
    from tests.families.common import assert_routing_reported as routed_tokens_reported

    entry = report(out)["targets"][0]
    routed_tokens_reported(out, entry)
    config = json.loads((out / "config.json").read_text())
    assert len(entry["details"]["expert_routed_tokens"]) == config["num_hidden_layers"]
    assert entry["details"]["min_expert_tokens"] == MIN_EXPERT_TOKENS


def run_case(cli, family_models, tmp_path, family: str, method: str) -> None:
    model = family_models(family)
    out = tmp_path / "out"
    result = cli("quantize", model, "--method", method, *METHOD_ARGS[method], *CALIB_ARGS, *LOOSE_GATE, "-o", out)
    if (family, method) in REFUSED:
        assert result.exit_code == 2, result.output
        assert REFUSED[family, method] in result.output
        assert "loading" not in result.output and "measuring" not in result.output  # refused before any work
        assert_nothing_written(out)
        return
    assert result.exit_code == 0, result.output
    assert_reloads_strictly(out)
    entry = report(out)["targets"][0]
    assert entry["gate"]["passed"]
    if family in MOE and method in ("gptq", "awq", "autoround", "smoothquant"):
        assert_routing_reported(out, family)
    if method != "nf4":
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert family not in MOE or any(name.endswith("mlp.gate") for name in ignore)  # routers kept 16-bit


CASES = [pytest.param(f, m, marks=() if (f, m) in FAST else pytest.mark.slow, id=f"{f}-{m}")
         for f in FAMILIES for m in METHOD_ARGS]


@pytest.mark.parametrize("family,method", CASES)
def test_method_on_family(cli, family_models, tmp_path, family, method):
    run_case(cli, family_models, tmp_path, family, method)


def test_asymmetric_experts_read_as_their_decompressed_weights(cli, family_models, tmp_path):
    """gptq --asymmetric on Mixtral stores a zero point per expert, which transformers' fused-expert reload cannot
    take: quantkit reads it with one Linear per expert projection (llm-compressor's linear experts), and at float32
    its logits are those of transformers' own Mixtral holding the experts' decompressed weights, to float32 rounding
    (a wrong zero point or scale moves them by percents)."""
    import re

    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.engines.transformers import hf_config
    from quantkit.eval import experts
    from quantkit.eval.resident import resident_built

    base, out = family_models("mixtral"), tmp_path / "out"
    result = cli("quantize", base, "--method", "gptq", "--asymmetric", *CALIB_ARGS, *LOOSE_GATE, "-o", out)
    assert result.exit_code == 0, result.output
    config = hf_config(out)
    model, source = experts.linear_open(out, config, torch.float32, experts.moe_layout(config.to_dict()))
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = resident_built(model, config, source, "cpu").model(ids).logits
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    state = {}
    for name, tensor in reference.state_dict().items():
        fused = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        rows = ["down_proj"] if fused and fused.group(2) == "down_proj" else ["gate_proj", "up_proj"]
        state[name] = (torch.stack([torch.cat([source.get(f"{fused.group(1)}.{e}.{p}.weight") for p in rows])
                                    for e in range(tensor.shape[0])]) if fused else source.get(name)).float()
    reference.load_state_dict(state)
    with torch.no_grad():
        theirs = reference(ids).logits
    assert (ours - theirs).abs().max() < 1e-5 * theirs.abs().max()


@pytest.mark.slow  # the MoE reading's static-scale rule; test_asymmetric_experts_... proves the reading itself fast
def test_static_expert_input_scales_are_shared_as_vllm_shares_them(cli, family_models, tmp_path):
    """fp8-static on Mixtral: each expert stores its own input scales; vLLM's fused MoE runs every expert of a layer
    with the largest (one for gate/up, one for down: process_fp8_input_tensor_strategy_moe), and so does the gate.
    Every expert is calibrated on every token, so the gate/up inputs' scales agree and the down inputs' differ."""
    import torch

    from quantkit.eval.experts import SharedInputScales
    from quantkit.formats.gate import artifact_reading

    out = tmp_path / "out"
    result = cli("quantize", family_models("mixtral"), "--method", "fp8", "--scheme", "fp8-static", *CALIB_ARGS,
                 *LOOSE_GATE, "-o", out)
    assert result.exit_code == 0, result.output
    _model, source = artifact_reading(out).open()
    assert isinstance(source, SharedInputScales)
    stored = source.stored
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        for projections in (("gate_proj", "up_proj"), ("down_proj",)):
            names = [f"{prefix}.{e}.{p}.input_scale" for e in range(4) for p in projections]
            largest = torch.stack([stored.get(n).float().reshape(-1) for n in names]).amax(0)
            assert all(torch.equal(source.get(n).float().reshape(-1), largest) for n in names)
            own = {stored.get(n).item() for n in names}
            assert len(own) == 1 if projections != ("down_proj",) else len(own) > 1


def test_static_experts_store_one_weight_scale_and_read_as_vllm_requantizes_them(cli, family_models, tmp_path):
    """fp8-static on Qwen3-MoE: each expert projection's weight has one scale (vLLM 0.32's fused-MoE fp8 method loads
    static activation scales only beside per-tensor weights; tests/serve/test_moe_vllm_slow.py asks vLLM), the other
    Linears keep theirs per channel; vLLM runs gate and up of an expert with one scale, the larger, requantizing the
    other, and so does the gate: the weight it reads lies on the larger scale's fp8 grid, within half a step of the
    stored one, and the projection that holds the larger scale is read as stored."""
    import torch

    from quantkit.eval.experts import RequantizedGateUp
    from quantkit.formats.gate import artifact_reading

    out = tmp_path / "out"
    result = cli("quantize", family_models("qwen3moe"), "--method", "fp8", "--scheme", "fp8-static", *CALIB_ARGS,
                 *LOOSE_GATE, "-o", out)
    assert result.exit_code == 0, result.output
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    assert sorted(g["weights"]["strategy"] for g in groups) == ["channel", "tensor"]
    _model, source = artifact_reading(out).open()
    requantized = source.weights
    assert isinstance(requantized, RequantizedGateUp) and len(requantized.partner) == 2 * 4 * 2  # layers x experts
    changed = 0
    for name, partner in requantized.partner.items():
        own, other = (requantized.stored.get(f"{n}_scale").float().item() for n in (name, partner))
        stored, read = requantized.weights.get(name), source.get(name)
        larger = max(own, other)
        grid = (read.float() / larger).to(torch.float8_e4m3fn).float()  # the nearest point of the larger's grid
        assert torch.equal((grid * larger).to(read.dtype), read), name  # the weight in the model's dtype
        if own >= other:
            assert torch.equal(read, stored), name
        else:
            changed += 1
            # within half a step of e4m3 (3 mantissa bits; subnormal steps 2^-9) and the model dtype's rounding
            half = torch.clamp((stored.float() / larger).abs() / 8, min=2.0 ** -10) * larger
            assert bool(((read.float() - stored.float()).abs() <= half).all()), name
    assert 0 < changed <= len(requantized.partner) // 2  # at most one of each pair (random weights' scales differ)


def test_unknown_moe_architecture_is_refused_before_work(cli, family_models, tmp_path):
    """An MoE model_type without a row in quantkit.arch.moe's table: exit 2 naming the supported ones."""
    import shutil

    model = tmp_path / "moe"
    shutil.copytree(family_models("qwen3moe"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="olmoe", architectures=["OlmoeForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    result = cli("quantize", model, "--method", "gptq", *CALIB_ARGS, "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "olmoe" in result.output and "qwen3_moe" in result.output


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe", "qwen2moe"])
def test_plan_keeps_routers(cli, family_models, family):
    """`quantkit inspect` shows every router (and Qwen2-MoE's shared_expert_gate) kept 16-bit."""
    result = cli("inspect", family_models(family), "--method", "gptq", "--json", "-")
    assert result.exit_code == 0, result.output
    modules = json.loads(result.stdout)["modules"]
    routers = [m for m in modules if m["role"] == "router"]
    assert len(routers) == 2 * (2 if family == "qwen2moe" else 1)  # 2 layers; Qwen2-MoE adds shared_expert_gate
    assert all("kept: router" in m["precision"] for m in routers)
    assert all(m["precision"].startswith("int4") for m in modules if ".experts." in m["name"])
