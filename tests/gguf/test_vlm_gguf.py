"""`quantkit quantize VLM --method gguf`: the language model .gguf, its mmproj .gguf and a Modelfile
using both; quantkit.json reports both and the mmproj proof; the gate scores the language model.
Slow: llama.cpp's multimodal CLI (llama-mtmd-cli, scripts/build_llamacpp.sh) runs an image through
quantkit's two files for every family, Mistral 3 included (its mmproj has the [IMG_BREAK] row that
llama.cpp's own converter drops; skipped, saying so, without the binary)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.gguf.helpers import need_llama
from tests.gguf.test_vs_converter import need_llama_src
from tests.gguf.vlms import KINDS, build_vlm
from tests.util import leftovers

CALIB = ("--num-samples", "8", "--seq-len", "64", "--eval-windows", "4", "--no-gate")
# llama.cpp's built-in chat template for each family (the tiny fixtures' own templates are minimal Jinja)
CHAT_TEMPLATES = {"llava": "vicuna", "qwen2_vl": "chatml", "qwen2_5_vl": "chatml", "qwen3_vl": "chatml",
                  "qwen3_5": "chatml", "qwen3_5_moe": "chatml", "gemma4": "gemma", "idefics3": "smolvlm", "smolvlm": "smolvlm", "mistral3": "mistral-v7", "gemma3": "gemma"}


@pytest.fixture(scope="session")
def hub_vlm(tmp_path_factory):
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = build_vlm(kind, tmp_path_factory.mktemp("vlm-gguf") / kind)
        return made[kind]

    return get


def quantize(cli, model, out, *extra):
    return cli("quantize", model, "--method", "gguf", "-o", out, *CALIB, *extra)


def test_vlm_gets_language_model_mmproj_and_modelfile(cli, hub_vlm, tmp_path):
    model, out = hub_vlm("gemma3"), tmp_path / "out"
    result = quantize(cli, model, out, "--gguf-type", "Q8_0")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("*.gguf")) == ["gemma3-Q8_0.gguf", "mmproj-gemma3-BF16.gguf"]
    assert (out / "Modelfile").read_text().splitlines()[:2] == ["FROM ./gemma3-Q8_0.gguf",
                                                                "FROM ./mmproj-gemma3-BF16.gguf"]
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    mmproj = entry["details"]["gguf"]["mmproj"]
    assert mmproj["file"] == "mmproj-gemma3-BF16.gguf" and mmproj["written"] and mmproj["type"] == "BF16"
    assert mmproj["converter"] == "llama.cpp convert_hf_to_gguf.py --mmproj"
    proof = entry["details"]["towers"]
    assert proof["mmproj"] == mmproj["file"] and proof["tensors"] == mmproj["tensors"]
    assert proof["source_values_exact"] + len(proof["stored_plus_one"]) == proof["tensors"]
    assert entry["metrics"]["kld_mean"] < 0.05  # the gate scored the language model
    assert "mmproj-gemma3-BF16.gguf" in (out / "README.md").read_text()


def test_mmproj_none_writes_the_language_model_alone_and_says_so(cli, hub_vlm, tmp_path):
    model, out = hub_vlm("qwen2_vl"), tmp_path / "out"
    result = quantize(cli, model, out, "--gguf-type", "Q8_0", "--mmproj", "none")
    assert result.exit_code == 0, result.output
    assert [p.name for p in out.glob("*.gguf")] == ["qwen2_vl-Q8_0.gguf"]
    assert "mmproj" not in (out / "Modelfile").read_text()
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert entry["details"]["gguf"]["mmproj"]["written"] is False
    assert entry["details"]["towers"]["image_forward"].startswith("skipped: mmproj: none")
    assert "cannot read images" in (out / "README.md").read_text()


def test_vlm_without_image_processor_config_is_refused_before_work(cli, hub_vlm, tmp_path):
    model = shutil.copytree(hub_vlm("qwen2_5_vl"), tmp_path / "m")
    (model / "preprocessor_config.json").unlink()
    result = quantize(cli, model, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "no image processor config with image_mean / image_std" in result.stderr
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("flag", ["--auto-precision", "--fallback"])
def test_measured_per_tensor_types_of_a_vlm_refused_before_work(cli, hub_vlm, tmp_path, flag):
    """The sensitivity probes stream a text decoder; a VLM's forward is not one: exit 2 before any work, with the
    setting that chooses the types by the weighted error alone."""
    result = quantize(cli, hub_vlm("gemma3"), tmp_path / "out", flag)
    assert result.exit_code == 2, result.output
    assert "layer-streamed forward" in result.stderr and "measure_windows: 0" in result.stderr
    assert "baseline" not in result.stderr and leftovers(tmp_path, "out") == []


def test_mmproj_type_f16_names_and_types_the_file(cli, hub_vlm, tmp_path):
    import gguf

    out = tmp_path / "out"
    assert quantize(cli, hub_vlm("qwen2_5_vl"), out, "--gguf-type", "Q8_0", "--mmproj", "f16").exit_code == 0
    reader = gguf.GGUFReader(str(out / "mmproj-qwen2_5_vl-F16.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["v.blk.0.attn_q.weight"] == types["v.patch_embd.weight"] == "F16"
    proof = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["towers"]
    assert proof["tensors"] == len(types)  # bf16 -> f16: the values that f16 cannot hold are reported rounded
    assert proof["source_values_exact"] + len(proof["rounded_to_stored_type"]) == len(types)


def test_mistral3_without_img_break_token_is_refused_before_work(cli, hub_vlm, tmp_path):
    model = shutil.copytree(hub_vlm("mistral3"), tmp_path / "m")
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "[IMG_BREAK]"]
    (model / "tokenizer.json").write_text(json.dumps(tok))
    result = quantize(cli, model, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "no [IMG_BREAK] added token" in result.stderr and "mmproj: none" in result.stderr
    assert leftovers(tmp_path, "out") == []


@pytest.mark.slow
def test_llama_cpp_cannot_load_its_converters_mistral3_mmproj(hub_vlm, tmp_path):
    """Why quantkit's Mistral 3 mmproj is compared with a converter whose filter lets the [IMG_BREAK]
    row through: the unpatched converter's file for a Hugging Face-layout checkpoint lacks
    v.token_embd.img_break, and llama.cpp's clip loader refuses it."""
    from tests.gguf.test_mmproj import modern_reference
    from tests.gguf.test_vs_converter import reference_gguf

    exe = need_llama("llama-mtmd-cli")
    need_llama_src()
    model = hub_vlm("mistral3")
    mmproj = modern_reference(model, tmp_path / "mmproj.gguf", "auto", img_break=False)
    language_model = reference_gguf(model, tmp_path / "model.gguf", "bf16", "gpt-2")
    run = subprocess.run([str(exe), "-m", str(language_model), "--mmproj", str(mmproj), "-p", "x", "-n", "1",
                          "-t", "2"], capture_output=True, timeout=600)
    assert run.returncode != 0
    assert "unable to find tensor v.token_embd.img_break" in run.stderr.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_llama_mtmd_cli_runs_an_image_through_quantkits_files(cli, hub_vlm, tmp_path, kind):
    """llama.cpp loads the Q4_K_M language model and the mmproj, encodes the image and generates."""
    from quantkit.eval.vlm_proof import synthetic_image

    exe = need_llama("llama-mtmd-cli")
    out = tmp_path / "out"
    assert quantize(cli, hub_vlm(kind), out).exit_code == 0
    image = tmp_path / "image.png"
    synthetic_image().save(image)
    (mmproj,) = out.glob("mmproj-*.gguf")
    run = subprocess.run([str(exe), "-m", str(out / f"{kind}-Q4_K_M.gguf"), "--mmproj", str(mmproj),
                          "--image", str(image), "-p", "What is in the picture?", "-n", "4", "--temp", "0",
                          "-t", "2", "--chat-template", CHAT_TEMPLATES[kind], "-lv", "4"],
                         capture_output=True, timeout=600)
    stderr = run.stderr.decode(errors="replace")
    assert run.returncode == 0, stderr[-3000:]
    assert re.search(r"image decoded \(batch 1/1\)", stderr), stderr[-3000:]  # the vision tower ran
    assert run.stdout.decode(errors="replace").strip(), stderr[-3000:]  # and tokens came out
