"""Plain-torch twin of the grouped FP8-weight GEMM of the attention output (``attn.wo_a``).

Spec §2.4 item 1 and §3 step 7: the reference dequantizes ``wo_a`` to bf16 once (e4m3 value ×
its block scale, rounded to bf16) and computes ``u_g = o_g @ wo_a[g]^T`` in bf16 with fp32
accumulation, no activation quantization.  This twin is exactly that math (what the model ran
on a loader-dequantized ``wo_a``); the Triton kernel (``dsv4.ops.triton_grouped``) dequantizes
the same bf16 values in registers.
"""

from __future__ import annotations

import torch

from dsv4.formats import dequant_fp8_block

__all__ = ["grouped_dequant_linear", "check_grouped_args"]

_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def check_grouped_args(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                       groups: int) -> tuple[int, int, int, int]:
    """Validate the arguments of :func:`grouped_dequant_linear`; returns (T, G, N, K).

    Raises ValueError naming the argument that does not fit."""
    name = "grouped_dequant_linear"
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [T, G, K]; found shape {tuple(x.shape)}")
    T, G, K = x.shape
    if groups <= 0 or G != groups:
        raise ValueError(f"{name}: x has {G} groups; groups={groups}")
    if w8.dim() != 2 or w8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight must be a 2-D float8_e4m3fn tensor; found {w8.dtype} "
                         f"of shape {tuple(w8.shape)}")
    rows, wk = w8.shape
    if wk != K or rows % groups:
        raise ValueError(f"{name}: weight [{rows}, {wk}] is not [groups·N, K] for x "
                         f"{tuple(x.shape)} and groups={groups}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"{name}: block must be a power of two >= 16; found {block}")
    if K % block:
        raise ValueError(f"{name}: K={K} is not a multiple of block {block}")
    want = (-(-rows // block), K // block)
    if tuple(w_scale.shape) != want:
        raise ValueError(f"{name}: weight scale must be {list(want)} for a [{rows}, {K}] weight "
                         f"with block {block}; found {list(w_scale.shape)}")
    if w_scale.dtype not in (_E8M0, torch.float32):
        raise ValueError(f"{name}: weight scale dtype must be float8_e8m0fnu or float32; found "
                         f"{w_scale.dtype}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: x must be a float tensor; found {x.dtype}")
    if x.device != w8.device or w_scale.device != w8.device:
        raise ValueError(f"{name}: x, weight and scale must share a device; found {x.device}, "
                         f"{w8.device}, {w_scale.device}")
    return T, G, rows // groups, K


def grouped_dequant_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                           groups: int) -> torch.Tensor:
    """Grouped GEMM with an FP8 block-quantized weight: ``out[t, g] = x[t, g] @ W[g]^T``.

    x [T, G, K] (bf16 in the model); w8 [G·N, K] float8_e4m3fn, group g = rows g·N .. (g+1)·N−1;
    w_scale [ceil(G·N/block), K/block] float8_e8m0fnu or float32; ``groups`` = G.
    W = ``dequant_fp8_block(w8, w_scale, block, x.dtype)`` (fp32 product rounded once to
    x.dtype), then one batched GEMM in x.dtype (fp32 accumulation); returns [T, G, N] x.dtype.
    """
    T, G, N, K = check_grouped_args(x, w8, w_scale, block, groups)
    w = dequant_fp8_block(w8, w_scale, block, x.dtype).view(G, N, K)
    return torch.einsum("tgd,grd->tgr", x, w)
