"""Torch twin of the indexer's fused query path (spec §3.8 steps 1 and 3, §4.5 scoring steps 1-2).

``indexer_queries`` is, operation for operation, what the indexers ran before the fusion: RoPE of
each head's last ``rd`` channels (``torch_attn.apply_rope``), the normalized Walsh-Hadamard
rotation (V4), the FP4 fake quant (official numerics) and the per-head weights
``weights_proj(x) · scale`` (rounded in the projection's dtype, then fp32).  So the model's torch
path keeps its bits, and ``dsv4/ops/triton_index.py`` reproduces these rounding points.
"""

from __future__ import annotations

from torch import Tensor

from dsv4.formats import fake_quant_fp4, hadamard_transform
from dsv4.ops import torch_attn
from dsv4.ops.torch_norm import check_rope_args

__all__ = ["indexer_queries", "check_indexer_query_args", "picked_rows"]


def picked_rows(table: Tensor, ids: Tensor) -> Tensor:
    """[T, k] int32 pool rows of the top-k entry ids ``ids`` [T, k] (int, −1 for a blank, else
    < L) through each token's row table ``table`` [T, L + 1] int32 whose last column holds −1:
    ``ids mod (L + 1)`` sends a blank to that column, so one gather maps picks and blanks."""
    if table.dim() != 2 or ids.dim() != 2 or ids.shape[0] != table.shape[0]:
        raise ValueError(f"picked_rows: expected table [T, L+1] and ids [T, k]; found "
                         f"{tuple(table.shape)} and {tuple(ids.shape)}")
    return table.gather(1, ids.remainder(table.shape[1]))


def check_indexer_query_args(q: Tensor, weights: Tensor, cos: Tensor, sin: Tensor,
                             hadamard: bool, fp4_block: int) -> None:
    """ValueError unless q [T, h, dI], weights [T, h], cos/sin [T, rd/2] fit together and the
    Hadamard width / FP4 block fit dI."""
    if q.dim() != 3:
        raise ValueError(f"indexer_queries: q must be [T, h, dI]; found shape {tuple(q.shape)}")
    check_rope_args("indexer_queries", q, cos, sin, min_dim=3)
    T, h, d = q.shape
    if weights.dim() != 2 or tuple(weights.shape) != (T, h):
        raise ValueError(f"indexer_queries: weights must be [T, h] = [{T}, {h}]; found shape "
                         f"{tuple(weights.shape)}")
    if hadamard and (d < 1 or d & (d - 1)):
        raise ValueError(f"indexer_queries: the Hadamard rotation needs a power-of-two head dim; "
                         f"found dI={d}")
    if fp4_block < 0 or (fp4_block and d % fp4_block):
        raise ValueError(f"indexer_queries: fp4_block={fp4_block} must be 0 or a divisor of "
                         f"dI={d}")


def indexer_queries(q: Tensor, weights: Tensor, cos: Tensor, sin: Tensor, weight_scale: float,
                    hadamard: bool, fp4_block: int) -> tuple[Tensor, Tensor]:
    """Index queries and head weights of one step.

    q [T, h, dI] is ``wq_b(qr)`` viewed per head; weights [T, h] is ``weights_proj(x)``;
    cos, sin [T, rd/2] fp32 the rotation at the tokens' positions.  Returns
    ``(q', w)``: q' [T, h, dI] in q's dtype = RoPE of the last rd channels, then (``hadamard``)
    the Hadamard rotation, then (``fp4_block`` > 0) the FP4 e2m1 fake quant with e8m0 scales per
    ``fp4_block`` channels; w [T, h] fp32 = ``(weights · weight_scale)`` rounded in weights'
    dtype.  Each step rounds to q's dtype, as the unfused code did.
    """
    check_indexer_query_args(q, weights, cos, sin, hadamard, fp4_block)
    q = torch_attn.apply_rope(q, cos, sin)
    if hadamard:
        q = hadamard_transform(q)
    if fp4_block:
        q = fake_quant_fp4(q, fp4_block)
    return q, (weights * weight_scale).float()
