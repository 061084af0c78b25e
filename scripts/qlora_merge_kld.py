"""How far a merged QLoRA checkpoint is from the QLoRA model that was trained, for both merge bases.

Builds a toy model (quantkit.toy), quantizes it to NF4 with double quant (transformers +
bitsandbytes), trains a LoRA adapter over the 4-bit model (QLoRA), then merges the adapter with
quantkit into (a) the dequantized 4-bit weights and (b) the 16-bit original. Each merged model,
and the original base without the adapter, is scored against the trained QLoRA model (4-bit base
+ unmerged adapter) on the same held-out windows: mean KL divergence, top-1 agreement and
perplexity. Every forward runs in float32, so the numbers measure the weights alone.

    python scripts/qlora_merge_kld.py --preset tiny --steps 60 --json qlora_kld.json

Prints one table; CPU only, a few minutes for the tiny preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path


def nf4_checkpoint(base: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, quantization_config=config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(base / name, out / name)
    return out


def load_qlora(nf4: Path, adapter: Path | None = None):
    """The 4-bit model (with the adapter, unmerged), computing in float32."""
    import bitsandbytes as bnb
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(nf4, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.compute_dtype = torch.float32
    return PeftModel.from_pretrained(model, adapter) if adapter else model


def train_adapter(nf4: Path, out: Path, stream, spec, steps: int, rank: int) -> list[float]:
    from peft import LoraConfig, get_peft_model

    from quantkit.toy import train

    model = get_peft_model(load_qlora(nf4), LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    losses = train(model, stream, dataclasses.replace(spec, train_steps=steps, lr=2e-3), seed=1)
    model.save_pretrained(out)
    return losses


def merged(nf4: Path, adapter: Path, out: Path, mode: str, original: Path) -> Path:
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.lora import merge, plan_merge

    plan = plan_merge(check_model_dir(nf4), str(nf4), [str(adapter)], merge_base=mode,
                      original_base=str(original) if mode == "original" else None)
    merge(plan, out, out.with_name(out.name + "-work"))
    return out


def load_16bit(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logprobs(model, windows):
    import torch

    with torch.no_grad():
        return torch.cat([torch.log_softmax(model(input_ids=w[None]).logits[0, :-1].float(), -1) for w in windows])


def compare(reference, candidate, targets) -> dict[str, float]:
    """Mean KL(reference ‖ candidate) per position, top-1 agreement, perplexity of the candidate."""
    import torch

    kld = (reference.exp() * (reference - candidate)).sum(-1)
    return {
        "kld_mean": float(kld.mean()),
        "kld_p99": float(torch.quantile(kld, 0.99)),
        "top1": float((reference.argmax(-1) == candidate.argmax(-1)).float().mean()),
        "ppl": float(torch.exp(-candidate.gather(-1, targets[:, None]).mean())),
    }


def main() -> None:
    import torch

    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.toy import PRESETS, bundled_texts, make_toy_model, token_stream

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=60, help="QLoRA training steps")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of the preset's seq_len")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the models here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="qlora-kld-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = PRESETS[args.preset]
    base = make_toy_model(work / "base", args.preset)
    nf4 = nf4_checkpoint(base, work / "nf4")
    stream = token_stream(load_tokenizer(check_model_dir(base)), bundled_texts())
    held_out, train_part = stream[: len(stream) // 5], stream[len(stream) // 5:]
    losses = train_adapter(nf4, work / "adapter", train_part, spec, args.steps, args.rank)

    step = max(1, (len(held_out) - spec.seq_len) // args.windows)
    windows = [held_out[i * step: i * step + spec.seq_len] for i in range(args.windows)]
    targets = torch.cat([w[1:] for w in windows])
    reference = logprobs(load_qlora(nf4, work / "adapter").eval(), windows)
    rows = {
        "merged into dequantized NF4": load_16bit(merged(nf4, work / "adapter", work / "dequantized", "dequantized", base)),
        "merged into 16-bit original": load_16bit(merged(nf4, work / "adapter", work / "original", "original", base)),
        "16-bit original, no adapter": load_16bit(base),
    }
    results = {"preset": args.preset, "steps": args.steps, "rank": args.rank, "windows": args.windows,
               "seq_len": spec.seq_len, "train_loss": [losses[0], losses[-1]],
               "reference_ppl": float(torch.exp(-reference.gather(-1, targets[:, None]).mean())), "rows": {}}
    print(f"vs the trained QLoRA model (NF4 base + adapter), {args.windows} x {spec.seq_len} tokens, "
          f"{args.preset} preset, {args.steps} steps r={args.rank}; reference ppl {results['reference_ppl']:.4f}")
    print(f"{'model':<30} {'KLD mean':>10} {'KLD p99':>10} {'top-1':>7} {'ppl':>9}")
    for name, model in rows.items():
        row = compare(reference, logprobs(model, windows), targets)
        results["rows"][name] = row
        print(f"{name:<30} {row['kld_mean']:>10.3g} {row['kld_p99']:>10.3g} {row['top1']:>7.4f} {row['ppl']:>9.4f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
