"""Triton kernels of the MoE glue (spec §3.9), one launch each, same signatures as the twins in
``dsv4/ops/torch_route.py``:

* ``moe_route``: after the gate GEMM, ``sqrt(softplus)``, the top-k of ``s + bias`` (or the
  ``tid2eid`` row of hash layers), the gather, normalization and ``route_scale`` (replaces 7-8
  torch kernels).  A program holds BLOCK_T token rows of all E scores in registers and takes
  the k maxima one after the other, so the ids come out in descending order like
  ``torch.topk``.  Ties: among exactly equal ``s + bias`` the lowest expert id is taken first
  (torch.topk documents no order for ties; with fp32 scores from a real gate GEMM plus a
  learned bias, exact ties do not arise in practice).
* ``swiglu_act``: the clamped SwiGLU of the shared expert, fp32 math, one rounding to the
  output dtype (replaces 7 kernels: two casts, two clamps, silu, mul, cast).
* ``moe_combine``: routed (fp32) + shared, rounded to the output dtype (replaces 3).

Numerics: softplus is ``x`` above 20, else ``log1p(exp(x))``, and silu ``x / (1 + exp(-x))``,
as torch computes them.  On the GPU ``exp`` / ``log1p`` are libdevice's (the CUDA math library
torch's own kernels call), square root and divisions are IEEE-rounded, products are compiled
without FMA contraction: the results should match torch's CUDA kernels bit for bit (not
measured yet).  The interpreter has no libdevice: there ``log1p`` is computed with Goldberg's
``log(u) · x / (u − 1)`` (a few ulp) — the tests bound the difference to the CPU twins (ids
equal, weights 1e-6 relative).  The sum of the k picked weights is sequential in pick order.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.torch_dense import ExpertWeights
from dsv4.ops.torch_route import check_route_args
from dsv4.ops.triton_dense import (INTERPRET, splitk_counters, splitk_reduce, store_rne,
                                   torch_twin_off_gpu)
from dsv4.ops.triton_linear32 import Linear32Config, linear32_tile
from dsv4.ops.triton_moe import DecodePlan, decode_plan_params, store_prepped
from dsv4.ops.triton_moe_plan import small_plan_rows, small_plan_store

__all__ = ["GATE_MAX_ROWS", "moe_combine", "moe_gate", "moe_gate_plan", "moe_route",
           "swiglu_act"]

_TILE = 2048          # elements per program tile (token rows × padded experts / channels)
_MAX_EXPERTS = 4096   # one program row holds every score of a token: wider gates run the twin
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _exp(x):
    if INTERPRET:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20) in fp32."""
    e = _exp(x)
    if INTERPRET:
        # Goldberg: log1p(e) = log(u) · e / (u − 1) with u = 1 + e (exact where u == 1).
        u = 1.0 + e
        den = tl.where(u == 1.0, 1.0, u - 1.0)
        lp = tl.where(u == 1.0, e, tl.log(u) * tl.div_rn(e, den))
    else:
        lp = libdevice.log1p(e)
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _sum_in_order8(w, BLOCK_T: tl.constexpr):
    """Σ_j w[:, j] of a [BLOCK_T, 8] tile added left to right (the order of a loop over the
    picks) with no cross-thread reduction: its columns as [BLOCK_T] tensors by reshape /
    split (the mHC collapse's trick)."""
    even, odd = tl.split(tl.reshape(w, [BLOCK_T, 4, 2]))
    c04, c26 = tl.split(tl.reshape(even, [BLOCK_T, 2, 2]))
    c15, c37 = tl.split(tl.reshape(odd, [BLOCK_T, 2, 2]))
    c0, c4 = tl.split(c04)
    c2, c6 = tl.split(c26)
    c1, c5 = tl.split(c15)
    c3, c7 = tl.split(c37)
    return ((((((c0 + c1) + c2) + c3) + c4) + c5) + c6) + c7


