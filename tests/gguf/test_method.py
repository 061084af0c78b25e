"""The gguf method plugin: options, checks, quantize(job) outputs, Modelfile."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from quantkit.errors import InputError, UnsupportedError
from quantkit.methods import ModelHandle, QuantizeJob
from quantkit.methods import gguf as method


def test_options_validate_type_and_aliases():
    assert method.Options().gguf_type == "Q4_K_M"
    assert method.Options(gguf_type="q5_k").gguf_type == "Q5_K_M"
    with pytest.raises(Exception) as info:
        method.Options(gguf_type="Q9_K")
    assert "Q4_K_M" in str(info.value)
    with pytest.raises(Exception):
        method.Options(bogus=1)


@pytest.mark.parametrize("gguf_type,imatrix,uses", [("Q4_K_M", "auto", True), ("Q2_K", "auto", True),
                                                    ("Q6_K", "auto", False), ("Q8_0", "auto", False),
                                                    ("Q4_K_M", "none", False), ("Q6_K", "x.gguf", True)])
def test_imatrix_auto_policy(gguf_type, imatrix, uses):
    assert method.uses_imatrix(method.Options(gguf_type=gguf_type, imatrix=imatrix)) is uses


def test_check_rejects_architecture_and_missing_imatrix(micro, tmp_path):
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(micro)
    method.check(info, method.Options(), None)
    with pytest.raises(InputError, match="imatrix file not found"):
        method.check(info, method.Options(imatrix=str(tmp_path / "missing.gguf")), None)
    bad = SimpleNamespace(config={"architectures": ["BloomForCausalLM"]}, tensors={})
    with pytest.raises(UnsupportedError) as err:
        method.check(bad, method.Options(), None)
    assert err.value.exit_code == 2 and "LlamaForCausalLM" in err.value.hint


def test_iq_mixes_refused_before_work_without_kernel_or_imatrix(micro, monkeypatch):
    """A mix using a type without a kernel is refused (exit 2, naming the type); one whose tensors need
    an imatrix is refused with imatrix none (exit 2, naming --imatrix), as llama.cpp refuses it."""
    from gguf import GGMLQuantizationType as QT

    from quantkit.gguf import quants
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(micro)
    method.check(info, method.Options(gguf_type="IQ4_XS", imatrix="none"), None)
    monkeypatch.setattr(quants, "SUPPORTED", tuple(t for t in quants.SUPPORTED if t != QT.IQ4_XS))
    with pytest.raises(Exception, match="IQ4_XS.*no quantization kernel"):
        method.Options(gguf_type="IQ4_XS")
    monkeypatch.setattr(quants, "SUPPORTED", tuple(t for t in quants.SUPPORTED if t != QT.Q6_K))
    with pytest.raises(UnsupportedError, match="uses Q6_K") as err:  # IQ4_NL's output.weight
        method.check(info, method.Options(gguf_type="IQ4_NL", imatrix="none"), None)
    assert err.value.exit_code == 2
    monkeypatch.setattr(quants, "SUPPORTED", tuple(QT))  # as if every kernel existed
    with pytest.raises(InputError, match="needs an importance matrix") as err:
        method.check(info, method.Options(gguf_type="IQ2_XXS", imatrix="none"), None)
    assert err.value.exit_code == 2 and "--imatrix" in err.value.hint
    method.check(info, method.Options(gguf_type="IQ3_S", imatrix="none"), None)  # IQ3_S needs none


def test_iq_mix_imatrix_auto_policy():
    for gguf_type in ("IQ4_NL", "IQ4_XS"):
        assert method.uses_imatrix(method.Options(gguf_type=gguf_type))
    assert method.default_gate(method.Options(gguf_type="IQ4_XS")) == method.DEFAULT_GATE


def test_precision_for_plan():
    opts = method.Options()
    assert method.precision("decoder", opts, "model.layers.0.mlp.up_proj", [768, 256]) == "gguf Q4_K (Q4_K_M mix)"
    assert method.precision("lm_head", opts, "lm_head", [1024, 256]) == "gguf Q6_K"
    assert method.precision("decoder", method.Options(gguf_type="F16"), "x", [8, 8]) == "gguf F16"


@pytest.mark.parametrize("gguf_type", ["Q4_K_M", "Q2_K", "Q3_K_M"])
def test_plan_types_are_the_written_types(micro, tmp_path, gguf_type):
    """exact_types, and so the plan, give each weight the type the GGUF file gets."""
    import gguf

    from quantkit.gguf import convert as conv
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.plan import build_plan

    info = check_model_dir(micro)
    opts = method.Options(gguf_type=gguf_type, imatrix="none")
    types = method.METHOD.layers.exact_types(info, opts)
    plan = {e.name: e.precision for e in build_plan(info, method.METHOD, opts, [])}
    out = conv.convert(micro, tmp_path / "m.gguf", gguf_type)
    tmap = conv.name_map(info.config)
    written = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(out.path)).tensors}
    two_d = {n[: -len(".weight")]: shape for n, (_d, shape) in info.tensors.items()
             if n.endswith(".weight") and len(shape) == 2}
    assert set(types) >= set(two_d)
    for module, shape in two_d.items():
        expected = "gguf " + written[conv.gguf_name(tmap, module + ".weight")]
        assert types[module] == expected, module
        assert plan[module] == expected
    if gguf_type == "Q4_K_M":  # use_more_bits: the last of 2 layers gets Q6_K on attn_v / ffn_down
        assert types["model.layers.0.self_attn.v_proj"] == "gguf Q4_K"
        assert types["model.layers.1.self_attn.v_proj"] == "gguf Q6_K"


def test_plan_types_unsupported_architecture_is_empty():
    info = SimpleNamespace(config={"architectures": ["BloomForCausalLM"]}, tensors={"h.0.w.weight": ("BF16", [8, 8])})
    assert method.METHOD.layers.exact_types(info, method.Options()) == {}
    # precision falls back to the per-role default
    assert method.precision("decoder", method.Options(), "h.0.w", [8, 256]) == "gguf Q4_K (Q4_K_M mix)"


def make_job(model_dir: Path, out: Path, options, model=None, calib=None) -> QuantizeJob:
    import torch

    from quantkit.eval.windows import TokenWindows
    from quantkit.io.checkpoint import check_model_dir

    out.mkdir(parents=True, exist_ok=True)
    calib = torch.empty((0, 32), dtype=torch.long) if calib is None else calib
    windows = TokenWindows(calib=calib, eval=calib[:0], source="unit", sha256="")
    return QuantizeJob(info=check_model_dir(model_dir), options=options, windows=windows, ignore=[], out_dir=out,
                       workdir=out.parent, handle=ModelHandle(model=model))


def test_quantize_writes_gguf_modelfile_and_report(micro, tmp_path):
    job = make_job(micro, tmp_path / "out", method.Options(gguf_type="Q4_K_M", imatrix="none"))
    result = method.quantize(job)
    path = result.artifact
    assert path.name == "micro-Q4_K_M.gguf" and path.is_file()
    report = result.details["gguf"]
    assert report["tensor_types"] == {"F32": 5, "Q4_K": 13, "Q6_K": 3} and report["imatrix"] == "none"
    modelfile = (job.out_dir / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./micro-Q4_K_M.gguf") and 'PARAMETER stop "</s>"' in modelfile
    json.dumps(result.details)  # serialisable for quantkit.json


def test_quantize_auto_imatrix_from_windows(micro, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro, dtype=torch.float32)
    job = make_job(micro, tmp_path / "out", method.Options(gguf_type="Q2_K"), model, torch.randint(0, 500, (2, 32)))
    report = method.quantize(job).details["gguf"]
    assert report["imatrix"].startswith("computed") and report["imatrix_tensors"] == 14
    assert (tmp_path / "imatrix.gguf").is_file()


@pytest.mark.parametrize("template,name", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", "chatml"),
    ("<|start_header_id|>{{ role }}<|end_header_id|>{{ content }}<|eot_id|>", "llama3"),
    ("{{ bos_token }}[INST] {{ message['content'] }} [/INST]", "mistral"),
])
def test_modelfile_templates(template, name):
    from quantkit.gguf.modelfile import render

    text = render("m.gguf", template)
    assert f"chat format: {name}" in text and "TEMPLATE" in text and "PARAMETER stop" in text


def test_modelfile_unknown_template_omitted():
    from quantkit.gguf.modelfile import render

    text = render("m.gguf", "{{ something_custom }}")
    assert "TEMPLATE omitted" in text and "\nTEMPLATE" not in text
