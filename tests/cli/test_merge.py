"""`quantkit merge`: a merged checkpoint written atomically with tokenizer, report and model card;
bad adapters refused with exit 2 before any work, nothing left at OUT."""

import json
import shutil

import pytest

from tests.lora_util import make_adapter, make_base, read
from tests.util import leftovers


@pytest.fixture(scope="module")
def base(micro_model, tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("bases") / "tiny", micro_model)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return make_adapter(base, tmp_path_factory.mktemp("adapters") / "lora", seed=1)


def test_merge_writes_a_checkpoint_with_report_and_card(cli, base, adapter, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    result = cli("merge", base, "--lora", adapter, "-o", out, "--json", "-")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record == json.loads((out / "quantkit.json").read_text())
    assert record["command"] == "merge" and record["merge"]["adapters"][0]["path"] == str(adapter)
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "quantkit.json"} <= set(record["files"])
    assert sorted(p.name for p in out.iterdir()) == sorted(record["files"])
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: ") and str(adapter) in card
    assert leftovers(tmp_path, "merged") == ["merged"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert not any("lora" in k for k in read(out / "model.safetensors"))


def test_existing_output_is_refused_unless_overwrite(cli, base, adapter, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    result = cli("merge", base, "--lora", adapter, "-o", out)
    assert result.exit_code == 2 and "output already exists" in result.stderr
    assert cli("merge", base, "--lora", adapter, "-o", out, "--overwrite").exit_code == 0
    assert (out / "model.safetensors").is_file()


def rewrite(adapter, dest, change):
    """A copy of the adapter whose tensors `change` edits in place (dict of name -> tensor)."""
    from safetensors.torch import save_file

    shutil.copytree(adapter, dest)
    tensors = read(dest / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, dest / "adapter_model.safetensors")
    return dest


def damaged(kind, adapter, base, tmp_path, micro_model):
    """(extra CLI args, expected message) for each kind of bad input."""
    import torch

    q = "base_model.model.model.layers.0.self_attn.q_proj"
    if kind == "missing-module":  # trained on a 2-layer model, merged into a 1-layer one
        one_layer = make_base(tmp_path / "one-layer", micro_model, layers=1)
        return [one_layer, "--lora", adapter], "changes model.layers.1.self_attn.q_proj, which the base does not have"
    if kind == "pickle":
        bad = tmp_path / "pickled"
        shutil.copytree(adapter, bad)
        (bad / "adapter_model.safetensors").unlink()
        (bad / "adapter_model.bin").write_bytes(b"not unpickled")
        return [base, "--lora", bad], "has no adapter_model.safetensors"
    if kind == "truncated":
        bad = tmp_path / "truncated"
        shutil.copytree(adapter, bad)
        data = (bad / "adapter_model.safetensors").read_bytes()
        (bad / "adapter_model.safetensors").write_bytes(data[:-100])
        return [base, "--lora", bad], "is truncated"
    if kind == "ranks":
        bad = rewrite(adapter, tmp_path / "ranks", lambda t: t.update({f"{q}.lora_A.weight": torch.ones(8, 64)}))
        return [base, "--lora", bad], "incompatible LoRA ranks"
    if kind == "shape":
        bad = rewrite(adapter, tmp_path / "shape", lambda t: t.update({f"{q}.lora_A.weight": torch.ones(4, 128)}))
        return [base, "--lora", bad], "lora_A.weight has shape [4, 128], the base's model.layers.0.self_attn.q_proj needs [4, 64]"
    if kind == "weight-count":
        return [base, "--lora", adapter, "--lora-weight", "0.5", "--lora-weight", "1"], \
            "2 --lora-weight value(s) for 1 adapter(s)"
    if kind == "weighted-modules-to-save":
        whole = make_adapter(base, tmp_path / "whole", seed=2, modules_to_save=["lm_head"])
        return [base, "--lora", whole, "--lora-weight", "0.5"], "replaces lm_head whole"
    if kind == "tokens-without-embeddings":  # the adapter's tokenizer grew, its embedding rows were not saved
        from transformers import AutoTokenizer

        bad = tmp_path / "tokens"
        shutil.copytree(adapter, bad)
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.add_tokens(["<|tool|>"])
        tokenizer.save_pretrained(bad)
        return [base, "--lora", bad], "has 513 tokens, but the merged model's embeddings hold 512 rows"
    if kind == "original-without-mode":
        return [base, "--lora", adapter, "--original-base", base], "--merge-base original and --original-base DIR go together"
    if kind == "original-of-16-bit":
        return [base, "--lora", adapter, "--merge-base", "original", "--original-base", base], \
            "is not a bitsandbytes (QLoRA) base"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing-module", "pickle", "truncated", "ranks", "shape", "weight-count",
                                  "weighted-modules-to-save", "tokens-without-embeddings", "original-without-mode",
                                  "original-of-16-bit"])
def test_bad_input_exits_2_before_work(cli, base, adapter, micro_model, tmp_path, kind):
    args, message = damaged(kind, adapter, base, tmp_path, micro_model)
    result = cli("merge", *args, "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "merging" not in result.stderr  # refused before any weight was loaded
    assert leftovers(tmp_path, "out") == []


def test_same_checks_guard_quantize(cli, base, adapter, tmp_path, micro_model):
    args, message = damaged("missing-module", adapter, base, tmp_path, micro_model)
    result = cli("quantize", *args, "--method", "fp8", "-o", tmp_path / "out")
    assert result.exit_code == 2 and message in result.stderr


def test_merge_help_does_not_import_torch():
    import subprocess
    import sys

    from tests.util import subprocess_env

    code = "import sys; from quantkit.cli.app import app; from typer.testing import CliRunner; " \
           "r = CliRunner().invoke(app, ['merge', '--help']); assert r.exit_code == 0; " \
           "assert '--lora-weight' in r.output; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env())

