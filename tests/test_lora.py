"""LoRA merges are exact: every merged element is the base-dtype rounding of the float32 update
written out from the formulas (W + w·s·B·A; DoRA m·V/‖V‖), for each kind of adapter peft makes."""

import json

import pytest

from tests.lora_util import (
    adapter_tensors,
    lora_modules,
    make_adapter,
    make_base,
    make_nf4_base,
    make_qlora_adapter,
    merged_weight,
    read,
)


@pytest.fixture(scope="module")
def base(micro_model, tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("bases") / "tiny", micro_model)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "lora": make_adapter(base, root / "lora", seed=1),
        "rslora": make_adapter(base, root / "rslora", seed=2, r=8, lora_alpha=16, use_rslora=True,
                               target_modules=["q_proj", "k_proj", "o_proj", "up_proj"]),
        "dora": make_adapter(base, root / "dora", seed=3, use_dora=True),
        "second": make_adapter(base, root / "second", seed=4, target_modules=["v_proj", "down_proj"]),
    }


def merge(base, adapter_dirs, out, weights=None, **kwargs):
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.lora import merge as run_merge
    from quantkit.run.lora import plan_merge

    plan = plan_merge(check_model_dir(base), str(base), [str(a) for a in adapter_dirs], weights, **kwargs)
    report = run_merge(plan, out / "merged", out / "work")
    return report, read(out / "merged" / "model.safetensors")


def config(adapter):
    return json.loads((adapter / "adapter_config.json").read_text())


def assert_exact(merged, expected):
    """Equal to the float32 result rounded to the stored dtype, element for element."""
    import torch

    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, expected.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["lora", "rslora", "dora"])
def test_merge_is_the_rounded_float32_update(base, adapters, kind, tmp_path):
    adapter = adapters[kind]
    report, merged = merge(base, [adapter], tmp_path)
    before, tensors = read(base / "model.safetensors"), adapter_tensors(adapter)
    modules = lora_modules(tensors)
    assert len(modules) >= 4
    for module in modules:
        key = f"{module}.weight"
        assert not (merged[key] == before[key]).all()
        assert_exact(merged[key], merged_weight(before[key], tensors, module, config(adapter)))
    untouched = [k for k in before if k.removesuffix(".weight") not in modules]
    assert untouched and all((merged[k] == before[k]).all() for k in untouched)
    assert report.dtype == "bfloat16" and report.merge_base == "16-bit"
    assert report.adapters[0]["use_dora"] is (kind == "dora")
    assert report.adapters[0]["use_rslora"] is (kind == "rslora")


def test_two_adapters_with_weights_merge_in_order(base, adapters, tmp_path):
    first, second = adapters["lora"], adapters["second"]
    report, merged = merge(base, [first, second], tmp_path, weights=[0.5, 1.5])
    before, a, b = read(base / "model.safetensors"), adapter_tensors(first), adapter_tensors(second)
    shared = "model.layers.0.self_attn.v_proj"  # both adapters change it
    assert shared in lora_modules(a) and shared in lora_modules(b)
    for module in sorted(set(lora_modules(a)) | set(lora_modules(b))):
        expected = before[f"{module}.weight"].float()
        if module in lora_modules(a):
            expected = merged_weight(expected, a, module, config(first), 0.5)
        if module in lora_modules(b):
            expected = merged_weight(expected, b, module, config(second), 1.5)
        assert_exact(merged[f"{module}.weight"], expected)
    assert [x["weight"] for x in report.adapters] == [0.5, 1.5]


