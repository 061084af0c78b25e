"""Small local models built from scratch: the README demo, test fixtures and the reference model.

Nothing here touches the network. A toy model is a Llama-architecture decoder (GQA) with a
byte-level BPE tokenizer trained on quantkit's bundled text, optionally trained for a few
steps on that text so that quantization error shows up in perplexity.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class ToyPreset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    train_steps: int
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 3e-3
    tie_word_embeddings: bool = False


PRESETS = {
    # Shapes are multiples of 256 so every method (GPTQ group 128, GGUF k-quants) applies.
    "micro": ToyPreset(512, 256, 512, 2, 4, 2, train_steps=30, seq_len=64),
    "tiny": ToyPreset(1024, 256, 768, 2, 4, 2, train_steps=120),
    # ~5M parameters. scripts/train_reference_model.py trains it and then injects activation-outlier
    # channels (function-preserving) so that 4-bit rounding costs measurably; see docs/methods.md.
    "reference": ToyPreset(2048, 256, 1024, 4, 4, 2, train_steps=400, seq_len=128, lr=3e-3),
    # The general case: widths that neither group size 128 nor the k-quant block of 256 divide (only
    # ffn_down's input width, the intermediate size, takes k-quants), an odd vocabulary, tied embeddings.
    "odd": ToyPreset(700, 192, 512, 2, 3, 1, train_steps=60, seq_len=64, tie_word_embeddings=True),
    # SmolLM-135M's widths (hidden 576, intermediate 1536, 9 heads of 64, 3 KV heads, tied embeddings)
    # and Qwen2.5-0.5B's (hidden 896, intermediate 4864, 14 heads, 2 KV heads), fewer layers; for benchmarks.
    "smol576": ToyPreset(3001, 576, 1536, 6, 9, 3, train_steps=300, tie_word_embeddings=True),
    "qwen896": ToyPreset(3001, 896, 4864, 4, 14, 2, train_steps=200, tie_word_embeddings=True),
    # Deeper than wide (8 layers of width 256): many layers no probe measures; for the fallback benchmarks.
    "deep256": ToyPreset(2048, 256, 768, 8, 4, 2, train_steps=200),
}


def bundled_texts() -> list[str]:
    """All bundled calibration text as documents (chat turns flattened to plain text)."""
    from quantkit.run.calibration import load_texts

    return load_texts("default", None, chat_template=False)


def build_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE tokenizer and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_model(preset: ToyPreset, tokenizer, seed: int = 0):
    """A randomly initialised LlamaForCausalLM of the preset's shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=preset.tie_word_embeddings,
    )
    return LlamaForCausalLM(config).float()


