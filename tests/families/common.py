"""What every family's tiny-model tests share (one module per family in tests/families/, each with a
`build(out)` that saves its checkpoint and its tests): building a random checkpoint from transformers' own
config class, running a method through the CLI, and the proofs each artifact owes its consumer.

- compressed-tensors and nf4: transformers reloads it strictly (no missing, unexpected or mismatched key);
- GGUF: quantkit's file equals llama.cpp's own convert_hf_to_gguf.py (every metadata key, every tensor),
  and quantkit's quantized file equals llama-quantize run on the converter's output, tensor for tensor;
  llama-perplexity loads it (skipped with the reason without scripts/build_llamacpp.sh's build);
- MLX: mlx-lm loads it and its logits follow quantkit's reading (float32 on both sides, same weights).

Tiny shapes: hidden 256 (rows stay multiples of 256, so the k-quants apply), 4 heads of 64 (GQA 2), a real
byte-level BPE tokenizer trained on the bundled text (quantkit.toy), random weights stored in bf16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from tests.gguf.families import randomize, write_bpe_tokenizer
from tests.methods.conftest import assert_nothing_written, report

COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5)
CALIB = ["--num-samples", "16", "--seq-len", "64", "--eval-windows", "2"]
# the compressed-tensors methods and nf4 with their tiny-model flags
COMPRESSED = {"fp8": [], "gptq": [], "awq": [], "autoround": ["--iters", "2"], "smoothquant": [], "nvfp4": [],
              "mxfp4": [], "nf4": []}
# fp8 in the fast suite for every family; gptq, whose calibration is the same sequential pipeline for every
# Llama-style decoder, fast only where a family's layers calibrate differently (hybrid families: their modules)
FAST = ("fp8",)
# random weights: the gate is loosened; every proof below holds whatever the gate says
LOOSE_GATE = ["--max-kld", "10", "--max-ppl-increase", "100", "--min-top1", "0"]

__all__ = ["COMMON", "CALIB", "LOOSE_GATE", "assert_nothing_written", "report"]


def build(out: Path, config_class: str, model_class: str, seed: int = 0, write_tokenizer=write_bpe_tokenizer,
          norm_center: float | None = None, **config) -> Path:
    """A random `model_class` checkpoint of `config_class(**COMMON, **config)` in bf16, with the toy BPE tokenizer
    or the family's own kind (`write_tokenizer(out) -> (vocab size, special ids)`, e.g.
    tests.gguf.families.write_spm_json_tokenizer: Gemma's SentencePiece vocabulary); `norm_center`: the norms'
    random weights centred there (1.0 for a norm that scales by w, not 1 + w)."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = write_tokenizer(out)
    settings = {**COMMON, "vocab_size": vocab, **ids, **config}
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**settings))
    randomize(model, seed)
    if norm_center is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(norm_center - p.mean())
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def quantize(cli, model: Path, out: Path, method: str, *args: str, gate: bool = True):
    """`quantkit quantize MODEL --method METHOD ARGS` on the tiny calibration set (the loose gate, or none)."""
    return cli("quantize", model, "--method", method, *args, *CALIB, *(LOOSE_GATE if gate else ["--no-gate"]),
               "-o", out)


def assert_passed(result, out: Path) -> dict:
    """Exit 0 with an artifact whose gate passed; the target's report entry."""
    assert result.exit_code == 0, result.output
    entry = report(out)["targets"][0]
    assert entry["gate"]["passed"] or not entry["gate"].get("enforced", True)
    return entry


def assert_refused(result, out: Path, *words: str) -> None:
    """Exit 2 before any work, naming `words`, nothing written."""
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output, result.output
    assert "loading" not in result.output and "measuring" not in result.output
    assert_nothing_written(out)


def assert_strict_reload(out: Path) -> None:
    """transformers reloads the artifact with no missing, unexpected or mismatched key."""
    from transformers import AutoModelForCausalLM

    _model, info = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", output_loading_info=True)
    assert {key: list(value) for key, value in info.items() if value} == {}


def kept_16bit(out: Path) -> list[str]:
    """The ignore list of a compressed-tensors artifact (the layers kept 16-bit)."""
    return json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]