@triton.jit
def route_rows(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, w_ptr, ids_ptr, row0, T, E,
               stride_l, route_scale, K: tl.constexpr, KP: tl.constexpr, HASH: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, FROM_L2: tl.constexpr):
    """Routing of token rows ``row0 .. row0 + BLOCK_T``: weights [T, K] fp32, ids [T, K] int64.

    FROM_L2: the logits were just written by other programs of this launch (``moe_gate``):
    read them from L2 (``.cg``), never from a possibly stale L1 line.

    The k rounds of a learned routing only pick ids (the lowest id holding the maximum: one
    (value, id) reduction a round); the picks' weights are then one gather of their logits (the
    same function of the same values as the row's scores: the same bits), summed in pick order
    (ids outside 0..E-1, possible only from a hash table, weigh 0).  Against three reductions
    a round (maximum, lowest id, the pick's score) this cut the routing of one token from
    3.7-3.8 to 3.1-3.3 µs, the gate launch from 8.2-8.5 to 7.8 (H100, bench/gate_parts.py,
    docs/PERFORMANCE.md thirty-second session)."""
    rows = row0 + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    r64 = rows.to(tl.int64)
    kcols = tl.arange(0, KP)
    kmask = row_ok[:, None] & (kcols[None, :] < K)
    if HASH:
        tok = tl.load(input_ids_ptr + r64, mask=row_ok, other=0)
        picked_id = tl.load(tid2eid_ptr + tok[:, None] * K + kcols[None, :], mask=kmask,
                            other=0).to(tl.int64)
    else:
        cols = tl.arange(0, BLOCK_E)
        mask = row_ok[:, None] & (cols < E)[None, :]
        if FROM_L2:
            x = tl.load(logits_ptr + r64[:, None] * stride_l + cols[None, :], mask=mask,
                        other=0.0, cache_modifier=".cg")
        else:
            x = tl.load(logits_ptr + r64[:, None] * stride_l + cols[None, :], mask=mask,
                        other=0.0)
        b = tl.load(bias_ptr + cols, mask=cols < E, other=0.0)
        sel = tl.where(mask, tl.sqrt_rn(_softplus(x)) + b[None, :], float("-inf"))
        picked_id = tl.zeros((BLOCK_T, KP), dtype=tl.int64)
        for j in tl.static_range(K):
            # The lowest id among equal maxima, in one (value, id) reduction; min() keeps a NaN
            # row's id in range.
            e = tl.minimum(tl.argmax(sel, axis=1, tie_break_left=True), E - 1)
            sel = tl.where(cols[None, :] == e[:, None], float("-inf"), sel)
            picked_id = tl.where(kcols[None, :] == j, e.to(tl.int64)[:, None], picked_id)
    ok = kmask & (picked_id >= 0) & (picked_id < E)
    ptr = logits_ptr + r64[:, None] * stride_l + picked_id
    if FROM_L2:
        xp = tl.load(ptr, mask=ok, other=0.0, cache_modifier=".cg")
    else:
        xp = tl.load(ptr, mask=ok, other=0.0)
    picked_w = tl.where(ok, tl.sqrt_rn(_softplus(xp)), 0.0)
    if KP == 8:
        total = _sum_in_order8(picked_w, BLOCK_T)
    else:
        # One non-zero term a sum: exact in any order.
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(K):
            total = total + tl.sum(tl.where(kcols[None, :] == j, picked_w, 0.0), axis=1)
    out = tl.div_rn(picked_w, total[:, None]) * route_scale
    tl.store(w_ptr + r64[:, None] * K + kcols[None, :], out, mask=kmask)
    tl.store(ids_ptr + r64[:, None] * K + kcols[None, :], picked_id, mask=kmask)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, w_ptr, ids_ptr,
                  T, E, stride_l, route_scale,
                  K: tl.constexpr, KP: tl.constexpr, HASH: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """Routing of BLOCK_T tokens: weights [T, K] fp32 and ids [T, K] int64."""
    grid_dependency_sync(PDL)
    route_rows(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, w_ptr, ids_ptr,
               tl.program_id(0) * BLOCK_T, T, E, stride_l, route_scale, K, KP, HASH, BLOCK_T,
               BLOCK_E, False)


