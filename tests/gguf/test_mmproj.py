"""quantkit's mmproj .gguf (quantkit.gguf.mmproj) against llama.cpp's own converters, byte for byte.

The references (slow; skipped, saying so, without third_party/llama.cpp/src):
* Qwen2-VL, Qwen2.5-VL, Gemma 3: `convert_hf_to_gguf.py MODEL --mmproj --outfile X [--outtype T]`
  run with llama.cpp's own gguf-py.
* LLaVA 1.5 (CLIP tower): convert_hf_to_gguf.py refuses it ("Unsupported model type:
  clip_vision_model"); llama.cpp documents (docs/multimodal/llava.md) llava_surgery_v2.py, then
  convert_image_encoder_to_gguf.py on the split-off tower (`--clip-model-is-vision`, the tower's
  config.json beside it, the model's image_mean/std passed on). That script was written for
  transformers 4; under transformers 5 it is run with a shim that gives CLIPVisionModel back its
  transformers-4 face (float32 weights, a `vision_model` level, `vision_model.`-prefixed state
  dict names) and changes nothing in the script.
* Mistral 3: convert_hf_to_gguf.py with one line of its MmprojModel.filter_tensors let through:
  LlavaVisionModel writes the [IMG_BREAK] row of `embed_tokens.weight` as v.token_embd.img_break,
  but the filter drops every `language_model.*` tensor first, so the unpatched converter's file
  lacks the tensor and llama.cpp cannot load it (test_vlm_gguf shows both).
The whole files are compared: header, every metadata key (general.* included), tensor infos and
data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.gguf.test_vs_converter import LLAMA_SRC, ROOT, assert_same_file, need_llama_src, reference_gguf
from tests.gguf.vlms import build_vlm

MODERN_RUNNER = """
import runpy, sys
sys.path.insert(0, {src!r})
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
{patch}
runpy.run_path({script!r}, run_name="__main__")
"""
# MmprojModel.filter_tensors drops `language_model.*` before LlavaVisionModel takes the [IMG_BREAK] row: let
# embed_tokens.weight through to it (ModelBase's filter), everything else filtered as before
IMG_BREAK_PATCH = """
from conversion import base
mmproj_filter = base.MmprojModel.filter_tensors.__func__
def filter_tensors(cls, item):
    if item[0].endswith("embed_tokens.weight"):
        return base.ModelBase.filter_tensors.__func__(cls, item)
    return mmproj_filter(cls, item)
base.MmprojModel.filter_tensors = classmethod(filter_tensors)
"""
LEGACY_SHIM = """
import runpy, sys
import torch, transformers

base = transformers.CLIPVisionModel


class CLIPVisionModel(base):
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return super().from_pretrained(*args, dtype=torch.float32, **kwargs)

    @property
    def vision_model(self):
        return self

    def state_dict(self, *args, **kwargs):
        return {{"vision_model." + k: v for k, v in super().state_dict(*args, **kwargs).items()}}


