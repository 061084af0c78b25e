"""fp8-dynamic without loading the model (quantkit.engines.llmcompressor.model_free) against llm-compressor's
oneshot on the loaded model: the same tensors bit for bit, the same config.json and recipe.yaml, the
same logits after transformers reloads them; and the function choosing the path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantkit.engines.llmcompressor import llmc, model_free
from quantkit.engines.transformers import load_model, load_tokenizer
from quantkit.io.checkpoint import check_model_dir
from quantkit.methods import QuantizeJob, fp8, ignore_patterns


def job_for(model_dir: Path, out: Path, options: fp8.Options | None = None, dtype: str = "auto") -> QuantizeJob:
    info = check_model_dir(model_dir)
    options = options or fp8.Options()
    out.mkdir(parents=True)
    return QuantizeJob(info, options, None, ignore_patterns(info, [], fp8.keeps_lm_head(options)), out,
                       out, dtype)


def oneshot(model_dir: Path, out: Path, options: fp8.Options | None = None, dtype: str = "auto") -> Path:
    """The loaded path, as fp8.quantize runs it when the model is needed."""
    job = job_for(model_dir, out, options, dtype)
    job.handle.model, job.handle.tokenizer = load_model(job.info, dtype), load_tokenizer(job.info)
    llmc.run_oneshot(job, fp8.modifier(job.options, job.ignore), calibrate=False)
    llmc.save_compressed(job)
    return out


def model_free_run(model_dir: Path, out: Path, options: fp8.Options | None = None, dtype: str = "auto") -> Path:
    job = job_for(model_dir, out, options, dtype)
    assert not fp8.needs_model(job.info, job.options)
    assert fp8.quantize(job).details == {"path": "model-free"}
    return out


def tensors(out: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def differing(a: Path, b: Path) -> list[str]:
    """Tensor names whose dtype, shape or bytes differ between two checkpoints (they hold the same names)."""
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    return sorted(name for name in ta if not same_tensor(ta[name], tb[name]))


def config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def micro_pair(micro_model, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8-paths")
    return oneshot(micro_model, root / "oneshot"), model_free_run(micro_model, root / "model-free")


def test_model_free_writes_what_oneshot_writes(micro_pair):
    loaded, free = micro_pair
    assert differing(loaded, free) == []
    quantized = [n for n, t in tensors(free).items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) == 14 and not any("lm_head" in n for n in quantized)  # 7 projections x 2 layers
    assert config(free) == config(loaded)  # quantization_config (groups, ignore, format, status) and the rest
    for name in ("recipe.yaml", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (free / name).read_bytes() == (loaded / name).read_bytes(), name


def test_transformers_reloads_the_model_free_artifact_with_the_same_logits(micro_pair):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(p, device_map="cpu")(ids).logits for p in micro_pair]
    assert torch.equal(logits[0], logits[1])


def test_slabs_and_shards_change_no_byte(micro_model, micro_pair, tmp_path):
    """Rows quantized a few at a time and the output cut into many files give the same tensors."""
    from transformers import AutoModelForCausalLM

    job = job_for(micro_model, tmp_path / "small")
    plan = model_free.plan_stream(job.info, torch.bfloat16, fp8.modifier(job.options, job.ignore))
    files = model_free.write_weights(plan, job.out_dir, slab_bytes=4096, shard_bytes=300_000)
    assert len(files) > 3 and (job.out_dir / "model.safetensors.index.json").is_file()
    index = json.loads((job.out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(tensors(micro_pair[1]))
    for item in plan.items:  # a weight and its scale share a file
        assert len({index[s.name] for s in item.outputs}) == 1
    assert sorted(tensors(job.out_dir)) == sorted(tensors(micro_pair[1]))
    assert all(same_tensor(t, tensors(micro_pair[1])[n]) for n, t in tensors(job.out_dir).items())
    model_free.write_config(plan, job.out_dir)
    AutoModelForCausalLM.from_pretrained(job.out_dir)  # loads the sharded checkpoint


def test_a_cast_on_load_is_the_same_cast(micro_model, tmp_path):
    """float16 asked for a bfloat16 checkpoint, and norms stored in float32: cast as from_pretrained casts."""
    from safetensors.torch import load_file, save_file

    mixed = tmp_path / "mixed"
    shutil.copytree(micro_model, mixed)
    state = load_file(mixed / "model.safetensors")
    save_file({k: v.float() if "norm" in k else v for k, v in state.items()}, mixed / "model.safetensors",
              metadata={"format": "pt"})
    for dtype in ("float16", "auto"):
        loaded = oneshot(mixed, tmp_path / dtype / "oneshot", dtype=dtype)
        free = model_free_run(mixed, tmp_path / dtype / "model-free", dtype=dtype)
        assert differing(loaded, free) == [] and config(free) == config(loaded)


def test_tied_embeddings_write_one_table(tmp_path):
    from tests.gguf.families import build_family

    model = build_family("llama32", tmp_path / "llama32")  # tie_word_embeddings: lm_head is the embedding
    loaded, free = oneshot(model, tmp_path / "oneshot"), model_free_run(model, tmp_path / "model-free")
    assert differing(loaded, free) == [] and config(free) == config(loaded)
    assert "lm_head.weight" not in tensors(free)
    tied = fp8.Options(quantize_lm_head=True)  # llm-compressor unties a quantized tied head: the loaded path
    assert "tied lm_head" in fp8.path_blocker(check_model_dir(model), tied)


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_vlm_towers_and_names_as_oneshot_writes_them(kind, tmp_path):
    """Checkpoint names differ from module names in a VLM (transformers renames them while loading and
    back when saving); the towers stay 16-bit under the same ignore list."""
    from tests.vlm_models import build_family

    model = build_family(kind, tmp_path / kind)
    loaded, free = oneshot(model, tmp_path / "oneshot"), model_free_run(model, tmp_path / "model-free")
    assert differing(loaded, free) == [] and config(free) == config(loaded)
    info = check_model_dir(model)
    for name, tensor in tensors(free).items():
        if info.towers.role(name):
            assert tensor.dtype == torch.bfloat16, name


def test_offset_norms_keep_their_stored_bits(tmp_path):
    """Gemma's norms compute x * (1 + w): oneshot turns w into 1 + w and back around its run (llm-compressor's
    norm_calibration_context), which llm-compressor 0.14.0.1 rounds in bfloat16; quantkit's patches do it exactly
    (quantkit.engines.llmcompressor.offset_norm), so both paths write the stored bits."""
    from safetensors.torch import load_file

    from tests.gguf.families import build_family

    model = build_family("gemma3", tmp_path / "gemma3")
    loaded, free = oneshot(model, tmp_path / "oneshot"), model_free_run(model, tmp_path / "model-free")
    assert differing(loaded, free) == [] and config(free) == config(loaded)
    source = load_file(model / "model.safetensors")
    norms = [name for name in source if name.endswith("norm.weight")]
    assert norms and all(same_tensor(tensors(loaded)[name], source[name]) for name in norms)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llava_next", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3",
                                  "paligemma", "mllama", "mistral3", "internvl"])
def test_every_vlm_family_as_oneshot_writes_it(kind, tmp_path):
    from tests.vlm_models import build_family

    model = build_family(kind, tmp_path / kind)
    loaded, free = oneshot(model, tmp_path / "oneshot"), model_free_run(model, tmp_path / "model-free")
    assert differing(loaded, free) == [] and config(free) == config(loaded)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama31", "mistral", "qwen25", "qwen3", "phi3", "phi4"])
def test_every_text_family_as_oneshot_writes_it(family, tmp_path):
    from tests.gguf.families import build_family
    from tests.methods.test_families import build_extra

    model = (build_extra if family == "qwen3" else build_family)(family, tmp_path / family)
    loaded, free = oneshot(model, tmp_path / "oneshot"), model_free_run(model, tmp_path / "model-free")
    assert differing(loaded, free) == [] and config(free) == config(loaded)


# ------------------------------------------------------------------ choosing the path


def edited(model_dir: Path, out: Path, **config_changes) -> Path:
    shutil.copytree(model_dir, out)
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, **config_changes}))
    return out


def test_path_blocker_reads_config_and_headers_only(micro_model, tmp_path):
    info = check_model_dir(micro_model)
    assert fp8.path_blocker(info, fp8.Options()) is None
    assert "fp8-static" in fp8.path_blocker(info, fp8.Options(scheme="fp8-static"))
    cases = {"mixture-of-experts": {"num_local_experts": 4}, "custom modeling code": {"auto_map": {"AutoModel": "x.Y"}},
             "multi-token-prediction": {"num_nextn_predict_layers": 1}}
    for words, change in cases.items():
        blocked = check_model_dir(edited(micro_model, tmp_path / words.split()[0], **change))
        assert words in fp8.path_blocker(blocked, fp8.Options()) and fp8.needs_model(blocked, fp8.Options())
    assert fp8.path_blocker(info, fp8.Options(quantize_lm_head=True)) is None  # untied head: quantized model-free


def test_quantize_lm_head_untied_as_oneshot_does(micro_model, tmp_path):
    options = fp8.Options(quantize_lm_head=True)
    loaded = oneshot(micro_model, tmp_path / "oneshot", options)
    free = model_free_run(micro_model, tmp_path / "model-free", options)
    assert differing(loaded, free) == [] and tensors(free)["lm_head.weight"].dtype == torch.float8_e4m3fn


def test_the_plan_refuses_what_would_not_equal_oneshot(micro_model, tmp_path):
    from safetensors.torch import load_file, save_file

    def plan(model_dir):
        info = check_model_dir(model_dir)
        return model_free.plan_stream(info, torch.bfloat16, fp8.modifier(fp8.Options(), ignore_patterns(info, [])))

    extra, missing = (shutil.copytree(micro_model, tmp_path / name) for name in ("extra", "missing"))
    state = load_file(micro_model / "model.safetensors")
    save_file({**state, "mtp.proj.weight": torch.zeros(2, 2)}, extra / "model.safetensors", metadata={"format": "pt"})
    del state["model.norm.weight"]
    save_file(state, missing / "model.safetensors", metadata={"format": "pt"})
    assert "the model does not have: ['mtp.proj.weight']" in plan(extra)
    assert "missing from the checkpoint: ['model.norm.weight']" in plan(missing)
    assert isinstance(plan(micro_model), model_free.StreamPlan)


def test_a_fused_checkpoint_is_not_a_renaming(tmp_path):
    """Mixtral's per-expert tensors are fused by transformers while loading (config_blocker already
    sends MoE models to oneshot; the meta-model check finds it too)."""
    from tests.gguf.families import build_family

    info = check_model_dir(build_family("mixtral", tmp_path / "mixtral"))
    model = model_free.meta_model(info, torch.bfloat16)
    assert "transformers converts" in model_free.module_names(model, list(info.tensors))


def test_a_plan_refusal_falls_back_to_oneshot_with_the_reason(micro_model, tmp_path):
    """A checkpoint the cheap check lets through but the meta-model plan refuses: fp8.quantize loads
    the model and runs oneshot, and says why in the report's details."""
    from safetensors.torch import load_file, save_file

    extra = shutil.copytree(micro_model, tmp_path / "extra")
    state = load_file(micro_model / "model.safetensors")
    save_file({**state, "mtp.proj.weight": torch.zeros(2, 2)}, extra / "model.safetensors", metadata={"format": "pt"})
    job = job_for(extra, tmp_path / "out")
    result = fp8.quantize(job)
    assert result.details["path"].startswith("oneshot: checkpoint tensors the model does not have")
    assert job.model is not None  # the pipeline frees it
    assert "mtp.proj.weight" not in tensors(job.out_dir)  # transformers drops it on load, as before


