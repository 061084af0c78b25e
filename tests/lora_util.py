"""Tiny bases and peft adapters with non-zero weights for the LoRA merge tests, and the
merge arithmetic written out independently of peft (what a merged weight must equal)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_base(out: Path, tokenizer_from: Path, layers: int = 2, tied: bool = False, seed: int = 0) -> Path:
    """A random bf16 Llama (hidden 64, GQA) with the micro model's tokenizer; shapes fit NF4."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def make_nf4_base(base: Path, out: Path) -> Path:
    """The base quantized to NF4 with double quant by transformers + bitsandbytes (a QLoRA base)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, quantization_config=config)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    return out


def make_adapter(base: Path, out: Path, seed: int = 0, added_tokens: list[str] | None = None,
                 **lora_kwargs) -> Path:
    """A peft LoRA adapter trained on nothing but with random non-zero B (and perturbed DoRA
    magnitudes and modules_to_save copies), so merging changes the model measurably. With
    added_tokens: the tokenizer grows, the base is resized first and the adapter carries its
    embeddings (modules_to_save) and tokenizer, with a chat template of its own."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = None
    if added_tokens:
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.add_tokens(added_tokens)
        tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora_kwargs}
    peft_model = get_peft_model(model, LoraConfig(**config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                torch.nn.init.normal_(param, std=0.05)
            elif "lora_magnitude_vector" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def make_qlora_adapter(nf4_base: Path, out: Path, seed: int = 0) -> Path:
    """A LoRA adapter made over the 4-bit model (peft wraps the bitsandbytes layers), as QLoRA does."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(nf4_base)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
    peft_model.save_pretrained(out)
    return out


def read(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def adapter_tensors(adapter: Path) -> dict:
    """The adapter's tensors keyed by module name + part, without peft's prefix."""
    return {k.removeprefix("base_model.model."): v for k, v in read(adapter / "adapter_model.safetensors").items()}


def lora_modules(tensors: dict) -> list[str]:
    return sorted(k.removesuffix(".lora_A.weight") for k in tensors if k.endswith(".lora_A.weight"))


def scaling(config: dict, weight: float = 1.0) -> float:
    """peft's scaling of one adapter: alpha / r, or alpha / sqrt(r) for rsLoRA; times the weight."""
    r = config["r"]
    return weight * config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)


def merged_weight(base_weight, tensors: dict, module: str, config: dict, weight: float = 1.0):
    """One module's merged weight in float32, written out from the formulas (not peft's code)."""
    import torch

    w = base_weight.float()
    a = tensors[f"{module}.lora_A.weight"].float()
    b = tensors[f"{module}.lora_B.weight"].float()
    v = w + (b @ a) * scaling(config, weight)
    if config.get("use_dora"):
        magnitude = tensors[f"{module}.lora_magnitude_vector"].float()
        return (magnitude / torch.linalg.norm(v, dim=1)).view(-1, 1) * v
    return v