@triton.jit
def _gate_route_kernel(x_ptr, w_ptr, logits_ptr, ws_ptr, count_ptr, bias_ptr, tid2eid_ptr,
                       input_ids_ptr, wout_ptr, ids_ptr, M, N, K, stride_xm, stride_wn,
                       stride_ws, k_per_split, route_scale,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       SPLITS: tl.constexpr, DOT: tl.constexpr, W_BF16: tl.constexpr,
                       TOP_K: tl.constexpr, KP: tl.constexpr, HASH: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                       pairs_ptr=None, bexp_ptr=None, xs_ptr=None, NB=0, stride_xs=0,
                       PLAN: tl.constexpr = False, PLAN_BM: tl.constexpr = 16,
                       PP: tl.constexpr = 16, NBP: tl.constexpr = 16,
                       PREP_FMT: tl.constexpr = 0, PREP_QUANT: tl.constexpr = False,
                       PREP_BK: tl.constexpr = 128, PDL: tl.constexpr = False):
    """``moe_gate``: the gate GEMM of ``triton_linear32._linear32_kernel`` (same grid, tiles,
    split-K reduction: the same logits), then the routing of every row by the program that
    finishes the last output tile.

    Each tile's finisher stores its logits and counts itself in at the counter after the
    tiles' (``count_ptr + tiles``; acq_rel, gpu scope, like the split-K arrivals); the one that
    arrives last reads all the logits from L2 and runs :func:`route_rows` over the row blocks,
    then resets that counter for the next launch and for graph replays.

    PLAN (``moe_gate_plan``): the experts' decode plan too.  The programs of the first N tile
    store their rows' K range of x GEMM-ready, one row per token (``xs``, as
    ``triton_moe.store_prepped`` prepares it for K steps of PREP_BK), and the routing program
    then makes the plan of the ids it stored (``small_plan_rows`` / ``small_plan_store``:
    ``pairs`` and ``block_expert`` for PLAN_BM-row blocks)."""
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles = tl.num_programs(0)
    acc, rm, rn, m_mask, n_mask = linear32_tile(
        x_ptr, w_ptr, pid, split, M, N, K, stride_xm, stride_wn, k_per_split, BM, BN, BK,
        DOT, False, W_BF16)
    if PLAN:
        if pid % tl.cdiv(N, BN) == 0:
            k0 = split * k_per_split
            r64 = rm.to(tl.int64)
            for k in range(k0, tl.minimum(k0 + k_per_split, K), PREP_BK):
                t = tl.load(x_ptr + r64[:, None] * stride_xm + k
                            + tl.arange(0, PREP_BK)[None, :], mask=m_mask[:, None], other=0.0)
                store_prepped(xs_ptr + r64[:, None] * stride_xs + k, t, m_mask, PREP_FMT,
                              PREP_QUANT, PREP_BK)
    mask = m_mask[:, None] & n_mask[None, :]
    out = logits_ptr + rm[:, None] * N + rn[None, :]
    if SPLITS > 1:
        part = ws_ptr + rm[:, None] * N + rn[None, :]
        last, total = splitk_reduce(acc, part, mask, split, stride_ws, count_ptr + pid, SPLITS)
        if last:
            tl.store(out, total, mask=mask)
            _route_after_tiles(count_ptr + tiles, tiles, logits_ptr, bias_ptr, tid2eid_ptr,
                               input_ids_ptr, wout_ptr, ids_ptr, M, N, route_scale, TOP_K, KP,
                               HASH, BLOCK_T, BLOCK_E, ROW_BLOCKS, pairs_ptr, bexp_ptr, NB,
                               PLAN, PLAN_BM, PP, NBP)
    else:
        tl.store(out, acc, mask=mask)
        _route_after_tiles(count_ptr + tiles, tiles, logits_ptr, bias_ptr, tid2eid_ptr,
                           input_ids_ptr, wout_ptr, ids_ptr, M, N, route_scale, TOP_K, KP, HASH,
                           BLOCK_T, BLOCK_E, ROW_BLOCKS, pairs_ptr, bexp_ptr, NB, PLAN, PLAN_BM,
                           PP, NBP)


