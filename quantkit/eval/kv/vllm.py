"""vLLM's KV-cache types (``--kv-cache-dtype``), as its kernels store and read keys and values.

Read from the vLLM sources (vllm/config/cache.py CacheDType; vllm/model_executor/layers/quantization/turboquant/
{config,centroids}.py; vllm/v1/attention/ops/triton_turboquant_store.py and the decode kernels'
dequantization; vllm/v1/attention/ops/int4_per_token_head.py):

* fp8 / fp8_e4m3: e4m3(x / s) saturating at ±448, read back as e4m3·s; s = the checkpoint's k_scale / v_scale,
  1.0 without one. fp8_e5m2: the same cast in e5m2 (±57344), no scale. The GPU kernels round to nearest; the CPU
  backend (csrc/cpu/cpu_attn_fp8.hpp float_to_fp8e4m3_scalar / float_to_fp8e5m2_scalar) truncates the mantissa
  toward zero after x·(1/s), subnormals included, and reads e4m3 back as (e4m3·2^-120·s)·2^120 in float32.
* int8_per_token_head / fp8_per_token_head: one float32 scale per (token, KV head) over head_dim, absmax / 127
  (int8, round to nearest) or absmax / 448 (e4m3).
* int4_per_token_head: x rotated by the randomized Hadamard H·diag(d1) (unnormalized Sylvester H; ±1 signs d1 from
  torch's generator seeded 0x9E3779B9) and rounded to the model dtype; per (token, head) asymmetric 4-bit:
  scale = max((max - min) / 15, 1e-6), zero point zp = clamp(round(-min / scale), 0, 15), q = clamp(round(x / scale
  + zp), 0, 15) (rounding half away from zero); the stored scale has its low 4 mantissa bits replaced by zp, and the
  reading clears them: x̂ = (q - zp)·scale'. The query is rotated the same way and the output rotated back, with
  the 1/head_dim of the unnormalized transform: in the model's basis k' = diag(d1)·H·x̂ / head_dim.
* turboquant_k8v4: keys a plain e4m3 cast (no scale), values 4-bit min-max. turboquant_{4bit,k3v4,3bit}_nc: keys
  k = n·u with n = ‖k‖ (stored fp16), y = u·H (orthonormal Sylvester H, no signs), each coordinate bucketized on
  the midpoints of the 2^b Lloyd-Max centroids of N(0, 1/D) (centroids.py solve_lloyd_max), the centroid vector
  renormalised to unit length ("nc"), k̂ = n·(c·Hᵀ). Values: b-bit min-max per (token, head): scale = max((max -
  min) / (2^b - 1), 1e-8), q = clamp(floor((x - min) / scale + 0.5), 0, 2^b - 1), read back as q·fp16(scale) +
  fp16(min). The first and last two layers stay 16-bit (TurboQuantConfig.get_boundary_skip_layers), and a
  request's first prefill chunk attends over its raw keys and values: only later tokens read the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
TURBOQUANT = {  # TQ_PRESETS: key bits (8 = fp8 keys), value bits, norm correction
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")  # per-tensor fp8 (fp8 is e4m3)
TYPES = (*FP8, *PER_TOKEN_HEAD, *TURBOQUANT)
RHT_SEED = 0x9E3779B9


@dataclass(frozen=True)
class Lloyd:
    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]


def fp8_round_trip(x, scale: float = 1.0, e5m2: bool = False):
    """vLLM's scaled fp8 conversion (saturating) and its reading, in x's dtype."""
    import torch

    dtype, limit = (torch.float8_e5m2, E5M2_MAX) if e5m2 else (torch.float8_e4m3fn, E4M3_MAX)
    y = torch.clamp(x.float() / scale, -limit, limit).to(dtype)
    return (y.float() * scale).to(x.dtype)


def fp8_cpu_codes(x, scale: float = 1.0, e5m2: bool = False):
    """The fp8 bytes vLLM's CPU backend stores for x (module docstring): x·(1/s) saturated, the mantissa truncated
    toward zero. Equal to vLLM 0.32's cpu_attn_reshape_and_cache byte for byte (tests/eval/kv/test_vllm_cpu_fp8.py)."""
    import torch

    dtype, limit = (torch.float8_e5m2, E5M2_MAX) if e5m2 else (torch.float8_e4m3fn, E4M3_MAX)
    v = torch.clamp(x.float() * torch.tensor(1.0 / scale, dtype=torch.float32), -limit, limit)
    nearest = v.to(dtype)
    away = nearest.float().abs() > v.abs()  # rounded away from zero: one code back (sign-magnitude codes)
    return torch.where(away, nearest.view(torch.uint8) - 1, nearest.view(torch.uint8))


