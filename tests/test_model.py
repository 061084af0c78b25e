import json

import pytest

from quantkit.errors import ModelError
from quantkit.model import check_model_dir, resolve_model


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


def test_hub_id_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="not in the local Hugging Face cache"):
        resolve_model("someorg/some-model")


def test_config_without_model_type(model_copy):
    (model_copy / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(ModelError, match="model_type"):
        check_model_dir(model_copy)


def test_load_by_tensor_equals_from_pretrained(micro_model):
    """The plain-read loader builds the same model, tensor for tensor, as from_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.model import load_by_tensor

    info = check_model_dir(micro_model)
    ours = load_by_tensor(info)
    theirs = AutoModelForCausalLM.from_pretrained(micro_model, dtype="auto")
    assert dict(ours.named_parameters()).keys() == dict(theirs.named_parameters()).keys()
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_load_by_tensor_refuses_tensors_the_model_does_not_use(model_copy):
    from safetensors.torch import load_file, save_file

    from quantkit.model import load_by_tensor

    weights = load_file(model_copy / "model.safetensors")
    weights["model.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="model.extra.weight"):
        load_by_tensor(check_model_dir(model_copy))
