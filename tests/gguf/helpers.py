"""Helpers shared by the GGUF tests: the llama.cpp tools (skipping when absent), conversion,
reading GGUF fields and tensors back, loading a .gguf into its transformers architecture."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

SAMPLE = "Quantization keeps 4.5 bits per weight; llama.cpp's Q4_K_M mixes Q4_K and Q6_K.\n  Hello,   world! 123"
ALL_MIXES = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0",
             "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def load_script(name: str):
    """A module of scripts/ (make_gguf_golden, make_iquant_tables) imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def need_llama(tool: str) -> Path:
    """A llama.cpp tool found the way quantkit finds one (quantkit.eval.llamacpp.find_binary), or skip."""
    from quantkit.eval.llamacpp import find_binary

    path = find_binary(tool)
    if path is None:
        pytest.skip(f"{tool} not built (run scripts/build_llamacpp.sh)")
    return path


def save_f16_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with weights stored in f16 (so an F16 GGUF holds exactly the source values)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = {k: v.half() for k, v in load_file(src / "model.safetensors").items()}
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def convert_to(model: Path, out: Path, gguf_type: str, **kw):
    from quantkit.gguf.convert import convert

    return convert(model, out, gguf_type, **kw)


def fields(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def load_gguf_model(path: Path, model_dir: Path):
    """A float32 model of model_dir's architecture holding the .gguf's dequantized weights (strict load)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.gguf.loader import to_hf_state_dict

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(to_hf_state_dict(path, model.config.to_dict()), strict=True)
    return model


def tensor_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    import gguf

    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes())) for t in gguf.GGUFReader(str(path)).tensors}


def run_quantize(src: Path, dst: Path, gguf_type: str, imatrix: Path | None = None) -> None:
    cmd = [str(need_llama("llama-quantize"))]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    cmd += [str(src), str(dst), gguf_type, "1"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def build_gemma(out: Path, version: int, seed: int = 0) -> Path:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, GemmaConfig, GemmaForCausalLM

    from quantkit.toy import build_tokenizer, bundled_texts

    tokenizer = build_tokenizer(bundled_texts(), 512)
    common = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    if version == 1:
        model = GemmaForCausalLM(GemmaConfig(**common))
    else:
        config = Gemma2Config(**common, query_pre_attn_scalar=64, sliding_window=32,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() == 2:
                p.normal_(0.0, 0.05)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
