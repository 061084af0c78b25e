"""KV-cache types of the serving engines, simulated as each engine stores keys and values.

One module per engine holds the pure round-trip functions (``llamacpp``, ``mlx``, ``vllm``); this one names the
types (``KvType``: the engine's own spelling, what it does to a query / key / value vector, the bytes it stores,
the layers it leaves 16-bit, the serve flags), parses ``--kv-cache`` and lists what each engine offers.
``quantkit.eval.kv.attention`` applies a type inside the transformers model's attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from quantkit.errors import UnsupportedError
from quantkit.eval.kv import llamacpp, mlx, vllm

ENGINES = ("vllm", "llama.cpp", "mlx")
ENGINE_ALIASES = {"vllm": "vllm", "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "gguf": "llama.cpp",
                  "mlx": "mlx", "mlx-lm": "mlx"}


@dataclass(frozen=True)
class Shape:
    """What a KV type needs of the model: head_dim, KV heads and layers, and which layers slide."""

    head_dim: int
    kv_heads: int
    layers: int
    sliding: tuple[int, ...] = ()
    hybrid: bool = False


@dataclass(frozen=True)
class KvType:
    engine: str
    name: str  # as quantkit's --kv-cache spells it (engine:type)
    flag: tuple[str, ...]  # the engine's own serve flags
    key: Callable
    value: Callable
    query: Callable | None = None
    key_bytes: float = 0.0  # per KV head and token, stored
    value_bytes: float = 0.0
    skip: tuple[int, ...] = ()  # layers left 16-bit
    raw_prefill: bool = False  # the first prefill chunk attends over raw keys and values
    notes: tuple[str, ...] = field(default=())

    def bytes_per_token(self, shape: Shape) -> float:
        """KV bytes one token takes over every layer (16-bit for the skipped ones)."""
        quantized = shape.layers - len(self.skip)
        full = 2 * shape.head_dim * 2 * len(self.skip)
        return shape.kv_heads * (quantized * (self.key_bytes + self.value_bytes) + full)


def bf16_bytes_per_token(shape: Shape) -> float:
    return shape.kv_heads * shape.layers * 2 * shape.head_dim * 2


def numpy_fn(fn: Callable) -> Callable:
    """A numpy round trip (llama.cpp's kernels) as a torch one, in the input's dtype."""

    def run(x):
        import torch

        out = fn(x.detach().float().cpu().numpy())
        return torch.from_numpy(out).to(device=x.device, dtype=x.dtype)

    return run


def llamacpp_type(k_type: str, v_type: str, shape: Shape, rotation: bool = True) -> KvType:
    for t in (k_type, v_type):
        llamacpp.check_type(t)
        llamacpp.check_head_dim(t, shape.head_dim)
    k_rot = llamacpp.k_rotation_size(shape.head_dim) if rotation and llamacpp.quantized(k_type) else 0
    v_rot = llamacpp.v_rotation_size(shape.head_dim) if rotation and llamacpp.quantized(v_type) else 0
    per = shape.head_dim / llamacpp.BLOCK
    name = f"llama.cpp:{k_type}" if k_type == v_type else f"llama.cpp:{k_type}/{v_type}"
    return KvType("llama.cpp", name + ("" if rotation else ":norot"),
                  ("-ctk", k_type, "-ctv", v_type, "-fa", "on"),
                  key=numpy_fn(partial(llamacpp.stored, name=k_type, rotation=k_rot)),
                  value=numpy_fn(partial(llamacpp.stored, name=v_type, rotation=v_rot)),
                  query=numpy_fn(partial(llamacpp.query, k_type=k_type, rotation=k_rot)),
                  key_bytes=per * llamacpp.BLOCK_BYTES[k_type], value_bytes=per * llamacpp.BLOCK_BYTES[v_type],
                  notes=() if rotation else ("LLAMA_ATTN_ROT_DISABLE=1",))


def mlx_type(bits: int, group_size: int, shape: Shape) -> KvType:
    mlx.check(bits, group_size, shape.head_dim)
    fn = partial(mlx.round_trip, bits=bits, group_size=group_size)
    per = shape.head_dim * mlx.bytes_per_value(bits, group_size)
    suffix = "" if group_size == mlx.DEFAULT_GROUP else f"g{group_size}"
    flag = ("--kv-bits", str(bits)) + (() if group_size == mlx.DEFAULT_GROUP else ("--kv-group-size", str(group_size)))
    return KvType("mlx", f"mlx:{bits}{suffix}", flag, key=fn, value=fn, key_bytes=per, value_bytes=per,
                  skip=shape.sliding, notes=("sliding-window layers are not quantized by mlx-lm",) if shape.sliding
                  else ())


def vllm_type(name: str, shape: Shape, k_scale: float = 1.0, v_scale: float = 1.0, cpu: bool = False) -> KvType:
    if name not in vllm.TYPES:
        raise UnsupportedError(f"vLLM KV-cache type {name!r} is not one of: {', '.join(vllm.TYPES)}",
                               hint="e.g. --kv-cache vllm:fp8")
    if cpu:
        vllm.check_cpu(name, shape.head_dim)
    d = shape.head_dim
    flag = ("--kv-cache-dtype", name)
    kb, vb = vllm.key_bytes(name, d), vllm.value_bytes(name, d)
    if name in vllm.FP8:
        e5m2, round_trip = name == "fp8_e5m2", vllm.fp8_cpu_round_trip if cpu else vllm.fp8_round_trip
        return KvType("vllm", f"vllm:{name}", flag, key=partial(round_trip, scale=k_scale, e5m2=e5m2),
                      value=partial(round_trip, scale=v_scale, e5m2=e5m2), key_bytes=kb, value_bytes=vb,
                      notes=("vLLM's CPU backend: mantissa truncated toward zero",) if cpu else ())
    if name == "int4_per_token_head":
        check_power_of_two(name, d)
        return KvType("vllm", f"vllm:{name}", flag, key=vllm.int4_round_trip, value=vllm.int4_round_trip,
                      key_bytes=kb, value_bytes=vb)
    if name in vllm.PER_TOKEN_HEAD:
        fn = partial(vllm.per_token_head_round_trip, kind=name.split("_")[0])
        return KvType("vllm", f"vllm:{name}", flag, key=fn, value=fn, key_bytes=kb, value_bytes=vb)
    if shape.hybrid:
        raise UnsupportedError(f"vLLM refuses {name} on a hybrid attention model (TurboQuant needs identifiable "
                               "full-attention layers and skips none of them)", hint="choose fp8 for this model")
    check_power_of_two(name, d)
    k_bits, v_bits, nc = vllm.TURBOQUANT[name]
    key = partial(vllm.fp8_round_trip, scale=1.0) if k_bits == 8 else partial(
        vllm.tq_key_round_trip, lloyd=vllm.lloyd_max(d, k_bits), norm_correction=nc)
    return KvType("vllm", f"vllm:{name}", flag, key=key, value=partial(vllm.tq_value_round_trip, bits=v_bits),
                  key_bytes=kb, value_bytes=vb, skip=vllm.boundary_skip_layers(shape.layers), raw_prefill=True)


def check_power_of_two(name: str, head_dim: int) -> None:
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise UnsupportedError(f"vLLM's {name} rotates by a Sylvester Hadamard of the head dimension, which must be "
                               f"a power of two >= 16; this model's is {head_dim}", hint="choose vllm:fp8")


# --kv-cache fp8 on quantize: the compressed-tensors methods' calibrated FP8 KV cache (scales in the artifact)
CALIBRATED_FP8 = "fp8"


def offered(engine: str, shape: Shape) -> list[str]:
    """Every type an engine offers, as --kv-cache spells it (16-bit excluded); vLLM's for vllm-cpu too."""
    by_engine = {"llama.cpp": llamacpp_offered, "mlx": mlx_offered, "vllm": vllm_offered}
    return by_engine.get(engine, vllm_offered)()


def llamacpp_offered() -> list[str]:
    quant = [t for t in llamacpp.TYPES if t != "f16"]
    return [f"llama.cpp:{t}" for t in quant] + [f"llama.cpp:q8_0/{t}" for t in quant if t != "q8_0"]


def mlx_offered() -> list[str]:
    return [f"mlx:{b}" for b in mlx.BITS]


def vllm_offered() -> list[str]:
    return [f"vllm:{t}" for t in vllm.TYPES if t != "fp8_e4m3"]


def valid_names() -> str:
    return ("vllm:" + "|".join(vllm.TYPES) + "; llama.cpp:K[/V] with K, V in " + "|".join(llamacpp.TYPES)
            + "; mlx:BITS[gGROUP] with BITS in " + "|".join(map(str, mlx.BITS)) + "; auto; all")


def engine_of(spec: str) -> tuple[str, str]:
    """(engine, rest) of one --kv-cache item; a bare type name belongs to the only engine that has it."""
    if ":" in spec:
        engine, rest = spec.split(":", 1)
        if engine.lower() not in ENGINE_ALIASES:
            raise UnsupportedError(f"--kv-cache {spec}: unknown engine {engine!r}; valid: {valid_names()}",
                                   hint="e.g. --kv-cache vllm:fp8,llama.cpp:q8_0,mlx:4")
        return ENGINE_ALIASES[engine.lower()], rest
    if spec in vllm.TYPES:
        return "vllm", spec
    if spec.split("/")[0] in llamacpp.TYPES:
        return "llama.cpp", spec
    raise UnsupportedError(f"--kv-cache {spec}: unknown KV-cache type; valid: {valid_names()}",
                           hint="e.g. --kv-cache vllm:fp8,llama.cpp:q8_0,mlx:4")


def parse_one(spec: str, shape: Shape, flash_attention: bool = True, cpu: bool = False) -> KvType:
    """One --kv-cache item as a KvType for this model; UnsupportedError (exit 2) naming the engine's rule.
    `cpu`: vLLM's CPU backend is the target."""
    engine, rest = engine_of(spec.strip())
    if engine == "vllm":
        return vllm_type(rest, shape, cpu=cpu)
    if engine == "llama.cpp":
        rotation = not rest.endswith(":norot")
        rest = rest.removesuffix(":norot")
        k_type, _, v_type = rest.partition("/")
        v_type = v_type or k_type
        if llamacpp.quantized(v_type) and not flash_attention:
            raise UnsupportedError(f"llama.cpp: a quantized V cache ({v_type}) needs flash attention (-fa on)",
                                   hint="serve with -fa on, or -ctv f16")
        return llamacpp_type(k_type, v_type, shape, rotation)
    bits, _, group = rest.partition("g")
    if not bits.isdigit() or (group and not group.isdigit()):
        raise UnsupportedError(f"--kv-cache {spec}: mlx types are mlx:BITS or mlx:BITSgGROUP; valid: {valid_names()}",
                               hint="e.g. --kv-cache mlx:4")
    return mlx_type(int(bits), int(group) if group else mlx.DEFAULT_GROUP, shape)


SEARCHES = ("auto", "all")  # auto: the smallest passing type, measured smallest first; all: every type measured


def stops_at_first_pass(specs: str) -> bool:
    """--kv-cache auto: the types are measured from the smallest up until one passes (the types of its size are
    measured too); the larger ones are not measured."""
    return specs.strip() == "auto"


def parse(specs: str, shape: Shape, engine: str | None = None, flash_attention: bool = True,
          cpu: bool = False) -> list[KvType]:
    """--kv-cache TYPE[,TYPE...], or auto / all (every type of `engine` this model's shape and the device take)."""
    items = [s.strip() for s in specs.split(",") if s.strip()]
    if len(items) == 1 and items[0] in SEARCHES:
        if engine is None:
            raise UnsupportedError(f"--kv-cache {items[0]} needs a target engine",
                                   hint="pass --kv-engine vllm|llama.cpp|mlx")
        items = offered(engine, shape)
        kinds = []
        for item in items:
            try:
                kinds.append(parse_one(item, shape, flash_attention, cpu))
            except UnsupportedError:
                continue  # a type this model's shape cannot take is not offered
        return kinds
    if searched := [i for i in items if i in SEARCHES]:
        raise UnsupportedError(f"--kv-cache {searched[0]} stands alone", hint=f"--kv-cache {searched[0]}, or a list "
                               "of types")
    return [parse_one(item, shape, flash_attention, cpu) for item in items]


def shape_of(config) -> Shape:
    """The KV shape of a transformers config or a config.json dict (its text model's)."""
    if isinstance(config, dict):
        text = config.get("text_config") or config
        get = text.get
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        get = lambda key, default=None: getattr(text, key, default)  # noqa: E731
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // heads
    kv_heads = get("num_key_value_heads") or heads
    types = tuple(get("layer_types") or ())
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    hybrid = any(t not in ("full_attention", "sliding_attention", "attention") for t in types)
    return Shape(head_dim, kv_heads, get("num_hidden_layers"), sliding, hybrid)


TARGETS = ("vllm", "vllm-cpu", "llama.cpp", "mlx")


def target(flag: str | None, engines: tuple[str, ...]) -> tuple[str, bool]:
    """(engine, vLLM's CPU backend) of --kv-engine, by default the first engine that serves the artifact."""
    name = flag or engines[0]
    if name not in TARGETS:
        raise UnsupportedError(f"--kv-engine {name}: choose one of {', '.join(TARGETS)}", hint="e.g. --kv-engine vllm")
    engine = "vllm" if name == "vllm-cpu" else name
    if engine not in engines:
        raise UnsupportedError(f"--kv-engine {name}: this artifact is served by {', '.join(engines)}",
                               hint=f"--kv-engine {engines[0]}")
    return engine, name == "vllm-cpu"


def for_artifact(specs: str, shape: Shape, engines: tuple[str, ...], engine_flag: str | None = None) -> list[KvType]:
    """--kv-cache for an artifact the `engines` serve: every type checked before work (exit 2)."""
    engine, cpu = target(engine_flag, engines)
    kinds = parse(specs, shape, engine, cpu=cpu)
    for kind in kinds:
        if kind.engine not in engines:
            raise UnsupportedError(f"--kv-cache {kind.name}: a {kind.engine} KV cache, but this artifact is served "
                                   f"by {', '.join(engines)}", hint=f"choose a {engines[0]} type, or --kv-cache auto")
    if not kinds:
        raise UnsupportedError(f"--kv-cache {specs}: {engine} offers no KV-cache type this model's head dimension "
                               f"({shape.head_dim}) takes", hint="drop --kv-cache")
    return kinds