@triton.jit
def _route_after_tiles(count, tiles, logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, wout_ptr,
                       ids_ptr, T, E, route_scale, TOP_K: tl.constexpr, KP: tl.constexpr,
                       HASH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       ROW_BLOCKS: tl.constexpr, pairs_ptr, bexp_ptr, NB, PLAN: tl.constexpr,
                       PLAN_BM: tl.constexpr, PP: tl.constexpr, NBP: tl.constexpr):
    # Every thread's logits stores are issued before one thread publishes the arrival.
    tl.debug_barrier()
    arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    if arrived == tiles - 1:
        tl.debug_barrier()
        for rb in tl.static_range(ROW_BLOCKS):
            route_rows(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, wout_ptr, ids_ptr,
                       rb * BLOCK_T, T, E, E, route_scale, TOP_K, KP, HASH, BLOCK_T, BLOCK_E,
                       True)
        if PLAN:
            # The ids this program just stored, read back after a block-wide barrier.
            tl.debug_barrier()
            rp, key, valid, dest, first, nblk, first_blk = small_plan_rows(
                ids_ptr, T * TOP_K, E, PLAN_BM, PP)
            small_plan_store(pairs_ptr, bexp_ptr, T * TOP_K, E, NB, rp, key, valid, dest,
                             first, nblk, first_blk, PLAN_BM, NBP, 256)
        tl.store(count, 0)


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, y_ptr, n_rows, n_cols, stride_g, stride_u, limit,
                   LIMIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   PDL: tl.constexpr = False):
    """y = silu(min(g, limit)) · clamp(u, ±limit) over a [BLOCK_R, BLOCK_C] tile (fp32 math)."""
    grid_dependency_sync(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g = tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    act = tl.div_rn(g, 1.0 + _exp(-g))
    store_rne(y_ptr + rows[:, None] * n_cols + cols[None, :], act * u, mask)


@triton.jit
def _combine_kernel(routed_ptr, shared_ptr, y_ptr, n, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """y = routed + shared (fp32 sum, one rounding to y's dtype), flat contiguous tensors."""
    grid_dependency_sync(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = tl.load(routed_ptr + offs, mask=mask, other=0.0)
    s = tl.load(shared_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    store_rne(y_ptr + offs, r + s, mask)


def _twin(name: str, *args: Any) -> Any:
    return getattr(importlib.import_module("dsv4.ops.torch_route"), name)(*args)


@torch_twin_off_gpu("dsv4.ops.torch_route")
def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              input_ids: torch.Tensor | None, top_k: int, route_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of the gate logits [T, E] fp32, one kernel: (weights [T, k] fp32, ids [T, k]
    int64); see ``torch_route.moe_route``."""
    check_route_args(logits, bias, tid2eid, input_ids, top_k)
    T, E = logits.shape
    if E > _MAX_EXPERTS:
        return _twin("moe_route", logits, bias, tid2eid, input_ids, top_k, route_scale)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_e = triton.next_power_of_2(E)
    block_t = max(1, min(_TILE // block_e, triton.next_power_of_2(T)))
    is_hash = tid2eid is not None
    dummy = logits
    _route_kernel[(triton.cdiv(T, block_t),)](
        logits, dummy if is_hash else bias.float().contiguous(),
        tid2eid.contiguous() if is_hash else dummy,
        input_ids.contiguous() if is_hash else dummy, weights, ids,
        T, E, logits.stride(0), float(route_scale),
        K=int(top_k), KP=triton.next_power_of_2(top_k), HASH=is_hash,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4, enable_fp_fusion=False, **pdl_args(logits))
    return weights, ids


@torch_twin_off_gpu("dsv4.ops.torch_route")
def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float,
               out_dtype: torch.dtype) -> torch.Tensor:
    """Clamped SwiGLU, fp32 math, ``out_dtype`` out, one kernel; gate, up [..., I]."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_act: gate and up must have one shape; found "
                         f"{tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype not in _FLOAT_DTYPES or up.dtype not in _FLOAT_DTYPES \
            or out_dtype not in _FLOAT_DTYPES or gate.dim() == 0:
        return _twin("swiglu_act", gate, up, limit, out_dtype)
    n_cols = gate.shape[-1]
    g2 = gate.reshape(-1, n_cols)
    u2 = up.reshape(-1, n_cols)
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    u2 = u2 if u2.stride(-1) == 1 else u2.contiguous()
    y = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    n_rows = g2.shape[0]
    if y.numel() == 0:
        return y
    block_c = min(1024, triton.next_power_of_2(n_cols))
    block_r = max(1, min(_TILE // block_c, triton.next_power_of_2(n_rows)))
    _swiglu_kernel[(triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))](
        g2, u2, y, n_rows, n_cols, g2.stride(0), u2.stride(0), float(limit),
        LIMIT=limit > 0, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
        enable_fp_fusion=False, **pdl_args(g2))
    return y


@torch_twin_off_gpu("dsv4.ops.torch_route")
def moe_combine(routed: torch.Tensor, shared: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``routed`` (fp32) + ``shared``, rounded to ``out_dtype``, one kernel."""
    if routed.shape != shared.shape or routed.dtype != torch.float32:
        raise ValueError(f"moe_combine: expected routed fp32 and shared of one shape; found "
                         f"{routed.dtype} {tuple(routed.shape)} and {tuple(shared.shape)}")
    if shared.dtype not in _FLOAT_DTYPES or out_dtype not in _FLOAT_DTYPES:
        return _twin("moe_combine", routed, shared, out_dtype)
    y = torch.empty(routed.shape, dtype=out_dtype, device=routed.device)
    n = y.numel()
    if n:
        block = 1024
        _combine_kernel[(triton.cdiv(n, block),)](routed.contiguous(), shared.contiguous(), y, n,
                                                  BLOCK=block, num_warps=4, **pdl_args(routed))
    return y


# Rows for which moe_gate runs as one launch (decode batches); more rows: the two ops' kernels.
GATE_MAX_ROWS = 16


@torch_twin_off_gpu("dsv4.ops.torch_route")
def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None, top_k: int,
             route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a V4 MoE layer, ``moe_route(linear_fp32(x, weight), ...)``: for up to
    :data:`GATE_MAX_ROWS` rows in one launch (the routing runs in the program that finishes
    the gate GEMM's last tile), else the two ops' kernels.  The logits are
    ``triton_linear32.linear_fp32``'s (same plan and summation order); with the bf16 x and
    weight of the GPU model every product is exact, so contraction cannot change them and the
    result is that of the two kernels bit for bit."""
    return moe_gate_with_config(x, weight, bias, tid2eid, input_ids, top_k, route_scale, None)


@torch_twin_off_gpu("dsv4.ops.torch_route")
def moe_gate_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None, top_k: int,
                  route_scale: float, experts: ExpertWeights
                  ) -> tuple[torch.Tensor, torch.Tensor, DecodePlan | None]:
    """:func:`moe_gate`, and for a decode call (at most ``SMALL_PLAN_MAX_PAIRS`` pairs) the
    experts' plan of its ids (:class:`~dsv4.ops.triton_moe.DecodePlan`, for ``moe_experts`` /
    ``moe_experts_shared`` on ``experts``, x the experts' input) built in the same launch:
    the first N tile's programs prepare x per token, the routing program makes the plan.  The
    same weights and ids as :func:`moe_gate`; the plan None where it does not apply."""
    return _gate(x, weight, bias, tid2eid, input_ids, top_k, route_scale, None, experts)


def moe_gate_with_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None,
                         top_k: int, route_scale: float, cfg: Linear32Config | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_gate` with an explicit GEMM plan (``None``: ``linear_fp32``'s)."""
    weights, ids, _ = _gate(x, weight, bias, tid2eid, input_ids, top_k, route_scale, cfg, None)
    return weights, ids


def _gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None, top_k: int,
          route_scale: float, cfg: Linear32Config | None, plan_for: ExpertWeights | None
          ) -> tuple[torch.Tensor, torch.Tensor, DecodePlan | None]:
    """The gate launch (GEMM + routing, and with ``plan_for`` the experts' decode plan)."""
    from dsv4.ops import torch_dense
    from dsv4.ops import triton_linear32 as l32
    T = x.shape[0] if x.dim() == 2 else 0
    E = weight.shape[0] if weight.dim() == 2 else 0
    block_e = triton.next_power_of_2(max(1, E))
    if (not 1 <= T <= GATE_MAX_ROWS or block_e > _TILE
            or x.dtype not in _FLOAT_DTYPES
            or weight.dtype not in (torch.float32, torch.bfloat16)):
        return (*moe_route(l32.linear_fp32(x, weight), bias, tid2eid, input_ids, top_k,
                           route_scale), None)
    torch_dense.check_linear_fp32_args(x, weight)
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    check_route_args(logits, bias, tid2eid, input_ids, top_k)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    K = x.shape[1]
    w_bf16 = weight.dtype == torch.bfloat16
    if cfg is None:
        cfg = (l32.pick_bf16w_config(T, E, K, x.device) if w_bf16
               else l32.pick_linear32_config(T, E, K, x.device))
    k_per_split, split, tiles = l32.split_k_grid(T, E, K, cfg)
    ws = (torch.empty(split, T, E, dtype=torch.float32, device=x.device) if split > 1
          else logits)
    # Tile arrivals at [0, tiles), the routing's at [tiles].
    counters = splitk_counters(x.device, tiles + 1, "moe_gate")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    is_hash = tid2eid is not None
    block_t = max(1, min(_TILE // block_e, triton.next_power_of_2(T)))
    plan, extra = None, {}
    params = None
    if plan_for is not None and plan_for.num_experts == E:
        params = decode_plan_params(T, int(top_k), K, plan_for)
    if params is not None and k_per_split % params[1] == 0 and K % params[1] == 0:
        bm, bk, fmt, quant, nb = params
        P = T * int(top_k)
        plan = DecodePlan(torch.empty(nb * bm, dtype=torch.int32, device=x.device),
                          torch.empty(nb, dtype=torch.int32, device=x.device),
                          torch.empty(T, K, dtype=x.dtype, device=x.device), P, bm, bk)
        extra = dict(pairs_ptr=plan.pairs, bexp_ptr=plan.block_expert, xs_ptr=plan.xs, NB=nb,
                     stride_xs=plan.xs.stride(0), PLAN=True, PLAN_BM=bm,
                     PP=max(16, triton.next_power_of_2(P)),
                     NBP=max(16, triton.next_power_of_2(nb)), PREP_FMT=fmt, PREP_QUANT=quant,
                     PREP_BK=bk)
    _gate_route_kernel[(tiles, split)](
        x, weight, logits, ws, counters, logits if is_hash else bias.float().contiguous(),
        tid2eid.contiguous() if is_hash else logits,
        input_ids.contiguous() if is_hash else logits, weights, ids,
        T, E, K, x.stride(0), weight.stride(0), T * E, k_per_split, float(route_scale),
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, SPLITS=split, DOT=cfg.BM >= 16, W_BF16=w_bf16,
        TOP_K=int(top_k), KP=triton.next_power_of_2(top_k), HASH=is_hash, BLOCK_T=block_t,
        BLOCK_E=block_e, ROW_BLOCKS=triton.cdiv(T, block_t), **extra, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False, **pdl_args(x))
    return weights, ids, plan
