"""Custom model code (config.json `auto_map`) runs only with --trust-remote-code, on every load:
base model, tokenizer, LoRA merge, and the artifact reloaded for the gate or `quantkit eval`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_lora import micro_adapter  # noqa: F401 - the shared LoRA adapter fixture
from tests.util import FAST_CALIB, leftovers

CONFIG_CODE = '''
from pathlib import Path
Path({marker!r}).write_text("configuration module imported")
from transformers import LlamaConfig


class EvilConfig(LlamaConfig):
    model_type = {model_type!r}
'''

MODELING_CODE = '''
from pathlib import Path
Path({marker!r}).write_text("modeling module imported")
from transformers import LlamaForCausalLM

from .configuration_evil import EvilConfig


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
'''


def remote_code_model(micro_model: Path, dest: Path, model_type: str) -> tuple[Path, Path]:
    """A copy of the micro model whose config.json points at custom code that leaves a marker
    file when imported. Returns (model dir, marker path)."""
    shutil.copytree(micro_model, dest)
    marker = dest.parent / f"{dest.name}.REMOTE_CODE_RAN"
    (dest / "configuration_evil.py").write_text(CONFIG_CODE.format(marker=str(marker), model_type=model_type))
    (dest / "modeling_evil.py").write_text(MODELING_CODE.format(marker=str(marker)))
    config = json.loads((dest / "config.json").read_text())
    config.update(model_type=model_type, architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (dest / "config.json").write_text(json.dumps(config))
    return dest, marker


@pytest.fixture
def known_type(micro_model, tmp_path):
    """model_type llama (transformers has the class) plus an auto_map: the hostile-looking case."""
    return remote_code_model(micro_model, tmp_path / "known", "llama")


@pytest.fixture
def custom_type(micro_model, tmp_path):
    """A model_type only the custom code defines."""
    return remote_code_model(micro_model, tmp_path / "custom", "evilremote")


def test_fixture_code_does_run_when_trusted(custom_type):
    from transformers import AutoConfig

    model, marker = custom_type
    AutoConfig.from_pretrained(model, trust_remote_code=True, local_files_only=True)
    assert marker.is_file()


def test_full_run_never_imports_remote_code_without_the_flag(cli, known_type, tmp_path):
    """Base load, tokenizer, artifact reload for the gate, then `quantkit eval`: no custom code."""
    model, marker = known_type
    out = tmp_path / "out"
    result = cli("quantize", model, "--method", "fp8", "-o", out, *FAST_CALIB, "--min-top1", "0.5")
    assert result.exit_code == 0, result.output
    result = cli("eval", out, "--against", model, "--num-windows", 2, "--seq-len", 64)
    assert result.exit_code == 0, result.output
    assert not marker.exists()


def test_custom_architecture_needs_the_flag(cli, custom_type, tmp_path):
    model, marker = custom_type
    result = cli("quantize", model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 2, result.output
    assert "--trust-remote-code" in result.stderr or "trust_remote_code" in result.stderr
    assert not marker.exists()
    assert leftovers(tmp_path, "out") == []


@pytest.mark.slow
def test_custom_architecture_runs_with_the_flag(cli, custom_type, tmp_path):
    """With --trust-remote-code the same run loads the custom classes everywhere and passes."""
    model, marker = custom_type
    out = tmp_path / "out"
    result = cli("quantize", model, "--method", "fp8", "--trust-remote-code", "-o", out, *FAST_CALIB,
                 "--min-top1", "0.5")
    assert result.exit_code == 0, result.output
    assert marker.is_file()
    result = cli("eval", out, "--against", model, "--trust-remote-code", "--num-windows", 2, "--seq-len", 64)
    assert result.exit_code == 0, result.output


def test_eval_of_a_custom_artifact_needs_the_flag(cli, micro_model, custom_type, tmp_path):
    artifact, marker = custom_type
    result = cli("eval", artifact, "--against", micro_model, "--num-windows", 2, "--seq-len", 64)
    assert result.exit_code == 2, result.output
    assert not marker.exists()


def test_lora_merge_needs_the_flag(cli, custom_type, micro_adapter, tmp_path):
    model, marker = custom_type
    result = cli("quantize", model, "--lora", micro_adapter, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 2, result.output
    assert not marker.exists()


class Stop(Exception):
    pass


def test_loads_pass_the_flag_through(monkeypatch, tmp_path):
    """The LoRA merge and the artifact reload forward trust_remote_code (recorded, nothing loaded)."""
    from quantkit.formats import gate, transformers
    from quantkit.io.checkpoint import ModelInfo
    from quantkit.run import lora

    seen = []

    def record(label):
        def loader(*args, trust_remote_code=None, **kwargs):
            seen.append((label, trust_remote_code))
            raise Stop
        return loader

    class Recorder:
        from_pretrained = staticmethod(record("artifact"))

    monkeypatch.setattr(lora, "require", lambda *args: None)
    monkeypatch.setattr(lora, "load_model", record("merge base"))
    monkeypatch.setattr("quantkit.engines.transformers.auto_model_class", lambda config: Recorder)
    monkeypatch.setattr(gate, "detect", lambda path: transformers.FORMAT)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    info = ModelInfo(tmp_path, {}, [], "LlamaForCausalLM", "llama")
    plan = lora.MergePlan(base=info, adapters=[], merge_base="16-bit", original=None, vocab_size=None, untie=False,
                          tokenizer_dir=tmp_path, trust_remote_code=True)
    for call in (lambda: lora.merge(plan, tmp_path / "merged", tmp_path / "work"),
                 lambda: gate.load_artifact(tmp_path, trust_remote_code=True)):
        with pytest.raises(Stop):
            call()
    assert seen == [("merge base", True), ("artifact", True)]