def token_stream(tokenizer, texts: list[str]):
    """All texts tokenized into one LongTensor, documents separated by EOS."""
    import torch

    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def train(model, stream, preset: ToyPreset, seed: int = 0) -> list[float]:
    """Deterministic next-token training on random windows of the stream; returns the losses."""
    import torch

    if preset.train_steps == 0:
        return []
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=preset.lr, weight_decay=0.01)
    warmup = max(1, preset.train_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, warmup, preset.train_steps))
    model.train()
    losses = []
    for _ in range(preset.train_steps):
        batch = _random_batch(stream, preset, gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _random_batch(stream, preset: ToyPreset, gen):
    import torch

    starts = torch.randint(0, len(stream) - preset.seq_len - 1, (preset.batch_size,), generator=gen)
    return torch.stack([stream[s : s + preset.seq_len] for s in starts.tolist()])


def make_toy_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, steps: int | None = None) -> Path:
    """Build (and briefly train) a toy model and save it as a local HF checkpoint."""
    import torch

    spec = PRESETS[preset]
    if steps is not None:
        spec = ToyPreset(**{**asdict(spec), "train_steps": steps})
    torch.set_num_threads(max(1, torch.get_num_threads()))
    texts = bundled_texts()
    tokenizer = build_tokenizer(texts, spec.vocab_size)
    model = build_model(spec, tokenizer, seed)
    losses = train(model, token_stream(tokenizer, texts), spec, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {"preset": preset, "seed": seed, **asdict(spec), "final_loss": losses[-1] if losses else None}
    (out / "toy_model.json").write_text(json.dumps(summary, indent=2) + "\n")
    return out


def scaled_norm(weight, scale, shifted: bool):
    """A norm weight whose output is `scale` x the old one: w * scale, or for a norm that scales by (1 + w)
    (Gemma's, `shifted`) (1 + w) * scale - 1."""
    return (weight + 1) * scale - 1 if shifted else weight * scale


def shifted_norms(config: dict) -> bool:
    """Whether the architecture's RMSNorms scale by (1 + w) (its family record's norm_shift: Gemma 1-3)."""
    from quantkit.gguf.convert import ARCHITECTURES, hf_architecture

    spec = ARCHITECTURES.get(hf_architecture(config))
    return bool(spec and spec.norm_shift)


def sharpen(src: Path, dst: Path, channels: int = 4, factor: float = 16.0, logit_scale: float = 8.0,
            dtype: str = "float32") -> Path:
    """A copy of a Llama-style checkpoint (Llama, Gemma 3 with its (1 + w) norms) that quantization visibly
    hurts, stored in `dtype`: the final norm's output scaled by `logit_scale` (peaked next-token
    distributions, as trained models of real size have), and `channels` seeded input channels of every
    attention block carrying `factor` x activations against 1/factor weight columns (function preserving,
    as scripts/train_reference_model.py does)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    config = json.loads((src / "config.json").read_text())
    shifted = shifted_norms(config)
    state["model.norm.weight"] = scaled_norm(state["model.norm.weight"], logit_scale, shifted)
    hidden = config["hidden_size"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        picked = torch.randperm(hidden, generator=torch.Generator().manual_seed(layer))[:channels]
        norm = state[prefix + "input_layernorm.weight"]
        norm[picked] = scaled_norm(norm[picked], factor, shifted)
        for proj in ("q_proj", "k_proj", "v_proj"):
            state[f"{prefix}self_attn.{proj}.weight"][:, picked] /= factor
    state = {k: v.to(getattr(torch, dtype)) for k, v in state.items()}
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
    return dst


# Pairs of Linear layers whose product a power of two moves between them without changing the function:
# (scaled up, scaled down): q.k^T is bilinear (RoPE rotates both alike), attention is linear in v, and the MLP
# is linear in up_proj's output.
PROXY_BLIND_PAIRS = (("self_attn.q_proj", "self_attn.k_proj"), ("self_attn.v_proj", "self_attn.o_proj"),
                     ("mlp.up_proj", "mlp.down_proj"))


def blind_the_proxy(src: Path, dst: Path, spread: int = 4, seed: int = 0) -> Path:
    """A copy of a Llama-style checkpoint whose function (and whose quantization by any scale-invariant
    format: fp8 per channel and per token) is unchanged, but whose layers' weighted errors no longer say how
    much their quantization costs: in every layer and PROXY_BLIND_PAIRS pair, the first layer's weight is
    multiplied and the second's divided by a seeded power of two 2^k, |k| <= spread (exact in bfloat16). A layer's weighted error (the MSE at its own output) moves by 4^k while the KL divergence its
    quantization causes does not, as on real models whose error proxy ranks the layers poorly."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    for layer in range(config["num_hidden_layers"]):
        for up, down in PROXY_BLIND_PAIRS:
            factor = 2.0 ** int(torch.randint(-spread, spread + 1, (1,), generator=generator))
            first, second = f"model.layers.{layer}.{up}.weight", f"model.layers.{layer}.{down}.weight"
            dtype = state[first].dtype
            state[first] = (state[first].float() * factor).to(dtype)
            state[second] = (state[second].float() / factor).to(dtype)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


CONTINUATION_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {name}.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def continuation_items(texts: list[str], samples: int, choices: int = 4, seed: int = 0) -> list[dict]:
    """Multiple-choice items from the bundled text: the first words of a sentence, its real ending and
    the endings of other sentences; `label` is the real one's place."""
    import random
    import re

    sentences = [s.split() for text in texts for s in re.split(r"(?<=[.!?])\s+", text)]
    sentences = [s for s in sentences if 12 <= len(s) <= 40]
    rng = random.Random(seed)
    picked = rng.sample(range(len(sentences)), min(samples, len(sentences)))
    items = []
    for index in picked:
        words = sentences[index]
        cut = len(words) // 2
        others = rng.sample([i for i in range(len(sentences)) if i != index], choices - 1)
        endings = [" " + " ".join(s[len(s) // 2:]) for s in [words, *(sentences[i] for i in others)]]
        order = list(range(choices))
        rng.shuffle(order)
        items.append({"context": " ".join(words[:cut]), "choices": [endings[i] for i in order],
                      "label": order.index(0)})
    return items


def make_continuation_task(out_dir: str | Path, samples: int = 200, seed: int = 0,
                           name: str = "quantkit_continuation") -> Path:
    """A local lm-evaluation-harness multiple-choice task (which ending is the sentence's own) built
    from the bundled text: OUT/<name>.jsonl and OUT/<name>.yaml (lm-eval's format); returns the YAML."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = continuation_items(bundled_texts(), samples, seed=seed)
    (out / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (out / f"{name}.yaml").write_text(CONTINUATION_TASK.format(name=name))
    return out / f"{name}.yaml"


def main(argv: list[str] | None = None) -> None:
    """`python -m quantkit.toy OUT [--preset tiny] [--steps N] [--seed S]`: build a local toy model."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m quantkit.toy", description=main.__doc__)
    parser.add_argument("out")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_toy_model(args.out, args.preset, args.seed, args.steps)
    summary = json.loads((out / "toy_model.json").read_text())
    print(f"built {args.preset} toy model at {out} (final training loss {summary['final_loss']})", file=sys.stderr)


if __name__ == "__main__":
    main()