def fp8_cpu_round_trip(x, scale: float = 1.0, e5m2: bool = False):
    """vLLM's CPU backend's fp8 store (fp8_cpu_codes) and read, in x's dtype: e4m3 as (e4m3·2^-120·s)·2^120 in
    float32 (fp8e4m3_to_float_scalar's order), e5m2 as e5m2·s."""
    import torch

    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    y = fp8_cpu_codes(x, scale, e5m2).view(dtype).float()
    s = torch.tensor(scale, dtype=torch.float32)
    return (y * s if e5m2 else y * 2.0 ** -120 * s * 2.0 ** 120).to(x.dtype)


def per_token_head_round_trip(x, kind: str):
    """int8 / fp8 with one float32 scale per vector (absmax over head_dim)."""
    import torch

    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if kind == "int8":
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        return (torch.clamp(torch.round(xf / scale), -127, 127) * scale).to(x.dtype)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return ((xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def sylvester(d: int):
    """The unnormalized Sylvester Hadamard matrix (float32, entries ±1)."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_signs(d: int):
    """int4_per_token_head.py _get_rht_signs(d, 0): ±1 from torch's CPU generator."""
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def round_half_away(x):
    import torch

    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


def int4_codes(x):
    """_reshape_cache_int4_kernel on rotated vectors x (..., D) float32 -> (q, zp, scale as read back)."""
    import torch

    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    scale = torch.clamp((hi - lo) / 15.0, min=1e-6)
    zp = torch.clamp(round_half_away(-lo / scale), 0, 15)
    q = torch.clamp(round_half_away(x * (1.0 / scale) + zp), 0, 15)
    packed = (scale.view(torch.int32) & -16) | zp.to(torch.int32)
    read = (packed & -16).view(torch.float32)
    return q, zp, read


def int4_round_trip(x):
    """int4_per_token_head: a key or value vector as attention reads it, in the model's basis."""
    d = x.shape[-1]
    h, signs = sylvester(d), rht_signs(d)
    rotated = ((x.float() * signs) @ h.T).to(x.dtype).float()
    q, zp, scale = int4_codes(rotated)
    return (((q - zp) * scale) @ h.T * signs / d).to(x.dtype)


def trapz(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    total = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        total += f(a + i * h)
    return total * h


def lloyd_max(d: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> Lloyd:
    """centroids.py solve_lloyd_max: Lloyd-Max centroids of N(0, 1/d), trapezoid integration on ±3.5σ starts."""
    levels, sigma2 = 2 ** bits, 1.0 / d
    sigma = math.sqrt(sigma2)

    def pdf(x):
        return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))

    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(max_iter):
        edges = [lo * 3] + [(c[i] + c[i + 1]) / 2.0 for i in range(levels - 1)] + [hi * 3]
        new = []
        for i in range(levels):
            num = trapz(lambda x: x * pdf(x), edges[i], edges[i + 1])
            den = trapz(pdf, edges[i], edges[i + 1])
            new.append(num / den if den > 1e-15 else c[i])
        if max(abs(new[i] - c[i]) for i in range(levels)) < tol:
            break
        c = new
    return Lloyd(tuple(c), tuple((c[i] + c[i + 1]) / 2.0 for i in range(levels - 1)))


def tq_key_codes(k, lloyd: Lloyd):
    """The MSE key store: (indices, fp16 norms) of keys k (..., D), on `lloyd`: lloyd_max(D, bits)."""
    import torch

    d = k.shape[-1]
    centroids = torch.tensor(lloyd.centroids, dtype=torch.float32)
    mid = (centroids.sort().values[:-1] + centroids.sort().values[1:]) / 2
    kf = k.float()
    norms = kf.norm(dim=-1, keepdim=True)
    y = (kf / (norms + 1e-8)) @ (sylvester(d) / math.sqrt(d))
    idx = torch.clamp(torch.searchsorted(mid, y.contiguous(), right=True), max=len(lloyd.centroids) - 1)
    return idx, norms.to(torch.float16)


def tq_key_round_trip(k, lloyd: Lloyd, norm_correction: bool):
    """A TurboQuant MSE key as the decode kernel reads it (`lloyd`: lloyd_max(D, bits), solved once per type)."""
    import torch

    d = k.shape[-1]
    idx, norms = tq_key_codes(k, lloyd)
    c = torch.tensor(lloyd.centroids, dtype=torch.float32)[idx]
    if norm_correction:
        c = c / torch.sqrt((c * c).sum(dim=-1, keepdim=True) + 1e-16)
    h = sylvester(d) / math.sqrt(d)
    return (norms.float() * (c @ h.T)).to(k.dtype)


def tq_value_codes(v, bits: int):
    """_store_quantized_value: (codes, fp16 scale, fp16 min) per vector."""
    import torch

    vf = v.float()
    lo, hi = vf.amin(dim=-1, keepdim=True), vf.amax(dim=-1, keepdim=True)
    levels = 2 ** bits - 1
    scale = (hi - lo) / float(levels)
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    q = torch.clamp(torch.floor((vf - lo) / scale + 0.5), 0, levels)
    return q, scale.to(torch.float16), lo.to(torch.float16)


def tq_value_round_trip(v, bits: int):
    q, scale, lo = tq_value_codes(v, bits)
    return (q * scale.float() + lo.float()).to(v.dtype)


CPU_TYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")  # vllm/v1/attention/backends/cpu_attn.py supported_kv_cache_dtypes


def check_cpu(name: str, head_dim: int) -> None:
    """vLLM's CPU attention backend: auto, fp8, fp8_e4m3, fp8_e5m2, head size divisible by 32."""
    from quantkit.errors import UnsupportedError

    if name not in CPU_TYPES:
        raise UnsupportedError(f"vLLM's CPU backend has no {name} KV cache (cpu_attn.py supports auto, "
                               f"{', '.join(CPU_TYPES)}; TurboQuant and the per-token-head types run on GPU "
                               "backends only)", hint="--kv-cache vllm:fp8, or target a GPU with --kv-engine vllm")
    if head_dim % 32:
        raise UnsupportedError(f"vLLM's CPU backend needs a head size divisible by 32 for an fp8 KV cache; this "
                               f"model's is {head_dim}", hint="keep the 16-bit KV cache on vLLM's CPU backend")


def boundary_skip_layers(num_layers: int, n: int = 2) -> tuple[int, ...]:
    """TurboQuantConfig.get_boundary_skip_layers for a dense model: the first and last n layers."""
    if n <= 0 or num_layers <= 0:
        return ()
    n = min(n, num_layers // 2)
    return tuple(sorted(set(range(n)) | set(range(num_layers - n, num_layers))))


def key_bytes(name: str, head_dim: int) -> float:
    """Stored bytes per key vector (one KV head, one token)."""
    if name in TURBOQUANT:
        kb = TURBOQUANT[name][0]
        return head_dim if kb == 8 else math.ceil(head_dim * kb / 8) + 2
    if name == "int4_per_token_head":
        return head_dim / 2 + 4
    if name in PER_TOKEN_HEAD:
        return head_dim + 4
    return head_dim


def value_bytes(name: str, head_dim: int) -> float:
    if name in TURBOQUANT:
        return math.ceil(head_dim * TURBOQUANT[name][1] / 8) + 4
    return key_bytes(name, head_dim)
