"""llama.cpp's quantized KV cache (`-ctk` / `-ctv`), as its CPU backend stores and reads it.

What is simulated, from the llama.cpp that scripts/build_llamacpp.sh builds (llama-cpp-python 0.3.36's copy):

* storage: each key / value vector (per layer, per KV head, after RoPE) is split in blocks of 32 along the head
  dimension and quantized by the block format's reference quantizer (ggml-quants.c ``quantize_row_*_ref``: the
  kernels in quantkit.gguf.quants, bit-exact), then read back dequantized;
* rotation (src/llama-kv-cache.cpp, on unless ``LLAMA_ATTN_ROT_DISABLE=1``): a quantized K cache is stored
  rotated by the orthonormal Sylvester Hadamard of the largest power of two (>= 64) dividing head_dim, applied
  block-wise along head_dim, and the query is rotated the same way; a quantized V cache is stored rotated by blocks
  of 64 and the attention output rotated back. Only when head_dim is a multiple of 64;
* the query: ggml-cpu's flash attention converts each query row to the K type's ``vec_dot_type`` before the dot
  products (q8_0 for q8_0 / q4_0 / q5_0 / iq4_nl keys, q8_1 for q4_1 / q5_1: the same values, d = amax/127 in
  fp16), and to f16 for an f16 K cache.

Because the Hadamard H is orthonormal and symmetric, the rotated attention equals the unrotated one with
k' = H·deq(quant(H·k)), q' = H·deq(q8(H·q)), v' = H·deq(quant(H·v)): each simulation below returns vectors in the
model's own basis, so the model's attention runs unchanged on them.
"""

from __future__ import annotations

import math

import numpy as np

from quantkit.errors import UnsupportedError

BLOCK = 32
TYPES = ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
# bytes per 32 values: ggml's block sizes (fp16 d, fp16 m for the _1 types)
BLOCK_BYTES = {"f16": 64, "q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18, "iq4_nl": 18}
# the query's conversion before the K-side dot product (ggml-cpu type_traits_cpu[type].vec_dot_type)
VEC_DOT = {"f16": "f16", "q8_0": "q8_0", "q5_0": "q8_0", "q4_0": "q8_0", "iq4_nl": "q8_0", "q5_1": "q8_1",
           "q4_1": "q8_1"}


def check_type(name: str) -> None:
    """An unknown cache type: UnsupportedError listing llama.cpp's."""
    if name not in TYPES:
        raise UnsupportedError(f"llama.cpp KV-cache type {name!r} is not one of: {', '.join(TYPES)}",
                               hint="e.g. --kv-cache llama.cpp:q8_0 (or q8_0/q4_0 for K/V)")


def check_head_dim(name: str, head_dim: int) -> None:
    """llama.cpp's block types tile head_dim in blocks of 32."""
    if name != "f16" and head_dim % BLOCK:
        raise UnsupportedError(f"llama.cpp KV-cache type {name} needs a head dimension that is a multiple of "
                               f"{BLOCK}; this model's is {head_dim}", hint="use -ctk/-ctv f16 for this model")


def quantized(name: str) -> bool:
    return name != "f16"


def k_rotation_size(head_dim: int) -> int:
    """llama_kv_cache::build_input_k_rot: the largest power of two >= 64 dividing head_dim (0: no rotation)."""
    if head_dim % 64:
        return 0
    n = 64
    while head_dim % (n * 2) == 0:
        n *= 2
    return n


def v_rotation_size(head_dim: int) -> int:
    """llama_kv_cache::build_input_v_rot: blocks of 64 (0: no rotation)."""
    return 64 if head_dim % 64 == 0 else 0


def hadamard(n: int) -> np.ndarray:
    """ggml_gen_hadamard: the orthonormal Sylvester Walsh-Hadamard matrix (symmetric, H·H = I), float32."""
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.float32(math.sqrt(n))).astype(np.float32)


def rotate(x: np.ndarray, n: int) -> np.ndarray:
    """x (..., head_dim) times the n x n Hadamard, block-wise along the last axis; n = 0: x itself."""
    if not n:
        return x
    shape = x.shape
    return (x.reshape(*shape[:-1], shape[-1] // n, n) @ hadamard(n)).reshape(shape).astype(np.float32)


def round_trip(x: np.ndarray, name: str) -> np.ndarray:
    """x (..., head_dim) float32 stored in a cache of type `name` and read back (float32)."""
    from gguf import GGMLQuantizationType as QT

    from quantkit.gguf import quants

    if name == "f16":
        return x.astype(np.float16).astype(np.float32)
    qtype = QT[name.upper()]
    return quants.dequantize(quants.quantize(x, qtype), qtype).reshape(x.shape).astype(np.float32)


def q8_round_trip(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref / q8_1_ref read back: blocks of 32, d = amax/127 (fp16), q = round(x/d)."""
    return round_trip(x, "q8_0")


def stored(x: np.ndarray, name: str, rotation: int) -> np.ndarray:
    """A key or value vector as the cache holds it, in the model's basis: H·deq(quant(H·x))."""
    return rotate(round_trip(rotate(x, rotation), name), rotation)


def query(q: np.ndarray, k_type: str, rotation: int) -> np.ndarray:
    """The query as flash attention dots it with the K cache, in the model's basis."""
    if VEC_DOT[k_type] == "f16":
        return q.astype(np.float16).astype(np.float32)
    return rotate(q8_round_trip(rotate(q, rotation)), rotation)
