"""Triton kernel of the indexer's query path (spec §3.8 steps 1 and 3, §4.5 scoring steps 1-2);
same signature as the twin ``dsv4/ops/torch_index.py``.

``indexer_queries`` replaces, after the ``wq_b`` / ``weights_proj`` GEMMs, the RoPE of the index
queries' tails, the 128-wide Hadamard rotation (V4: 7 butterfly stages, ~20 torch kernels), the
FP4 fake quant (~15 kernels) and the head-weight scaling with one launch: a program holds
``BLOCK_H`` heads of one token in registers and writes their finished queries and weights.

Numerics follow the twin's rounding points exactly:

* RoPE in fp32 (``a·c − b·s``, compiled without FMA contraction), rounded to q's dtype;
* the Hadamard butterflies ``(a, b) -> (a + b, a − b)`` in fp32 in the twin's stage order (each
  output is one add of the same two operands, so the values are bit-equal), then ``· fp32(d^-½)``
  and a rounding to q's dtype;
* the FP4 quant as ``formats.fake_quant_fp4`` computes it (the block amax and ``amax · fp32(1/6)``
  in q's dtype, the power-of-two scale read off the bits, IEEE ``x / s``, RNE onto e2m1);
* ``weights · fp32(scale)`` rounded to the weights' dtype, stored as fp32.

So fp32 outputs are expected bit-equal to the twin; the tests bound fp32 queries at 1e-6
relative and count FP4 codes that differ (a rounding-boundary move; none seen in the tests).
bf16 rounding is done by hand (the interpreter's own cast truncates).  Unsupported inputs (dtypes
other than fp32 / bf16, a head dim that is not a power of two or above ``MAX_DIM``) run the twin.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.ops import torch_index as twin
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import round_as, store_rne, torch_twin_off_gpu

__all__ = ["indexer_queries", "index_tile", "MAX_DIM", "picked_rows"]

MAX_DIM = 1024
# Elements of one program's tile (heads × head dim).
_TILE_ELEMS = 4096
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _hadamard(x, BH: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of each row of x [BH, D] (Sylvester order): stage
    s pairs channels i and i + 2^s inside blocks of 2^(s+1), as ``formats.hadamard_transform``."""
    for s in tl.static_range(LOG2_D):
        y = tl.reshape(x, [BH, D // (2 << s), 2, 1 << s])
        a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [BH, D])
    return x


@triton.jit
def _e2m1_value(v):
    """fp32 ``v`` (|v| <= 6) rounded onto the e2m1 grid (nearest, ties to the even code, the
    thresholds of ``formats.e2m1_codes``), kept in fp32 with v's sign (−0.0 included)."""
    a = tl.abs(v)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    e = mag >> 1
    m = mag & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)   # 2^(e−1)·(1 + m/2)
    val = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    # The sign bit is copied, not negated: Triton's unary minus is 0 − x, which loses −0.0.
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (val.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _indexer_queries_kernel(q_ptr, w_ptr, cos_ptr, sin_ptr, qo_ptr, wo_ptr, H,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_wt, stride_c,
                            weight_scale, had_scale,
                            D: tl.constexpr, HALF: tl.constexpr, LOG2_D: tl.constexpr,
                            HADAMARD: tl.constexpr, FP4_BLOCK: tl.constexpr,
                            BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    c = tl.arange(0, D)
    x = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + c[None, :],
                mask=hm[:, None], other=0.0).to(tl.float32)
    # RoPE of the last HALF pairs (pair j = channels 2j, 2j+1), rounded to q's dtype.
    a, b = tl.split(tl.reshape(x, [BLOCK_H, D // 2, 2]))
    i = tl.arange(0, D // 2) - (D // 2 - HALF)
    rm = i >= 0
    cs = tl.load(cos_ptr + t * stride_c + i, mask=rm, other=1.0)
    sn = tl.load(sin_ptr + t * stride_c + i, mask=rm, other=0.0)
    ra = round_as(a * cs[None, :] - b * sn[None, :], qo_ptr)
    rb = round_as(a * sn[None, :] + b * cs[None, :], qo_ptr)
    a = tl.where(rm[None, :], ra, a)
    b = tl.where(rm[None, :], rb, b)
    x = tl.reshape(tl.join(a, b), [BLOCK_H, D])
    if HADAMARD:
        x = round_as(_hadamard(x, BLOCK_H, D, LOG2_D) * had_scale, qo_ptr)
    if FP4_BLOCK > 0:
        xb = tl.reshape(x, [BLOCK_H, D // FP4_BLOCK, FP4_BLOCK])
        # amax · fp32(1/6) is a tensor op in q's dtype in the twin: rounded there.
        t6 = round_as(tl.maximum(tl.max(tl.abs(xb), axis=2), 7.052966104933725e-38)
                       * 0.16666666666666666, qo_ptr)
        bits = t6.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (tl.minimum(tl.maximum(e, 1), 254) << 23).to(tl.float32, bitcast=True)
        v = _e2m1_value(tl.clamp(tl.div_rn(xb, s[:, :, None]), -6.0, 6.0))
        x = tl.reshape(v * s[:, :, None], [BLOCK_H, D])
    store_rne(qo_ptr + t * stride_ot + h[:, None] * stride_oh + c[None, :], x, hm[:, None])
    w = tl.load(w_ptr + t * stride_wt + h, mask=hm, other=0.0).to(tl.float32)
    tl.store(wo_ptr + t * H + h, round_as(w * weight_scale, w_ptr), mask=hm)


def index_tile(n_heads: int, head_dim: int) -> dict[str, int]:
    """BLOCK_H and num_warps of a launch (heads per program)."""
    block_h = max(1, min(_TILE_ELEMS // head_dim, triton.next_power_of_2(max(n_heads, 1))))
    return {"BLOCK_H": block_h, "num_warps": 4}


def _kernel_fits(q: torch.Tensor, weights: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (q.dtype in _KERNEL_DTYPES and weights.dtype in _KERNEL_DTYPES and d >= 2
            and d & (d - 1) == 0 and d <= MAX_DIM)


@torch_twin_off_gpu("dsv4.ops.torch_index")
def indexer_queries(q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    weight_scale: float, hadamard: bool, fp4_block: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries [T, h, dI] (RoPE, Hadamard, FP4 fake quant) and head weights [T, h] fp32,
    one launch.  See the torch twin."""
    twin.check_indexer_query_args(q, weights, cos, sin, hadamard, fp4_block)
    if not _kernel_fits(q, weights) or (fp4_block and fp4_block & (fp4_block - 1)):
        return twin.indexer_queries(q, weights, cos, sin, weight_scale, hadamard, fp4_block)
    T, H, D = q.shape
    q_out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    w_out = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return q_out, w_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    tile = index_tile(H, D)
    args: dict[str, Any] = dict(D=D, HALF=cos.shape[1], LOG2_D=D.bit_length() - 1,
                                HADAMARD=bool(hadamard), FP4_BLOCK=int(fp4_block))
    _indexer_queries_kernel[(T, triton.cdiv(H, tile["BLOCK_H"]))](
        q, weights, cos, sin, q_out, w_out, H, q.stride(0), q.stride(1), q_out.stride(0),
        q_out.stride(1), weights.stride(0), cos.stride(0), float(weight_scale),
        float(D ** -0.5), enable_fp_fusion=False, **args, **tile, **pdl_args(q))
    return q_out, w_out


@triton.jit
def _picked_rows_kernel(table_ptr, ids_ptr, out_ptr, K, C, stride_t, stride_i, stride_o,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, j] = table[t, ids[t, j] mod C] (the twin's ``remainder``: −1 -> C − 1)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < K
    ids = tl.load(ids_ptr + t * stride_i + j, mask=m, other=0)
    col = ids % C
    col = tl.where(col < 0, col + C, col)
    rows = tl.load(table_ptr + t * stride_t + col, mask=m, other=-1)
    tl.store(out_ptr + t * stride_o + j, rows, mask=m)


@torch_twin_off_gpu("dsv4.ops.torch_index")
def picked_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, k] int32 pool rows of top-k entry ids through the per-token row tables, one launch
    (the twin's remainder + gather are two torch kernels without programmatic dependent
    launch).  See the torch twin."""
    if table.dim() != 2 or ids.dim() != 2 or ids.shape[0] != table.shape[0]:
        return twin.picked_rows(table, ids)         # its error message
    T, K = ids.shape
    out = torch.empty(T, K, dtype=table.dtype, device=table.device)
    if T == 0 or K == 0:
        return out
    if table.stride(1) != 1:
        table = table.contiguous()
    if ids.stride(1) != 1:
        ids = ids.contiguous()
    block = min(1024, triton.next_power_of_2(K))
    _picked_rows_kernel[(T, triton.cdiv(K, block))](
        table, ids, out, K, table.shape[1], table.stride(0), ids.stride(0), out.stride(0),
        BLOCK=block, num_warps=4, **pdl_args(table))
    return out
