"""Plain-torch twins of the dense hot ops: mHC (hc_pre / hc_post / hc_post_pre / hc_head), the
FP8 block GEMM with fused activation quantization, the fp32 GEMM of the compressors and the MoE
gate (``linear_fp32``), and the routed-expert SwiGLU (spec §2.5, §3.4, §3.9, §3.10).

These are the oracles for the Triton kernels and what runs on CPU. Shapes follow
docs/ARCHITECTURE.md: tokens are flattened, ``x`` of the mHC ops is ``[T, n_hc, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from dsv4.formats import dequant_fp8_block, dequant_mxfp4, fake_quant_fp8
from dsv4.ops import torch_attn

# ---------------------------------------------------------------------------------------- mHC
def _hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``(flatten(x) @ fn^T) * rsqrt(mean(flatten(x)^2) + eps)`` in fp32 (spec §3.4 steps 1-2)."""
    flat = x.reshape(x.shape[0], -1).float()
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    # The reference scales the projected mixes, not the input: keep that order for fp32 parity.
    return F.linear(flat, fn.float()) * rstd


def _check_hc(name: str, x: torch.Tensor, fn: torch.Tensor, rows: int) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [T, n_hc, D]; found shape {tuple(x.shape)}")
    n, d = x.shape[1], x.shape[2]
    if tuple(fn.shape) != (rows, n * d):
        raise ValueError(f"{name}: fn must be [{rows}, {n * d}] for x {tuple(x.shape)}; "
                         f"found {tuple(fn.shape)}")


def sinkhorn(comb: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """Project ``comb [..., n, n]`` (fp32 logits) towards a doubly-stochastic matrix.

    Exactly the reference order: softmax over k plus eps, one column normalization, then
    ``iters - 1`` rounds of (row, column) normalization, each with ``+ eps`` in the divisor.
    """
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def _normed(y: torch.Tensor, norm_weight: torch.Tensor | None, norm_eps: float,
            rms_eps: float | None) -> torch.Tensor:
    """y, or the sublayer input norm of y (``rms_norm(y, norm_weight, rms_eps or norm_eps)``)."""
    if norm_weight is None:
        return y
    return torch_attn.rms_norm(y, norm_weight, norm_eps if rms_eps is None else rms_eps)


def _check_norm_weight(name: str, norm_weight: torch.Tensor | None, d: int) -> None:
    if norm_weight is not None and tuple(norm_weight.shape) != (d,):
        raise ValueError(f"{name}: norm_weight must have shape ({d},); found "
                         f"{tuple(norm_weight.shape)}")


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None,
           rms_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix of one sublayer (spec §3.4).

    x [T, n, D]; fn [(2+n)·n, n·D]; scale [3]; base [(2+n)·n].
    Returns ``y [T, D]`` (x.dtype) = Σ_j pre_j·x_j, ``post [T, n]`` fp32 and ``comb [T, n, n]``
    fp32 (rows j = input stream, columns k = output stream).  With ``norm_weight`` [D] (the
    sublayer's input RMSNorm), y is ``rms_norm(y, norm_weight, rms_eps)`` (``rms_eps`` None:
    norm_eps): the collapse then the norm, as the model ran them before they were fused.
    """
    n = x.shape[1] if x.dim() == 3 else 0
    _check_hc("hc_pre", x, fn, (2 + n) * n)
    _check_norm_weight("hc_pre", norm_weight, x.shape[2])
    mixes = _hc_mixes(x, fn, norm_eps)
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * torch.sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = (mixes[:, 2 * n:] * scale[2] + base[2 * n:]).view(-1, n, n)
    comb = sinkhorn(comb, hc_eps, iters)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return _normed(y, norm_weight, norm_eps, rms_eps), post, comb


def hc_post(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """Expand a sublayer output back to n streams (spec §3.4).

    ``new_k = post_k · out + Σ_j comb[j, k] · x_res_j`` in fp32, cast to ``x_res.dtype``.
    out [T, D]; x_res [T, n, D]; post [T, n]; comb [T, n, n].
    """
    if x_res.dim() != 3 or out.shape != (x_res.shape[0], x_res.shape[2]):
        raise ValueError(f"hc_post: out must be [T, D] and x_res [T, n, D]; found "
                         f"{tuple(out.shape)} and {tuple(x_res.shape)}")
    mixed = torch.matmul(comb.float().transpose(-1, -2), x_res.float())
    y = post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + mixed
    return y.to(x_res.dtype)


def hc_post_pre(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None,
                rms_eps: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_post`` of one sublayer followed by the ``hc_pre`` of the next (spec §3.5).

    out, x_res, post, comb as :func:`hc_post`; fn, scale, base, eps, iters, norm_weight,
    rms_eps as :func:`hc_pre` (the next sublayer's).  Returns
    ``(x_new [T, n, D], y [T, D], post' [T, n], comb' [T, n, n])``.
    Exactly the two ops composed, so the bits equal the unfused chain.
    """
    x_new = hc_post(out, x_res, post, comb)
    y, post_next, comb_next = hc_pre(x_new, fn, scale, base, norm_eps, hc_eps, iters,
                                     norm_weight, rms_eps)
    return x_new, y, post_next, comb_next


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float, norm_weight: torch.Tensor | None = None,
            rms_eps: float | None = None) -> torch.Tensor:
    """Final collapse of the n streams (spec §3.10): ``Σ_j pre_j x_j`` with no Sinkhorn/post.

    x [T, n, D]; fn [n, n·D]; scale [1]; base [n]. Returns [T, D] in x.dtype; with
    ``norm_weight`` [D] (the model's final norm), normed as :func:`hc_pre` does.
    """
    n = x.shape[1] if x.dim() == 3 else 0
    _check_hc("hc_head", x, fn, n)
    _check_norm_weight("hc_head", norm_weight, x.shape[2])
    mixes = _hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return _normed(y, norm_weight, norm_eps, rms_eps)


