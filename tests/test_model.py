import json

import pytest

from quantkit.errors import ModelError
from quantkit.io.checkpoint import check_model_dir, resolve_model


def test_check_reads_headers_without_torch(micro_model):
    info = check_model_dir(micro_model)
    assert info.architecture == "LlamaForCausalLM"
    assert info.num_parameters > 0 and info.dtype == "BF16"


def test_missing_dir(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        resolve_model(str(tmp_path / "absent"))


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        check_model_dir(tmp_path)


def test_truncated_safetensors(model_copy):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="truncated"):
        check_model_dir(model_copy)


def test_corrupt_header(model_copy):
    weights = model_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"not json at!"
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="corrupt"):
        check_model_dir(model_copy)


def test_pickle_only_checkpoint_refused(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "pytorch_model.bin")
    with pytest.raises(ModelError, match="safetensors only"):
        check_model_dir(model_copy)


def test_hub_id_not_cached_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="someorg/some-model@main is not in the Hugging Face cache"):
        resolve_model("someorg/some-model")


def test_config_without_model_type(model_copy):
    (model_copy / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(ModelError, match="model_type"):
        check_model_dir(model_copy)


def test_a_sub_model_whose_package_is_missing_is_refused_before_work(micro_model, tmp_path, monkeypatch):
    """Gemma 3n's vision tower is a timm model: without timm, transformers raised ImportError after
    the run had started (exit 1); the config says so up front (exit 2, naming the package)."""
    import importlib.util
    import shutil

    from quantkit.io.checkpoint import check_submodel_packages

    model = shutil.copytree(micro_model, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["vision_config"] = {"model_type": "gemma3n_vision", "architecture": "mobilenetv5_300m_enc"}
    (model / "config.json").write_text(json.dumps(config))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else real(name, *a))
    with pytest.raises(ModelError, match="vision_config is a gemma3n_vision model.*`timm` package") as err:
        check_submodel_packages(check_model_dir(model))
    assert err.value.hint.startswith("pip install timm")
    check_submodel_packages(check_model_dir(micro_model))  # nothing to import