# ---------------------------------------------------------------- GGUF against llama.cpp


def assert_gguf_equals_converter(model: Path, tmp_path: Path, outtype: str = "bf16", pre: str | None = "gpt-2",
                                 converter_args: tuple[str, ...] = ()):
    """quantkit's GGUF at `outtype` equals convert_hf_to_gguf.py's (every metadata key and tensor; `pre`: the
    pre-tokenizer name the converter is told for a tokenizer its hash table lacks, tests/gguf/test_vs_converter.py;
    `converter_args`: more converter options, e.g. --no-mtp). Returns (quantkit's file, the converter's file)."""
    from tests.gguf.helpers import convert_to
    from tests.gguf.test_vs_converter import assert_same_file, need_llama_src, reference_gguf

    need_llama_src()
    theirs = reference_gguf(model, tmp_path / f"theirs-{outtype}.gguf", outtype, pre, converter_args)
    ours = tmp_path / f"ours-{outtype}.gguf"
    convert_to(model, ours, outtype.upper())
    assert_same_file(ours, theirs)
    return ours, theirs


def assert_quantized_equals_llama_quantize(model: Path, reference: Path, tmp_path: Path,
                                           types: tuple[str, ...] = ("Q4_K_M", "IQ4_XS")) -> list[Path]:
    """For each type, quantkit's direct conversion holds llama-quantize's tensors (types and bytes) run on the
    converter's `reference` file (bf16: the source values, so both quantize the same numbers)."""
    from tests.gguf.helpers import convert_to, run_quantize
    from tests.gguf.test_families_llamacpp import assert_same_tensors

    written = []
    for gguf_type in types:
        theirs, ours = tmp_path / f"theirs-{gguf_type}.gguf", tmp_path / f"ours-{gguf_type}.gguf"
        run_quantize(reference, theirs, gguf_type)
        convert_to(model, ours, gguf_type)
        assert_same_tensors(theirs, ours, gguf_type)
        written.append(ours)
    return written


def assert_llama_perplexity_runs(path: Path, tmp_path: Path) -> None:
    """llama-perplexity loads the file and scores finite chunks."""
    import re
    import subprocess

    from tests.gguf.helpers import need_llama
    from tests.gguf.test_families_llamacpp import text_file

    run = subprocess.run([str(need_llama("llama-perplexity")), "-m", str(path), "-f",
                          str(text_file(tmp_path / "t.txt")), "-c", "128", "-b", "128", "--chunks", "3", "-t", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    chunks = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", run.stdout + run.stderr)]
    assert len(chunks) >= 2 and all(np.isfinite(v) and v > 1.0 for v in chunks), run.stderr[-2000:]


# ---------------------------------------------------------------- MLX against mlx-lm


def assert_mlx_lm_reads_as_quantkit(out: Path, ids: list[int] | None = None, tolerance: float = 1e-4) -> None:
    """mlx_lm.load builds the quantized modules with exactly quantkit's weights (a stacked expert projection's
    every expert those quantkit reads under the checkpoint's per-expert names), and its logits at float32 follow
    quantkit's reading of the artifact at float32 (tests/methods/test_mlx.py)."""
    import pytest

    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'quantkit[mlx]')")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'quantkit[mlx]')")
    import torch
    from mlx import nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from quantkit.formats.gate import load_artifact
    from quantkit.mlx.checkpoint import MLXWeights, unstacked_names, written_fused
    from tests.methods.test_mlx import float32_mlx_model

    mx.set_default_device(mx.cpu)
    model, _tokenizer = mlx_lm.load(str(out))
    ours = MLXWeights(out)
    modules = [(n, m) for n, m in model.named_modules()
               if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))]
    assert modules
    for name, m in modules:
        theirs = np.array(mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size,
                                        bits=m.bits).astype(mx.float32))
        experts = unstacked_names(ours.config, name + ".weight", theirs.shape[0]) if theirs.ndim == 3 else []
        piece = ours.checkpoint_name(name + ".weight")  # mlx-lm's module path: the stored name
        fused = next((f for f, (pieces, _how) in ours.fused.items() if piece in pieces), None)  # stored fused
        if experts:
            read = np.stack([ours.get(e).float().numpy() for e in experts])
        elif fused is not None:  # quantkit's reading of the fused tensor, cut again as the artifact stores it
            read = written_fused(ours.config, fused, ours.get(fused))[piece].float().numpy()
        else:
            read = ours.get(piece).float().numpy()
        assert np.array_equal(theirs, read), name
    ids = ids or list(range(3, 40))
    theirs = np.array(float32_mlx_model(model)(mx.array(ids)[None]))[0]
    with torch.no_grad():
        read = load_artifact(out).float()(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - read).mean() < tolerance * np.abs(read).mean()


