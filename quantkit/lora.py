"""Merge LoRA adapters into the full-precision base before quantizing (peft)."""

from __future__ import annotations

from pathlib import Path

from quantkit.errors import InputError, require
from quantkit.model import ModelInfo, load_model, load_tokenizer
from quantkit.offline import offline


def check_adapter(path: Path) -> None:
    if not (path / "adapter_config.json").is_file():
        raise InputError(f"{path} is not a LoRA adapter (no adapter_config.json)")
    if not list(path.glob("adapter_model.safetensors")):
        raise InputError(f"{path} has no adapter_model.safetensors", hint="quantkit loads safetensors only")


def is_bnb(info: ModelInfo) -> bool:
    return (info.config.get("quantization_config") or {}).get("quant_method") == "bitsandbytes"


def merge_adapters(info: ModelInfo, adapters: list[str], out_dir: Path, dtype: str = "auto",
                   trust_remote_code: bool = False) -> Path:
    """Load the base in its own 16-bit dtype, merge each adapter in order, save safetensors."""
    require("peft", "lora", "merging LoRA adapters")
    from peft import PeftModel

    model = load_model(info, dtype=dtype, trust_remote_code=trust_remote_code)
    if is_bnb(info):
        # QLoRA base: merge into a dequantized 16-bit copy, never back into 4-bit weights.
        model = model.dequantize()
        model.config.__dict__.pop("quantization_config", None)
    for adapter in adapters:
        check_adapter(Path(adapter))
        with offline():
            model = PeftModel.from_pretrained(model, adapter, local_files_only=True).merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(info, trust_remote_code).save_pretrained(out_dir)
    return out_dir
