"""Gated DeltaNet (linear attention) tensors as llama.cpp's converter writes them, and the way back.

llama.cpp conversion/qwen.py: Qwen3NextModel.modify_tensors (A_log -> -exp(A_log), dt_bias -> dt_proj.bias,
conv1d squeezed to [channels, kernel], every RMSNorm but the gated one stored as w + 1) and
_LinearAttentionVReorderBase.modify_tensors, which runs first: where there are fewer key heads than value
heads, the value heads are reordered from grouped by key head ([G0_v0..v{r-1}, G1_v0..]) to tiled
([G0_v0, G1_v0, .., G0_v1, G1_v1, ..]) in every tensor indexed by value head (the V rows of in_proj_qkv and
of conv1d, in_proj_z, in_proj_a/b, A_log, dt_bias, the columns of out_proj). The reorder is a permutation
(exact); -exp is computed with torch in the converter's dtype (numpy's exp differs from torch's in the last
bit). Every function takes float32 numpy values and the checkpoint's hyperparameters.

Qwen3-Next (Qwen3NextModel itself, without the reorder) stores the input projections fused: in_proj_qkvz,
grouped by key head ([q, k, v, z] of each), is regrouped to every head's q, then k, v and z and written as
attn_qkv and attn_gate (`qkvz`, `qkvz_rows`); in_proj_ba is written as it is (ssm_ba).
"""

from __future__ import annotations

import numpy as np


def heads(hp: dict) -> tuple[int, int]:
    """(key heads, value heads per key head); the reorder applies where the latter is above 1."""
    nk, nv = hp.get("linear_num_key_heads", 0), hp.get("linear_num_value_heads", 0)
    return nk, (nv // nk if nk else 0)


def reordered(hp: dict) -> bool:
    nk, per_k = heads(hp)
    return nk > 0 and per_k > 1


def tile_heads(x: np.ndarray, axis: int, nk: int, per_k: int, head_dim: int, inverse: bool = False) -> np.ndarray:
    """_reorder_v_heads along `axis` (grouped -> tiled), or its inverse (tiled -> grouped)."""
    axis = axis % x.ndim
    first, second = (per_k, nk) if inverse else (nk, per_k)
    shape = x.shape
    split = x.reshape(*shape[:axis], first, second, head_dim, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(split, axis, axis + 1)).reshape(shape)


def v_rows(hp: dict, x: np.ndarray, head_dim: int, axis: int = 0, inverse: bool = False) -> np.ndarray:
    if not reordered(hp):
        return x
    nk, per_k = heads(hp)
    return tile_heads(x, axis, nk, per_k, head_dim, inverse)


def qk_channels(hp: dict) -> int:
    return hp["linear_key_head_dim"] * hp["linear_num_key_heads"] * 2


def qkv_rows(hp: dict, x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """in_proj_qkv and conv1d: q and k rows as they are, the v rows reordered."""
    if not reordered(hp):
        return x
    qk = qk_channels(hp)
    return np.concatenate([x[:qk], v_rows(hp, x[qk:], hp["linear_value_head_dim"], 0, inverse)], axis=0)


# ---------------------------------------------------------------- forward (values, hparams, source dtype)


def qkv(x, hp, dtype):
    return qkv_rows(hp, x)


def z(x, hp, dtype):
    return v_rows(hp, x, hp["linear_value_head_dim"])


def per_head(x, hp, dtype):
    """in_proj_a / in_proj_b rows, dt_bias: one per value head."""
    return v_rows(hp, x, 1)


def out_proj(x, hp, dtype):
    return v_rows(hp, x, hp["linear_value_head_dim"], axis=1)


def squeeze(x, hp, dtype):
    """conv1d's [channels, 1, kernel] as [channels, kernel]."""
    return x.reshape(x.shape[0], x.shape[-1])


def conv1d(x, hp, dtype):
    return qkv_rows(hp, squeeze(x, hp, dtype))


def neg_exp(x, hp, dtype):
    """-exp(A_log), with torch in the dtype the converter computes in (float16 for float16 sources, float32
    otherwise)."""
    import torch

    values = torch.from_numpy(np.ascontiguousarray(x))
    if dtype == "F16":
        values = values.to(torch.float16)
    return (-torch.exp(values)).to(torch.float32).numpy()


def a_log(x, hp, dtype):
    """-exp(A_log) after the reorder."""
    return neg_exp(v_rows(hp, x, 1), hp, dtype)


# ---------------------------------------------------------------- Qwen3-Next's fused in_proj_qkvz


def qkvz_sizes(hp: dict) -> tuple[int, int, int, int]:
    """The rows of one key head's group in in_proj_qkvz: its q and k, then the v and z of its value heads."""
    per_k = hp["linear_num_value_heads"] // hp["linear_num_key_heads"]
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    return dk, dk, per_k * dv, per_k * dv


def qkvz(x, hp, dtype):
    """Qwen3NextModel: in_proj_qkvz's rows from grouped by key head ([q, k, v, z] per head) to every head's q,
    then k, v and z (a permutation: exact)."""
    nk, sizes = hp["linear_num_key_heads"], qkvz_sizes(hp)
    groups = x.reshape(nk, sum(sizes), x.shape[-1])
    parts = np.split(groups, np.cumsum(sizes)[:-1], axis=1)
    return np.concatenate([part.reshape(-1, x.shape[-1]) for part in parts])


def qkvz_rows(shape: tuple[int, ...], hp: dict) -> tuple[int, int]:
    """The split's pieces: attn_qkv (q, k and v rows), attn_gate (z rows)."""
    z_rows = hp["linear_num_key_heads"] * qkvz_sizes(hp)[3]
    return shape[0] - z_rows, z_rows


# ---------------------------------------------------------------- inverse (values read from the file, hparams)


def qkv_back(x, hp):
    return qkv_rows(hp, x, inverse=True)


def z_back(x, hp):
    return v_rows(hp, x, hp["linear_value_head_dim"], inverse=True)


def per_head_back(x, hp):
    return v_rows(hp, x, 1, inverse=True)


def out_proj_back(x, hp):
    return v_rows(hp, x, hp["linear_value_head_dim"], axis=1, inverse=True)


def unsqueeze(x, hp):
    return x.reshape(x.shape[0], 1, x.shape[-1])


def conv1d_back(x, hp):
    return unsqueeze(qkv_rows(hp, x, inverse=True), hp)


def log_neg(x, hp):
    return np.log(-x.astype(np.float32))


def a_log_back(x, hp):
    return v_rows(hp, log_neg(x, hp), 1, inverse=True)


def qkvz_back(x, hp):
    """The q, k, v and z rows of every head back into each key head's group."""
    nk, sizes = hp["linear_num_key_heads"], qkvz_sizes(hp)
    parts = np.split(x, np.cumsum([nk * size for size in sizes])[:-1], axis=0)
    return np.concatenate([part.reshape(nk, size, x.shape[-1]) for part, size in zip(parts, sizes)],
                          axis=1).reshape(x.shape)


def conv1d_shape(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return (shape[0], shape[-1])


def conv1d_hf_shape(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return (shape[0], 1, shape[-1])