def copy_with_config(source: Path, dest: Path, **changes) -> Path:
    """A copy of a checkpoint with config.json's keys changed (a variant a proof needs)."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


# ---------------------------------------------------------------- the serving engine


def assert_serves_as_read(cli, artifact: Path, tmp_path: Path, engine: str, *args: str) -> dict:
    """`quantkit serve-check` passes: the engine (vllm, llama.cpp, mlx; skipped where scripts/setup_engines.sh
    did not install it) tokenizes as the base does and its log-probs read the artifact as the gate read it.
    Returns the serve-check report."""
    import pytest

    from quantkit.serve import llama_server, mlx_server, vllm_server
    from tests.serve.test_serve_check_slow import serve_check

    finder = {"vllm": vllm_server.find, "llama.cpp": llama_server.find, "mlx": mlx_server.find}[engine]
    if finder() is None:
        pytest.skip(f"{engine} is not installed (scripts/setup_engines.sh)")
    code, data, stderr = serve_check(cli, artifact, tmp_path, *args)
    # the engine's build here has no kernel for the format (or the layer's shape): refused before it starts
    if code == 2 and ("which this CPU lacks" in stderr or "serve it on an NVIDIA GPU" in stderr):
        pytest.skip(stderr.splitlines()[0].removeprefix("error: "))
    assert code == 0, stderr
    assert data["passed"] and data["engine"]["name"] == engine and data["tokenization"]["matches"]
    return data


# ---------------------------------------------------------------- smoothing rows preserve the function


def smoothed_kld(model_dir: Path, rows, low: float = 0.1, high: float = 10.0, seed: int = 0,
                 dtype: str = "float32", linear_experts: bool = False, exact_offsets: bool = True) -> float:
    """KL divergence (nats per token) of the model at `model_dir`, loaded in `dtype` (a run smooths the model in
    the checkpoint's dtype), after every row of `rows` (smoothing Mappings) divides its smooth layer's output
    channels by a random s in [low, high] and multiplies its balance layers' input columns by s, inside
    llm-compressor's norm_calibration_context (which turns offset norms, Gemma's x * (1 + w), into plain ones
    while AWQ and SmoothQuant smooth, and back afterwards), against the model as it was. A row whose smooth
    layer's output reaches any layer outside its balance layers changes the function; a row llm-compressor would
    skip (the balance layers' width is not the smooth layer's) is skipped. `linear_experts`: an MoE model's fused
    experts replaced first by llm-compressor's linear experts (one Linear per expert projection), as AWQ smooths
    them. `exact_offsets`: as quantkit runs llm-compressor, with the patches that keep offset norms exact
    (quantkit.engines.llmcompressor.offset_norm: each row's scales are the ones its smooth layer can hold); without
    them, llm-compressor 0.14.0.1 as it is."""
    from contextlib import nullcontext

    import torch
    from llmcompressor.modeling.offset_norm import norm_calibration_context
    from transformers import AutoModelForCausalLM

    from quantkit.engines.llmcompressor.offset_norm import smoothed_scales
    from quantkit.engines.patches import OFFSET_NORMS, patched

    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(seed))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    if linear_experts:
        from llmcompressor.modeling.moe.linearize import linearize_moe

        from quantkit.arch.moe import linearize

        with torch.no_grad():
            linearize(model, json.loads((Path(model_dir) / "config.json").read_text()))  # those oneshot cannot
            linearize_moe(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad(), patched(*OFFSET_NORMS) if exact_offsets else nullcontext(), norm_calibration_context(model):
        for row in rows:
            for smooth, balance in resolved_row(model, row):
                s = low * (high / low) ** torch.rand(smooth.weight.shape[0], generator=generator)
                scale_row(smooth, balance, smoothed_scales(smooth, s) if exact_offsets else s)
    with torch.no_grad():
        ref, got = (torch.log_softmax(m(ids).logits.float(), -1) for m in (base, model))
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def resolved_row(model, row):
    """[(smooth module, [balance modules])] of one Mapping (llm-compressor's `re:` match): the balance layers under
    the smooth layer's parent module (its decoder layer for a layer's norm, its own expert for an expert's up_proj)."""
    import re

    def found(pattern):
        return [(name, module) for name, module in model.named_modules() if re.match(pattern.removeprefix("re:"), name)]

    pairs = []
    for name, smooth in found(row.smooth):
        parent = name.rsplit(".", 1)[0] + "."
        balance = [m for pattern in row.balance for n, m in found(pattern) if n.startswith(parent)]
        if balance and all(b.weight.shape[1] == smooth.weight.shape[0] for b in balance):
            pairs.append((smooth, balance))
    return pairs


def scale_row(smooth, balance, s) -> None:
    """smooth's output channels / s, the balance layers' input columns * s."""
    shape = (-1,) + (1,) * (smooth.weight.dim() - 1)
    smooth.weight.copy_(smooth.weight / s.view(shape))
    if getattr(smooth, "bias", None) is not None:
        smooth.bias.copy_(smooth.bias / s)
    for layer in balance:
        layer.weight.copy_(layer.weight * s)



# ---------------------------------------------------------------- each proof as one test body


def method_params(compressed: dict, fast: tuple[str, ...]) -> list:
    """The compressed-tensors and nf4 methods of a family module as pytest parameters: `fast` in the fast
    suite, the others slow."""
    import pytest

    return [pytest.param(m, marks=() if m in fast else pytest.mark.slow) for m in compressed]


def assert_reloads_strictly(cli, model: Path, tmp_path: Path, method: str, *args: str) -> Path:
    """`method` exits 0 with an artifact transformers reloads strictly; the artifact."""
    out = tmp_path / "out"
    assert_passed(quantize(cli, model, out, method, *args), out)
    assert_strict_reload(out)
    return out


def assert_gguf_is_llama_cpp_s(model: Path, tmp_path: Path, pre: str | None = "gpt-2",
                               converter_args: tuple[str, ...] = ()) -> None:
    """bf16 equal to the converter's (`converter_args`: more converter options), Q4_K_M and IQ4_XS equal to
    llama-quantize's, each loaded by llama-perplexity."""
    _ours, theirs = assert_gguf_equals_converter(model, tmp_path, "bf16", pre, converter_args)
    for path in assert_quantized_equals_llama_quantize(model, theirs, tmp_path):
        assert_llama_perplexity_runs(path, tmp_path)


def assert_mlx_lm_reads_it(cli, model: Path, tmp_path: Path) -> None:
    """mlx at 4 bits exits 0 and mlx-lm's logits follow quantkit's reading."""
    out = tmp_path / "out"
    assert_passed(quantize(cli, model, out, "mlx", "--bits", "4", gate=False), out)
    assert_mlx_lm_reads_as_quantkit(out)


def assert_vllm_serves_it(cli, model: Path, tmp_path: Path, method: str) -> None:
    """`method`'s artifact passes `quantkit serve-check` in vLLM."""
    out = tmp_path / "out"
    assert_passed(quantize(cli, model, out, method), out)
    assert_serves_as_read(cli, out, tmp_path, "vllm")


# ---------------------------------------------------------------- mixture-of-experts families

MOE = dict(num_hidden_layers=2)
# the methods whose experts transformers' fused-expert reload takes (fp8, symmetric packed int, bitsandbytes)
TRANSFORMERS_RELOADS_EXPERTS = ("fp8", "gptq", "autoround", "nf4")  # with the families' own expert counts: 4 experts, 2 per token


def assert_moe_artifact(cli, model: Path, tmp_path: Path, method: str, *args: str,
                        transformers_reloads: bool = True) -> dict:
    """An MoE family through a compressed-tensors method or nf4: exit 0, the artifact reloads strictly (in
    transformers; experts transformers' fused reload cannot take, AWQ's asymmetric int4, SmoothQuant's int8,
    NVFP4/MXFP4, and every expert of a family whose per-expert tensors transformers does not load at all
    (`transformers_reloads` False: Granite 4 MoE), in quantkit's reading, which refuses any missing or unexpected
    tensor), every router is kept 16-bit (in the ignore list, no scale stored for it), every expert's stored scale
    is finite and non-zero (AutoRound's signed scales may be negative), and a calibrated method reports the tokens
    routed to each expert (top-k per calibration token). Returns the report entry."""
    from quantkit.eval import experts
    from quantkit.formats.gate import artifact_reading

    out = tmp_path / "out"
    entry = assert_passed(quantize(cli, model, out, method, *args), out)
    if method in TRANSFORMERS_RELOADS_EXPERTS and (transformers_reloads or method == "nf4"):
        assert_strict_reload(out)
    else:
        assert experts.reads(out)
        artifact_reading(out).open()
    stored = stored_tensors(out)
    routers = [name.removesuffix(".weight") for name in stored_tensors(model) if is_router(name)]
    assert routers, "the tiny model has no router"
    assert not any(name.startswith(tuple(f"{r}.weight_" for r in routers)) for name in stored)
    if method != "nf4":
        from quantkit.arch.roles import matches

        assert all(matches(r, kept_16bit(out)) for r in routers), kept_16bit(out)
    scales = [name for name in stored if re_expert_scale(name)]
    assert scales or method == "nf4"
    for name in scales:
        values = stored[name].float()
        assert bool((values.isfinite() & (values != 0)).all()), name
    if method in ("gptq", "awq", "autoround", "smoothquant"):
        assert_routing_reported(out, entry)
    return entry


def with_fused_experts(source: Path, dest: Path) -> Path:
    """A copy of a per-expert Qwen-MoE checkpoint with its routed experts stored fused across experts, as
    Qwen3.5-MoE's releases store them: `<block>.experts.gate_up_proj` [experts, 2 x intermediate, hidden] (gate
    rows, then up rows) and `<block>.experts.down_proj` [experts, hidden, intermediate]."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    (shard,) = dest.glob("*.safetensors")
    tensors = load_file(shard)
    expert = re.compile(r"^(?P<block>.*\.experts)\.(?P<e>\d+)\.(?P<p>gate_proj|up_proj|down_proj)\.weight$")
    blocks: dict[str, dict[str, dict[int, object]]] = {}
    for name in [n for n in tensors if expert.match(n)]:
        m = expert.match(name)
        blocks.setdefault(m["block"], {}).setdefault(m["p"], {})[int(m["e"])] = tensors.pop(name)
    for block, parts in blocks.items():
        count = range(len(parts["gate_proj"]))
        tensors[f"{block}.gate_up_proj"] = torch.stack([torch.cat([parts["gate_proj"][e], parts["up_proj"][e]])
                                                        for e in count])
        tensors[f"{block}.down_proj"] = torch.stack([parts["down_proj"][e] for e in count])
    save_file(tensors, shard, metadata={"format": "pt"})
    return dest


def stored_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint's safetensors files, by name."""
    from safetensors.torch import load_file

    return {name: tensor for f in sorted(path.glob("*.safetensors")) for name, tensor in load_file(f).items()}


def is_router(name: str) -> bool:
    from quantkit.arch.roles import classify

    return classify(name) == "router"


def re_expert_scale(name: str) -> bool:
    import re

    return re.search(r"\.experts\.\d+\.[a-z0-9_]+\.weight_scale$", name) is not None


def assert_routing_reported(out: Path, entry: dict) -> None:
    """Tokens routed to each expert by each router: top-k of every calibration token, the starved ones listed."""
    from transformers import AutoConfig

    from quantkit.arch.moe import starved_experts

    details = entry["details"]
    top_k = AutoConfig.from_pretrained(out).num_experts_per_tok
    counts = details["expert_routed_tokens"]
    assert counts and all(sum(row) == details["calibration_tokens"] * top_k for row in counts.values()), counts
    assert details["experts_under_min_tokens"] == starved_experts(counts)