setattr(sys.modules["transformers"], "CLIPVisionModel", CLIPVisionModel)  # the lazy module replaced itself
sys.argv = ["convert_image_encoder_to_gguf.py", *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""
CASES = [("llava", "auto"), ("llava", "f32"), ("qwen2_vl", "auto"), ("qwen2_vl", "f16"), ("qwen2_5_vl", "auto"),
         ("qwen2_5_vl", "f32"), ("qwen3_vl", "auto"), ("qwen3_vl", "f16"), ("qwen3_5", "auto"), ("qwen3_5_moe", "auto"), ("gemma4", "auto"), ("gemma4", "f16"),
         ("gemma4_clipped", "auto"), ("idefics3", "auto"),
         ("idefics3", "f16"), ("smolvlm", "auto"), ("mistral3", "auto"),
         ("mistral3", "f16"), ("gemma3", "auto"), ("gemma3", "f16"), ("gemma3", "bf16")]
_BUILT: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def vlm(tmp_path_factory):
    """vlm(kind, layout="hub", dtype="bf16"): a tiny VLM built once per session (read-only)."""

    def get(kind: str, layout: str = "hub", dtype: str = "bf16") -> Path:
        key = (kind, layout, dtype)
        if key not in _BUILT:
            out = build_vlm(kind, tmp_path_factory.mktemp("mmproj") / kind, layout=layout)
            _BUILT[key] = to_f16(out) if dtype == "f16" else out
        return _BUILT[key]

    return get


def to_f16(model_dir: Path) -> Path:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    save_file({k: v.half() for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})
    return model_dir


def run_python(code: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{LLAMA_SRC / 'gguf-py'}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def modern_reference(model: Path, out: Path, mmproj_type: str, img_break: bool = True) -> Path:
    """convert_hf_to_gguf.py --mmproj; img_break: with the [IMG_BREAK] row let through its filter
    (IMG_BREAK_PATCH; only a Pixtral tower takes it, other families are unaffected)."""
    args = [str(model), "--mmproj", "--outfile", str(out)] + ([] if mmproj_type == "auto" else ["--outtype", mmproj_type])
    run_python(MODERN_RUNNER.format(src=str(LLAMA_SRC), args=args, script=str(LLAMA_SRC / "convert_hf_to_gguf.py"),
                                    patch=IMG_BREAK_PATCH if img_break else ""), out.parent)
    return out


def legacy_reference(model: Path, work: Path, mmproj_type: str) -> Path:
    """llava_surgery_v2.py on a copy of the model, then convert_image_encoder_to_gguf.py on the
    split-off CLIP tower in a directory named like the model (general.name is its name)."""
    from quantkit.gguf.mmproj import image_stats

    legacy = LLAMA_SRC / "tools" / "mtmd" / "legacy-models"
    copy = shutil.copytree(model, work / "copy")
    run = subprocess.run([sys.executable, str(legacy / "llava_surgery_v2.py"), "-C", "-m", str(copy)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    vit = work / "vit" / model.name
    vit.mkdir(parents=True)
    shutil.copy(copy / "llava.clip", vit / "pytorch_model.bin")
    vision = {**json.loads((model / "config.json").read_text())["vision_config"], "architectures": ["CLIPVisionModel"]}
    (vit / "config.json").write_text(json.dumps(vision))
    stats = image_stats(model)
    args = ["-m", str(vit), "--llava-projector", str(copy / "llava.projector"), "--output-dir", str(work / "out"),
            "--clip-model-is-vision", "--image-mean", *map(str, stats["image_mean"]),
            "--image-std", *map(str, stats["image_std"])] + (["--use-f32"] if mmproj_type == "f32" else [])
    run_python(LEGACY_SHIM.format(args=args, script=str(legacy / "convert_image_encoder_to_gguf.py")), work)
    return next((work / "out").glob("mmproj-model-*.gguf"))


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.slow
@pytest.mark.parametrize("kind,mmproj_type", CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_mmproj_is_byte_identical_to_llama_cpp(vlm, tmp_path, kind, mmproj_type):
    from quantkit.gguf.mmproj import plan, write

    need_llama_src()
    model = vlm(kind)
    ours = write(plan(model, mmproj_type), model, tmp_path / "ours.gguf").path
    if kind == "llava":
        theirs = legacy_reference(model, tmp_path, mmproj_type)
    else:  # Gemma4VisionAudioModel maps every tensor the filter lets through: the [IMG_BREAK] patch would fail it
        theirs = modern_reference(model, tmp_path / "theirs.gguf", mmproj_type, img_break=not kind.startswith("gemma4"))
    assert tensor_types(ours) == tensor_types(theirs)
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.slow
def test_f16_checkpoint_mmproj_is_byte_identical_to_llama_cpp(vlm, tmp_path):
    """An f16 checkpoint: --outtype auto picks F16, the patch embedding is then F16 too."""
    from quantkit.gguf.mmproj import convert

    need_llama_src()
    model = vlm("qwen2_vl", dtype="f16")
    ours = convert(model, tmp_path / "ours.gguf").path
    theirs = modern_reference(model, tmp_path / "theirs.gguf", "auto")
    assert tensor_types(ours)["v.patch_embd.weight"] == "F16"
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "idefics3",
                                  "smolvlm", "mistral3", "gemma3", "gemma4"])
def test_language_model_equals_convert_hf_to_gguf(vlm, tmp_path, kind):
    """The VLM's language model .gguf: every metadata key (Qwen2-VL's rope.dimension_sections
    included) and tensor equal to convert_hf_to_gguf.py's (as tests/gguf/test_vs_converter.py; the
    toy BPE tokenizer needs its pre-tokenizer name patched in there)."""
    from quantkit.gguf.convert import convert

    need_llama_src()
    # Qwen3.5 without MTP layers: the converter's default asserts there is one, --no-mtp converts it
    extra = ("--no-mtp",) if kind in ("qwen3_5", "qwen3_5_moe") else ()
    theirs = reference_gguf(vlm(kind), tmp_path / "theirs.gguf", "bf16", "gpt-2", extra)
    ours = tmp_path / "ours.gguf"
    convert(vlm(kind), ours, "BF16")
    assert_same_file(ours, theirs)


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_transformers_5_layout_gives_the_hub_layout_file(vlm, tmp_path, kind):
    """transformers 5 saves CLIP/SigLIP towers without `vision_model.`; the mmproj is the same file."""
    from quantkit.gguf.mmproj import convert

    hub, saved = vlm(kind), vlm(kind, layout="transformers")
    assert not any(".vision_model." in n for n in json.loads(_header(saved)))
    a = convert(hub, tmp_path / "a.gguf").path
    b = convert(saved, tmp_path / "b.gguf").path
    assert _without_name(a) == _without_name(b)


def _header(model: Path) -> str:
    import struct

    with open(model / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode()


def _without_name(path: Path) -> dict:
    """Every metadata key and tensor (bytes) but the ones named after the directory."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if k not in ("general.name", "general.basename")}
    return {"fields": fields, "tensors": {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes()))
                                          for t in reader.tensors}}


def test_types_keep_a_bf16_tower_exactly(vlm, tmp_path):
    """auto on a bf16 tower: weights BF16, norms / biases / patch embedding F32 (the converter's
    rules); every stored value is the source's own, so the proof reports them all exact."""
    from quantkit.eval.vlm_proof import prove_mmproj
    from quantkit.gguf.mmproj import convert
    from quantkit.io.checkpoint import check_model_dir

    model = vlm("qwen2_5_vl")
    path = convert(model, tmp_path / "mmproj.gguf").path
    types = tensor_types(path)
    assert types["v.blk.0.attn_q.weight"] == types["mm.0.weight"] == "BF16"
    assert types["v.blk.0.attn_q.bias"] == types["v.blk.0.ln1.weight"] == types["v.patch_embd.weight.1"] == "F32"
    proof = prove_mmproj(path, check_model_dir(model))
    assert proof["source_values_exact"] == proof["tensors"] == len(types)
    assert proof["rounded_to_stored_type"] == [] and proof["left_out"] == {}


def test_llava_legacy_layout_and_proof(vlm, tmp_path):
    """LLaVA: the legacy CLIP format (fc1 stored as ffn_down), the last layer and post_layernorm left
    out with their reason, 2-D weights rounded to F16."""
    import gguf

    from quantkit.eval.vlm_proof import prove_mmproj
    from quantkit.gguf.mmproj import convert
    from quantkit.io.checkpoint import check_model_dir

    model = vlm("llava")
    path = convert(model, tmp_path / "mmproj.gguf").path
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["clip.projector_type"].contents() == "mlp"
    assert reader.fields["clip.vision.block_count"].contents() == 1
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes["v.blk.0.ffn_down.weight"] == (64, 128)  # fc1: 64 -> 128, ggml order
    assert not any(n.startswith("v.blk.1.") or n.startswith("v.post_ln") for n in shapes)
    proof = prove_mmproj(path, check_model_dir(model))
    assert set(proof["left_out"]) == {n for n in json.loads(_header(model)) if n.startswith("vision_tower.")
                                      and (".layers.1." in n or "post_layernorm" in n)}
    assert proof["tensors"] == len(shapes)


def test_changed_mmproj_tensor_fails_the_proof(vlm, tmp_path):
    import gguf

    from quantkit.errors import TowerChangedError
    from quantkit.eval.vlm_proof import prove_mmproj
    from quantkit.gguf.mmproj import convert
    from quantkit.io.checkpoint import check_model_dir

    model = vlm("gemma3")
    path = convert(model, tmp_path / "mmproj.gguf").path
    assert prove_mmproj(path, check_model_dir(model))["stored_plus_one"] == ["mm.soft_emb_norm.weight"]
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "v.blk.1.attn_v.weight")
    with open(path, "r+b") as f:
        f.seek(int(tensor.data_offset) + 10)
        byte = f.read(1)
        f.seek(int(tensor.data_offset) + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(TowerChangedError, match=r"1 mmproj tensors differ.*v\.blk\.1\.attn_v\.weight"):
        prove_mmproj(path, check_model_dir(model))


def _edit_config(model: Path, tmp_path: Path, **changes) -> Path:
    copy = shutil.copytree(model, tmp_path / model.name)
    config = json.loads((copy / "config.json").read_text())
    for key, value in changes.items():
        target = config
        *path, last = key.split("__")
        for part in path:
            target = target[part]
        target[last] = value
    (copy / "config.json").write_text(json.dumps(config))
    return copy


REFUSALS = [
    ("llava", {"vision_feature_layer": -1}, "auto", "vision_feature_layer -1"),
    ("llava", {"vision_config__model_type": "pixtral"}, "auto", "only a CLIP tower converts"),
    ("llava", {}, "bf16", "legacy CLIP format has no bf16"),
    ("qwen2_5_vl", {"vision_config__fullatt_block_indexes": [0, 3]}, "auto", "not evenly spaced"),
    ("qwen2_vl", {"vision_config__temporal_patch_size": 3}, "auto", "temporal_patch_size"),
    ("qwen3_vl", {"vision_config__deepstack_visual_indexes": [0, 3]}, "auto", "outside the 3 encoder blocks"),
    ("mistral3", {"vision_config__num_hidden_layers": 2}, "auto", "a Pixtral tower of 2 layers"),
    ("mistral3", {"vision_config__hidden_act": "relu"}, "auto", "Pixtral hidden_act 'relu'"),
    ("qwen3_vl", {"vision_config__deepstack_visual_indexes": [0, 2]}, "auto", "2 deepstack mergers for 2 decoder"),
]


@pytest.mark.parametrize("kind,changes,mmproj_type,message", REFUSALS, ids=[r[3] for r in REFUSALS])
def test_unsupported_features_are_refused(vlm, tmp_path, kind, changes, mmproj_type, message):
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.mmproj import plan

    with pytest.raises(UnsupportedError, match=message) as err:
        plan(_edit_config(vlm(kind), tmp_path, **changes), mmproj_type)
    assert err.value.exit_code == 2


def test_family_without_mmproj_names_what_is_supported():
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.mmproj import family_of

    with pytest.raises(UnsupportedError, match="no mmproj .* for 'paligemma'") as err:
        family_of({"model_type": "paligemma", "architectures": ["PaliGemmaForConditionalGeneration"]})
    assert "Qwen2.5-VL (qwen2_5_vl)" in err.value.hint and "mmproj: none" in err.value.hint


def test_tower_tensor_without_a_gguf_name_is_refused(vlm, tmp_path):
    from safetensors.torch import load_file, save_file

    from quantkit.errors import UnsupportedError
    from quantkit.gguf.mmproj import plan

    copy = shutil.copytree(vlm("qwen2_vl"), tmp_path / "m")
    state = load_file(str(copy / "model.safetensors"))
    state["visual.extra_norm.weight"] = state["visual.merger.ln_q.weight"].clone()
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedError, match="no GGUF name for tensor 'visual.extra_norm.weight'"):
        plan(copy)


def test_idefics3_language_model_needs_text_config_architectures():
    """convert_hf_to_gguf.py converts an Idefics3 / SmolVLM language model only through
    text_config.architectures (SmolVLM's name VLlama3ForCausalLM); without it: refused, saying so."""
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.convert import arch_spec

    config = {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3",
              "text_config": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2}}
    with pytest.raises(UnsupportedError, match="names no text_config.architectures") as err:
        arch_spec(config)
    assert err.value.exit_code == 2 and "VLlama3ForCausalLM" in err.value.hint
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    assert arch_spec(config).arch == "LLAMA"


def test_mistral3_with_another_text_model_is_refused():
    """Mistral3ForConditionalGeneration's converter takes a ministral3 / mistral4 text model through other
    classes (YaRN keys, DeepSeek-V2 layers): only a `mistral` text model converts here."""
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.convert import arch_spec

    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
              "text_config": {"model_type": "ministral3", "hidden_size": 64, "num_attention_heads": 2}}
    with pytest.raises(UnsupportedError, match="text model 'ministral3'") as err:
        arch_spec(config)
    assert err.value.exit_code == 2 and "mistral" in err.value.hint


def test_mistral3_mmproj_has_the_img_break_row(vlm):
    """LlavaVisionModel's v.token_embd.img_break: row [IMG_BREAK] of embed_tokens, F32, in checkpoint order."""
    import json

    from quantkit.gguf.mmproj import plan

    model = vlm("mistral3")
    added = {t["content"]: t["id"] for t in json.loads((model / "tokenizer.json").read_text())["added_tokens"]}
    (piece,) = [p for p in plan(model).pieces if p.name == "v.token_embd.img_break"]
    assert piece.source.endswith("embed_tokens.weight") and piece.part == added["[IMG_BREAK]"] > 0
    assert piece.shape == (json.loads((model / "config.json").read_text())["text_config"]["hidden_size"],)
    assert piece.qtype.name == "F32"


@pytest.mark.parametrize("where", ["tokenizer.json", "tokenizer_config.json"])
def test_mistral3_without_an_img_break_token_is_refused(vlm, tmp_path, where):
    """No [IMG_BREAK] in the tokenizer: llama.cpp cannot load the mmproj, refused naming the token
    (tokenizer_config.json's added_tokens_decoder is looked at first, as by the converter)."""
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.mmproj import plan

    copy = shutil.copytree(vlm("mistral3"), tmp_path / "m")
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "[IMG_BREAK]"]
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    if where == "tokenizer_config.json":  # found there: the tokenizer.json fallthrough is not needed
        config = json.loads((copy / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"] = {"7": {"content": "[IMG_BREAK]", "special": True}}
        (copy / "tokenizer_config.json").write_text(json.dumps(config))
        assert next(p for p in plan(copy).pieces if p.name == "v.token_embd.img_break").part == 7
        return
    with pytest.raises(UnsupportedError, match=r"the tokenizer has no \[IMG_BREAK\] added token") as err:
        plan(copy)
    assert err.value.exit_code == 2 and "mmproj: none" in err.value.hint
