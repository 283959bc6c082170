"""Torch twins of the fused norm + RoPE ops of the attention's q and kv paths (spec §3.6 items
1–2, §4.2).

Each twin is, operation for operation, the unfused code the model ran before the fusion, so it
rounds where that code rounds (e.g. the V4 per-head q renorm runs in the query's own dtype, bf16
on the GPU); the Triton kernels of ``dsv4/ops/triton_norm.py`` reproduce those rounding points.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4.formats import fake_quant_fp8
from dsv4.ops import torch_attn

__all__ = ["head_norm_rope", "norm_rope", "check_rope_args"]


def check_rope_args(name: str, x: Tensor, cos: Tensor, sin: Tensor, min_dim: int = 2) -> int:
    """Validate ``x`` [T, ..., d] against cos/sin [T, rd/2]; returns rd (the rotated width)."""
    if x.dim() < min_dim:
        raise ValueError(f"{name}: x must have at least {min_dim} dims [T, ..., d]; found shape "
                         f"{tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"{name}: cos and sin must both be [T, rd/2]; found "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    rd = 2 * cos.shape[-1]
    if x.shape[0] != cos.shape[0] or x.shape[-1] < rd:
        raise ValueError(f"{name}: x of shape {tuple(x.shape)} does not fit cos/sin of shape "
                         f"{tuple(cos.shape)} (need x[0] == T and x[-1] >= {rd})")
    return rd


def head_norm_rope(q: Tensor, cos: Tensor, sin: Tensor, eps: float, renorm: bool,
                   inplace: bool = False) -> Tensor:
    """Per-head unweighted RMS renorm of the query (V4; V4.1 passes ``renorm=False``), then RoPE
    on the last ``2·cos.shape[-1]`` channels of each head.

    q [T, H, d]; cos, sin [T, rd/2] fp32.  The renorm ``q · rsqrt(mean(q²) + eps)`` runs in
    q's dtype, as the reference does (each step rounds to bf16 for a bf16 q); the rotation is
    fp32 math rounded to q.dtype (``torch_attn.apply_rope``).  ``inplace`` writes the result
    into q and returns it; otherwise a new tensor is returned.

    NB torch's CPU bf16 ``rsqrt`` rounds twice (sqrt, then 1/x, each to bf16) on the scalar
    remainder of its vector loop, so on CPU a bf16 row's result can depend on where the row
    sits in the batch; fp32 (the CPU default) and the GPU are not affected.
    """
    check_rope_args("head_norm_rope", q, cos, sin, min_dim=3)
    y = q
    if renorm:
        y = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    y = torch_attn.apply_rope(y, cos, sin)
    if inplace:
        q.copy_(y)
        return q
    return y


def check_norm_rope_args(kv: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor,
                         fp8_block: int) -> int:
    """Validate ``norm_rope``'s arguments; returns the number of unrotated channels."""
    rd = check_rope_args("norm_rope", kv, cos, sin)
    d = kv.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"norm_rope: weight must have shape ({d},); found {tuple(weight.shape)}")
    nope = d - rd
    if fp8_block < 0 or (fp8_block and (nope == 0 or nope % fp8_block)):
        raise ValueError(f"norm_rope: fp8_block={fp8_block} must be 0 or a divisor of the "
                         f"{nope} unrotated channels")
    return nope


def norm_rope(kv: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, eps: float,
              fp8_block: int = 0) -> Tensor:
    """``rms_norm`` (fp32 math, kv.dtype out) then RoPE on the last ``2·cos.shape[-1]`` channels
    (spec §3.6 item 2: the window KV row); with ``fp8_block > 0`` the leading "nope" channels are
    then FP8 fake-quantized per ``fp8_block`` channels (``act_quant`` ue8m0, in place; V4
    official numerics uses 64) while the rotated tail is kept as is.

    kv [T, ..., d]; weight [d] fp32 or None; cos, sin [T, rd/2] fp32.  Returns a new tensor in
    kv.dtype.
    """
    nope = check_norm_rope_args(kv, weight, cos, sin, fp8_block)
    y = torch_attn.apply_rope(torch_attn.rms_norm(kv, weight, eps), cos, sin)
    if fp8_block:
        y = torch.cat((fake_quant_fp8(y[..., :nope], fp8_block), y[..., nope:]), dim=-1)
    return y