def test_a_quantize_run_takes_the_model_free_path(cli, micro_model, tmp_path):
    out = tmp_path / "fp8"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--num-samples", "4", "--seq-len", "64",
                 "--eval-windows", "2", "--min-top1", "0")
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert entry["details"]["path"] == "model-free" and entry["gate"]["passed"]
    assert {"model.safetensors", "config.json", "recipe.yaml", "tokenizer.json", "generation_config.json",
            "chat_template.jinja"} <= set(entry["files"])
    static = tmp_path / "static"
    result = cli("quantize", micro_model, "--method", "fp8", "--scheme", "fp8-static", "-o", static, "--num-samples",
                 "16", "--seq-len", "64", "--eval-windows", "2", "--min-top1", "0")
    assert result.exit_code == 0, result.output
    details = json.loads((static / "quantkit.json").read_text())["targets"][0]["details"]
    assert details["path"] == "oneshot: fp8-static calibrates activation scales on the loaded model"


def test_an_interrupted_write_resumes_after_its_last_finished_shard(micro_model, tmp_path, monkeypatch):
    """--resume's unit on the model-free path: shards recorded with their sha256 are kept, a damaged one and
    the rest are written again, and the files equal an uninterrupted write byte for byte."""
    job = job_for(micro_model, tmp_path / "plain")
    plan = model_free.plan_stream(job.info, torch.bfloat16, fp8.modifier(job.options, job.ignore))
    files = model_free.write_weights(plan, job.out_dir, shard_bytes=300_000)
    out, state = tmp_path / "resumed", tmp_path / "shards.json"
    out.mkdir()
    record, recorded = model_free.record_shard, []

    def record_then_stop(*args):
        record(*args)
        recorded.append(args)
        if len(recorded) == 3:
            raise InterruptedError  # killed after the third shard

    monkeypatch.setattr(model_free, "record_shard", record_then_stop)
    with pytest.raises(InterruptedError):
        model_free.write_weights(plan, out, shard_bytes=300_000, state=state)
    monkeypatch.setattr(model_free, "record_shard", record)
    with open(out / files[2], "r+b") as fh:  # the third shard's last bytes lost
        fh.truncate(fh.seek(0, 2) - 1)
    written, said = [], []
    writer = model_free.write_shard
    monkeypatch.setattr(model_free, "write_shard", lambda w, *a: (written.append(w.path.name), writer(w, *a)))
    assert model_free.write_weights(plan, out, shard_bytes=300_000, state=state, progress=said.append) == files
    assert said == [f"model-free: resuming after 2 of {len(files)} shards (verified by sha256)"]
    assert written == files[2:]
    assert all((out / f).read_bytes() == (job.out_dir / f).read_bytes() for f in files)
    assert json.loads(state.read_text())["shards"] == [model_free.file_sha256(out / f) for f in files]