# --------------------------------------------------------------------------- FP8 quantization
def fake_act_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """The reference activation quantizer (ue8m0 scales per ``block``, spec §2.5) followed by
    dequantization, in ``x.dtype``; the quantizer itself lives in ``dsv4.formats``."""
    return fake_quant_fp8(x, block)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 block GEMM with the activation quantization fused (spec §2.5).

    x [..., K]; w8 [N, K] float8_e4m3fn; w_scale [ceil(N/block), ceil(K/block)] (e8m0 or fp32).
    ``y = Σ_kblocks (x8·sx)(W8·sW)^T`` accumulated in fp32, returned in ``out_dtype``.
    """
    if x.shape[-1] != w8.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features, weight expects "
                         f"{w8.shape[1]}")
    # Exact in fp32: q has 3 mantissa bits and s is a power of two.
    xq = fake_act_quant(x.float(), block)
    w = dequant_fp8_block(w8, w_scale, block, torch.float32)
    return F.linear(xq, w).to(out_dtype)


def check_grouped_linear_args(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                              block: int) -> None:
    """Raise a ValueError naming ``fp8_grouped_linear`` unless x is [T, G, K] float, w8 a
    [G·R, K] e4m3 weight and w_scale its [ceil(G·R/block), K/block] block scales."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"fp8_grouped_linear: x must be a float tensor [T, G, K]; found "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    G, K = x.shape[1], x.shape[2]
    if w8.dim() != 2 or w8.dtype != torch.float8_e4m3fn or w8.shape[1] != K or G < 1 \
            or w8.shape[0] % G:
        raise ValueError(f"fp8_grouped_linear: w8 must be float8_e4m3fn [G·R, K] with G = {G}, "
                         f"K = {K}; found {w8.dtype} of shape {tuple(w8.shape)}")
    want = (-(-w8.shape[0] // block), -(-K // block))
    if tuple(w_scale.shape) != want or K % block:
        raise ValueError(f"fp8_grouped_linear: w_scale must be {list(want)} for block {block} "
                         f"(K a multiple of it); found {list(w_scale.shape)}")


def fp8_grouped_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Grouped projection by a block-FP8 weight without activation quantization: x [T, G, K],
    w8 [G·R, K] (group g = rows g·R ..), out [T, G, R] = Σ_k x[t, g, k]·W[g·R + r, k] in fp32,
    ``out_dtype`` (default x.dtype) — ``attn.wo_a`` as the reference runs it (bf16 GEMM of the
    dequantized weight)."""
    check_grouped_linear_args(x, w8, w_scale, block)
    T, G, K = x.shape
    w = dequant_fp8_block(w8, w_scale, block, torch.float32).view(G, -1, K)
    return torch.einsum("tgk,grk->tgr", x.float(), w).to(out_dtype or x.dtype)


# ------------------------------------------------------------------------------ fp32 GEMM
# Below this many rows MKL takes a GEMV-like path whose sums are ordered differently from its
# GEMM: rows are padded up to it on CPU so a token's result does not depend on the batch size.
_CPU_MIN_GEMM_ROWS = 4


def batch_invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for x [..., K]; on CPU, fewer than 4 rows are zero-padded to 4 first
    (no value changes, but MKL keeps one summation order for every batch size, so decode rows
    equal prefill rows bit for bit).  Used by ``linear_fp32`` and ``dsv4.model.layers.Linear``."""
    rows = x.numel() // max(1, x.shape[-1])
    if x.device.type == "cpu" and 0 < rows < _CPU_MIN_GEMM_ROWS:
        flat = x.reshape(rows, x.shape[-1])
        pad = flat.new_zeros(_CPU_MIN_GEMM_ROWS - rows, flat.shape[1])
        y = F.linear(torch.cat((flat, pad)), w)[:rows]
        return y.reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def check_linear_fp32_args(x: torch.Tensor, w: torch.Tensor) -> None:
    """Raise a ValueError naming ``linear_fp32`` unless x is [T, K] float and w [N, K] fp32."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"linear_fp32: x must be a 2-D float tensor [T, K]; found {x.dtype} of "
                         f"shape {tuple(x.shape)}")
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"linear_fp32: w must be a 2-D float32 or bfloat16 tensor [N, K]; "
                         f"found {w.dtype} of shape {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_fp32: x has {x.shape[1]} input features, w [N, K] expects "
                         f"K = {w.shape[1]}")
    if x.device != w.device:
        raise ValueError(f"linear_fp32: x and w must share a device; found {x.device} and "
                         f"{w.device}")


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 GEMM ``x.float() @ w.float().T``: x [T, K] any float dtype, w [N, K] float32 or
    bfloat16 (bf16 checkpoint values held compactly: widened exactly) -> [T, N] fp32.

    The compressors' ``wkv`` / ``wgate`` projections and the MoE gate (the reference computes
    them in fp32).  ``F.linear`` (no TF32 unless the caller enabled it); on CPU, fewer than 4
    rows are zero-padded to 4 first, as ``Linear`` does, which changes no value but keeps MKL on
    one summation order for every batch size.
    """
    check_linear_fp32_args(x, w)
    return batch_invariant_linear(x.float(), w.float())


# ------------------------------------------------------------------------------ routed experts
EXPERT_FORMATS = ("dense", "fp4", "fp8")


@dataclass
class ExpertWeights:
    """Stacked weights of the routed experts, as the grouped expert op sees them.

    ``fmt`` says how ``w1`` / ``w3`` (gate / up, logical [E, I, D]) and ``w2`` (logical [E, D, I])
    are stored:

    * "dense": the tensors themselves, in the compute dtype;
    * "fp4" (MXFP4): int8 [E, N, K/2] (two e2m1 codes per byte, low nibble = even k) with
      ``s1`` / ``s3`` / ``s2`` e8m0 [E, N, K/32];
    * "fp8" (the *-Base checkpoints): e4m3 [E, N, K] with block scales [E, ceil(N/B), ceil(K/B)]
      (e8m0 or fp32), ``block`` = B.

    ``act_block``: when set, the expert inputs (x before w1/w3, the activation before w2) are FP8
    fake-quantized with that block, which is what the reference does for quantized experts under
    official numerics (spec §2.5).

    ``kchunk`` (MXFP4 only; 0: row-major): the codes and scales are stored K-chunk-major with
    chunks of ``kchunk`` codes (:func:`rows_kchunk`: same shapes, another byte order), so the
    expert kernels' weight tile of one K step (= ``kchunk``) is one contiguous run of bytes.

    ``fp8_codes`` (MXFP4 on a GPU, optional): the stacks' lossless FP8 re-encoding kept on the
    device (``dsv4.ops.triton_moe_fp8.Fp8Codes``), which the FP8-MMA prefill path then reads
    instead of re-encoding the experts at every call; the twin ignores it.

    ``routed_experts`` (0: ``num_experts``): the model's routed experts across expert-parallel
    ranks, over which a call's (token, pick) pairs spread, so that the kernels' size choices
    estimate the pairs a local expert gets as pairs / routed_experts.
    """

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    act_block: int | None = None
    fmt: str = "dense"
    s1: torch.Tensor | None = None
    s3: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    block: int = 128
    kchunk: int = 0
    fp8_codes: Any = None
    routed_experts: int = 0

    def __post_init__(self) -> None:
        if self.fmt not in EXPERT_FORMATS:
            raise ValueError(f"ExpertWeights: fmt={self.fmt!r} is not supported; allowed: "
                             f"{EXPERT_FORMATS}")
        if self.fmt != "dense" and (self.s1 is None or self.s3 is None or self.s2 is None):
            raise ValueError(f"ExpertWeights: fmt={self.fmt!r} needs the scales s1, s3 and s2")
        if self.kchunk:
            k_min = min(2 * self.w1.shape[-1], 2 * self.w2.shape[-1])
            if self.fmt != "fp4" or self.kchunk % 32 or k_min % self.kchunk:
                raise ValueError(f"ExpertWeights: kchunk={self.kchunk} needs MXFP4 stacks and a "
                                 f"multiple of 32 dividing K; found fmt={self.fmt!r}, "
                                 f"K={k_min}")

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def spread(self) -> int:
        """The experts a call's pairs spread over (``routed_experts``, else the local ones)."""
        return max(self.routed_experts, self.num_experts)

    @property
    def inter_dim(self) -> int:
        return self.w1.shape[1]

    @property
    def dim(self) -> int:
        return self.w2.shape[1]

    def matrix(self, e: int, which: str, dtype: torch.dtype) -> torch.Tensor:
        """The dense [N, K] matrix ``which`` ("w1", "w3", "w2") of expert ``e``.

        Dense stacks are returned as stored; quantized ones are dequantized into ``dtype``
        (exact for MXFP4 in bf16/fp32: an e2m1 value times a power of two).
        """
        w = getattr(self, which)[e]
        if self.fmt == "dense":
            return w
        s = getattr(self, "s" + which[1])[e]
        if self.kchunk:
            w = kchunk_rows(w, self.kchunk // 2)
            s = kchunk_rows(s.view(torch.uint8), self.kchunk // 32).view(s.dtype)
        if self.fmt == "fp4":
            return dequant_mxfp4(w, s, dtype)
        return dequant_fp8_block(w, s, self.block, dtype)


def rows_kchunk(t: torch.Tensor, width: int) -> torch.Tensor:
    """A row-major [.., N, C] byte tensor re-ordered K-chunk-major: the same shape, holding for
    each chunk of ``width`` columns all N rows' slices in turn ([.., C/width, N, width] in
    memory), so a kernel's [rows, width] tile of one K step is one contiguous run of bytes.
    ``width``: the K step in stored columns (MXFP4 codes: BK/2 bytes, scales: BK/32)."""
    *lead, n, c = t.shape
    return (t.reshape(*lead, n, c // width, width).transpose(-3, -2).contiguous()
            .reshape(*lead, n, c))


def kchunk_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of :func:`rows_kchunk`: the row-major [.., N, C] tensor."""
    *lead, n, c = t.shape
    return (t.reshape(*lead, c // width, n, width).transpose(-3, -2).contiguous()
            .reshape(*lead, n, c))


def kchunk_experts(ex: ExpertWeights, kchunk: int) -> ExpertWeights:
    """Row-major MXFP4 stacks ``ex`` re-stored K-chunk-major with chunks of ``kchunk`` codes
    (copies; :attr:`ExpertWeights.kchunk`)."""
    if ex.kchunk:
        raise ValueError(f"kchunk_experts: the stacks are K-chunk-major already "
                         f"(kchunk={ex.kchunk})")
    codes = {n: rows_kchunk(getattr(ex, n).view(torch.uint8), kchunk // 2)
             .view(getattr(ex, n).dtype) for n in ("w1", "w3", "w2")}
    scales = {n: rows_kchunk(getattr(ex, n).view(torch.uint8), kchunk // 32)
              .view(getattr(ex, n).dtype) for n in ("s1", "s3", "s2")}
    return replace(ex, **codes, **scales, kchunk=kchunk)


def expert_k_step(act_block: int | None, dim: int, inter: int) -> int:
    """The K step of the MXFP4 / dense expert kernels: the act block under official numerics,
    else the largest of 128 / 64 dividing both widths, else 32 (which may not divide them: the
    callers check)."""
    if act_block:
        return act_block
    for bk in (128, 64):
        if dim % bk == 0 and inter % bk == 0:
            return bk
    return 32


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """fp32 SwiGLU with the V4 clamp: ``up ∈ [-limit, limit]``, ``gate ≤ limit`` (limit 0: none)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def moe_encode_ahead(experts: ExpertWeights, tokens: int, topk: int,
                     dtype: torch.dtype = torch.bfloat16) -> Any:
    """Start whatever the experts' call of a ``tokens``-token step can prepare from the weights
    alone, before the layer's attention; returns what to hand that call as
    ``ExpertWeights.fp8_codes``.  The twin prepares nothing: None (the Triton op starts the
    FP8 re-encoding of the MXFP4 stacks: ``triton_moe_fp8.encode_ahead``)."""
    return None


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: ExpertWeights, swiglu_limit: float, plan: Any = None) -> torch.Tensor:
    """Weighted sum of the routed experts picked per token (spec §3.9).

    x [T, D]; topk_ids [T, k] int (ids outside 0..E-1 are skipped: expert parallel shards);
    topk_weights [T, k] fp32; ``experts`` dense or quantized stacks (:class:`ExpertWeights`;
    quantized matrices are dequantized into x.dtype per expert). Each pick computes
    ``w2((w · swiglu(w1 x, w3 x)).to(x.dtype))``; the picks are summed in fp32. Returns fp32 [T, D] so the caller adds the shared expert
    before the final cast, as the reference does.  ``plan`` (the Triton kernel's precomputed
    decode plan, ``moe_gate_plan``) changes nothing here.
    """
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: expected x [T, D], topk_ids/topk_weights [T, k]; found "
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    num_e = experts.num_experts
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out
    xin = fake_act_quant(x, experts.act_block) if experts.act_block else x
    # Group the (token, pick) pairs by expert: one GEMM per expert that has tokens.
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    tok = order // topk_ids.shape[1]
    wts = topk_weights.reshape(-1)[order].float()
    valid = (sorted_ids >= 0) & (sorted_ids < num_e)
    counts = torch.bincount(sorted_ids[valid], minlength=num_e).tolist()
    start = int((sorted_ids < 0).sum())
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = tok[start:start + c]
        xe = xin[rows]
        w1, w3 = experts.matrix(e, "w1", x.dtype), experts.matrix(e, "w3", x.dtype)
        a = swiglu(F.linear(xe, w1), F.linear(xe, w3), swiglu_limit)
        a = (a * wts[start:start + c, None]).to(x.dtype)  # routing weight before w2
        if experts.act_block:
            a = fake_act_quant(a, experts.act_block)
        out.index_add_(0, rows, F.linear(a, experts.matrix(e, "w2", x.dtype)).float())
        start += c
    return out