def test_added_tokens_and_modules_to_save(base, tmp_path):
    """The base is resized before the adapter loads; embeddings and head come from the adapter,
    the tokenizer and chat template from the adapter dir."""
    from transformers import AutoTokenizer

    adapter = make_adapter(base, tmp_path / "chat", seed=5, added_tokens=["<|tool|>", "<|result|>"],
                           modules_to_save=["embed_tokens", "lm_head"])
    report, merged = merge(base, [adapter], tmp_path)
    tensors, before = adapter_tensors(adapter), read(base / "model.safetensors")
    assert merged["model.embed_tokens.weight"].shape[0] == 514 == report.vocab_size
    assert_exact(merged["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert_exact(merged["lm_head.weight"], tensors["lm_head.weight"])
    assert not (merged["lm_head.weight"][:512] == before["lm_head.weight"]).all()
    for module in lora_modules(tensors):
        assert_exact(merged[f"{module}.weight"], merged_weight(before[f"{module}.weight"], tensors, module,
                                                               config(adapter)))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert len(tokenizer) == 514 and tokenizer.convert_tokens_to_ids("<|result|>") == 513
    assert tokenizer.chat_template.startswith("{% for m in messages %}[")
    assert report.tokenizer_from == str(adapter)
    assert report.adapters[0]["replaced_modules"] == ["lm_head", "model.embed_tokens"]


def test_tied_embeddings_are_untied_when_the_adapter_changes_the_head(micro_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    tied = make_base(tmp_path / "tied", micro_model, tied=True)
    adapter = make_adapter(tied, tmp_path / "head", seed=6, target_modules=["q_proj", "lm_head"])
    report, merged = merge(tied, [adapter], tmp_path)
    tensors, embedding = adapter_tensors(adapter), read(tied / "model.safetensors")["model.embed_tokens.weight"]
    assert report.untied_embeddings
    assert torch.equal(merged["model.embed_tokens.weight"], embedding)  # the lookup table the adapter left alone
    assert_exact(merged["lm_head.weight"], merged_weight(embedding, tensors, "lm_head", config(adapter)))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert reloaded.config.tie_word_embeddings is False
    assert torch.equal(reloaded.lm_head.weight, merged["lm_head.weight"])


def test_tied_base_stays_tied_when_the_adapter_leaves_the_embeddings(micro_model, tmp_path):
    tied = make_base(tmp_path / "tied", micro_model, tied=True)
    report, merged = merge(tied, [make_adapter(tied, tmp_path / "attn", seed=7)], tmp_path)
    assert not report.untied_embeddings and "lm_head.weight" not in merged
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is True


def test_a_different_recorded_base_is_a_warning(base, adapters, tmp_path):
    adapter = tmp_path / "renamed"
    import shutil

    shutil.copytree(adapters["lora"], adapter)
    data = {**config(adapter), "base_model_name_or_path": "meta-llama/Llama-3.1-8B"}
    (adapter / "adapter_config.json").write_text(json.dumps(data))
    report, _ = merge(base, [adapter], tmp_path)
    assert report.warnings == [f"adapter {adapter} was trained on 'meta-llama/Llama-3.1-8B', merged into '{base}'"]


@pytest.fixture(scope="module")
def qlora(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    nf4 = make_nf4_base(base, root / "nf4")
    return nf4, make_qlora_adapter(nf4, root / "adapter", seed=8)


def dequantized(nf4):
    """Every 4-bit weight of the checkpoint as bitsandbytes dequantizes it (a QLoRA forward's values)."""
    import bitsandbytes.functional as F
    import torch

    tensors = read(nf4 / "model.safetensors")
    packed = {k.split(".quant_state.")[0] for k in tensors if ".quant_state." in k}
    weights = {}
    for name in packed:
        state = F.QuantState.from_dict({k[len(name) + 1:]: v for k, v in tensors.items()
                                        if k.startswith(name + ".")}, torch.device("cpu"))
        weights[name] = F.dequantize_4bit(tensors[name], state)
    return weights


def test_qlora_merges_into_the_dequantized_4bit_weights(qlora, tmp_path):
    nf4, adapter = qlora
    report, merged = merge(nf4, [adapter], tmp_path)
    tensors, deq = adapter_tensors(adapter), dequantized(nf4)
    assert report.merge_base == "dequantized" and report.dtype == "bfloat16"
    assert not any("absmax" in k or "quant" in k for k in merged)
    for module in lora_modules(tensors):
        assert_exact(merged[f"{module}.weight"], merged_weight(deq[f"{module}.weight"], tensors, module, config(adapter)))
    other = "model.layers.0.mlp.up_proj.weight"  # 4-bit in the base, not in the adapter
    assert (merged[other] == deq[other]).all()
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())


def test_qlora_merges_into_the_original_when_asked(base, qlora, tmp_path):
    nf4, adapter = qlora
    report, merged = merge(nf4, [adapter], tmp_path, merge_base="original", original_base=str(base))
    tensors, before = adapter_tensors(adapter), read(base / "model.safetensors")
    assert report.merge_base == "original" and report.original_base == str(base)
    for module in lora_modules(tensors):
        assert_exact(merged[f"{module}.weight"], merged_weight(before[f"{module}.weight"], tensors, module,
                                                               config(adapter)))
    assert (merged["model.layers.0.mlp.up_proj.weight"] == before["model.layers.0.mlp.up_proj.weight"]).all()


# ---------------------------------------------------------------- merge-then-quantize


@pytest.fixture(scope="module")
def micro_adapter(micro_model, tmp_path_factory):
    return make_adapter(micro_model, tmp_path_factory.mktemp("adapters") / "micro-lora", seed=9)


def test_quantize_with_lora_measures_against_the_merged_model(cli, micro_model, micro_adapter, tmp_path):
    from tests.util import FAST_CALIB

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--lora", micro_adapter, "--lora-weight", "0.5", "--method", "fp8",
                 "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    assert report["recipe"]["lora"] == [str(micro_adapter)] and report["recipe"]["lora_weights"] == [0.5]
    assert report["merge"]["adapters"][0]["weight"] == 0.5 and report["merge"]["merge_base"] == "16-bit"
    assert report["targets"][0]["metrics"]["kld_mean"] < 0.01  # vs the merged base, not the original
    assert report["model"]["path"] == str(micro_model)


def test_a_vlm_with_a_language_model_adapter_keeps_its_processor_files_and_towers(cli, tmp_path):
    """LLaVA + a LoRA adapter on its language model: the merged checkpoint carries the processor,
    chat template and tokenizer files into the artifact; the towers stay bit-identical to the base's
    (the gate's proof) and an image+text forward runs on the reloaded artifact."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from tests.vlm_models import build_family

    base = build_family("llava", tmp_path / "llava")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                  target_modules=r".*language_model.*\.(q_proj|v_proj)"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out"
    result = cli("quantize", base, "--lora", tmp_path / "adapter", "--method", "fp8", "-o", out,
                 "--num-samples", "8", "--seq-len", "64", "--eval-windows", "2", "--no-gate")  # random model
    assert result.exit_code == 0, result.output
    side = ("processor_config.json", "chat_template.jinja", "tokenizer.json")  # tokenizer_config.json is re-saved
    assert all((out / name).read_bytes() == (base / name).read_bytes() for name in side)
    assert (out / "tokenizer_config.json").is_file()
    report = json.loads((out / "quantkit.json").read_text())
    towers = report["targets"][0]["details"]["towers"]
    assert report["merge"] and towers["tower_tensors_identical"] > 0 and towers["image_forward"] == "ran"


def test_missing_adapter_is_bad_input(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--lora", tmp_path / "none", "--method", "fp8", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "LoRA adapter directory not found" in result.stderr


def test_not_an_adapter(cli, micro_model, tmp_path):
    from tests.util import FAST_CALIB

    (tmp_path / "empty").mkdir()
    result = cli("quantize", micro_model, "--lora", tmp_path / "empty", "--method", "fp8", "-o", tmp_path / "out",
                 *FAST_CALIB)
    assert result.exit_code == 2 and "not a LoRA adapter" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("targets", [["c_attn", "c_proj"], r".*\.attn\.c_attn"])
def test_an_adapter_targeting_modules_the_base_lacks_is_bad_input(cli, base, adapters, tmp_path, targets):
    """Names (as list or regex) that match no module of the base: exit 2 naming them, before any work,
    whatever the installed peft raises when it meets them (NoMatchingPeftModuleError in 0.21)."""
    import shutil

    import peft

    adapter = tmp_path / "other"
    shutil.copytree(adapters["lora"], adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({**config(adapters["lora"]), "target_modules": targets}))
    result = cli("merge", base, "--lora", adapter, "-o", tmp_path / "out")
    assert result.exit_code == 2, (peft.__version__, result.output)
    assert "c_attn" in result.stderr and "q_proj" in result.stderr and not (tmp_path / "out").exists()


def test_already_quantized_model_refused(cli, micro_model, tmp_path):
    from tests.util import FAST_CALIB

    fp8 = tmp_path / "fp8"
    assert cli("quantize", micro_model, "--method", "fp8", "-o", fp8, *FAST_CALIB).exit_code == 0
    result = cli("quantize", fp8, "--method", "fp8", "-o", tmp_path / "again")
    assert result.exit_code == 2 and "already quantized" in result.stderr


def test_quantize_a_qlora_base_with_its_adapter(cli, qlora, tmp_path):
    """The QLoRA case: a 4-bit base plus its adapter quantizes (the base dequantized, then merged)."""
    from tests.util import FAST_CALIB

    nf4, adapter = qlora
    out = tmp_path / "out"
    result = cli("quantize", nf4, "--lora", adapter, "--method", "fp8", "-o", out, *FAST_CALIB, "--no-gate")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    assert report["merge"]["merge_base"] == "dequantized"
    assert report["targets"][0]["metrics"]["kld_mean"] < 0.05
