"""Torch twins of the fused MoE glue (spec §3.9): routing after the gate GEMM, the SwiGLU of the
shared expert, and the routed + shared combine.

Each is the code the MoE ran before the fusion, verbatim, so the torch path keeps its bits; the
Triton kernels in ``dsv4/ops/triton_route.py`` have the same signatures.

* ``moe_route(logits, bias, tid2eid, input_ids, top_k, route_scale) -> (weights, ids)``:
  ``s = sqrt(softplus(logits))``; learned layers pick the top-k of ``s + bias`` (descending),
  hash layers take ``tid2eid[input_ids]``; weights = picked ``s`` / their sum · ``route_scale``.
* ``swiglu_act(gate, up, limit, out_dtype)``: ``silu(min(gate, limit)) · clamp(up, ±limit)``
  in fp32, rounded once to ``out_dtype`` (limit 0: no clamp).
* ``moe_combine(routed, shared, out_dtype)``: ``routed (fp32) + shared`` rounded to
  ``out_dtype``.

Two compositions whose Triton forms save a decode launch each:

* ``moe_gate(x, weight, bias, tid2eid, input_ids, top_k, route_scale)``: the gate GEMM
  (``linear_fp32``) and ``moe_route``;
* ``moe_experts_shared(x, ids, weights, experts, limit, shared, wait_shared)``:
  ``moe_combine(moe_experts(...), shared, x.dtype)``, with ``wait_shared()`` called before
  ``shared`` is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsv4.ops.torch_dense import ExpertWeights, linear_fp32, moe_experts, swiglu

__all__ = ["check_route_args", "moe_combine", "moe_experts_shared", "moe_gate", "moe_gate_plan",
           "moe_route", "swiglu_act"]


def check_route_args(logits: torch.Tensor, bias: torch.Tensor | None,
                     tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None,
                     top_k: int) -> None:
    """Raise ValueError unless the arguments describe one learned or one hash routing."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"moe_route: logits must be fp32 [T, E]; found {logits.dtype} "
                         f"{tuple(logits.shape)}")
    T, E = logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"moe_route: top_k must be in 1..{E}; found {top_k}")
    if (tid2eid is None) == (bias is None):
        raise ValueError("moe_route: pass exactly one of bias (learned routing) and tid2eid "
                         "(hash routing)")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"moe_route: bias must have shape ({E},); found {tuple(bias.shape)}")
    if tid2eid is not None:
        if tid2eid.dim() != 2 or tid2eid.shape[1] != top_k:
            raise ValueError(f"moe_route: tid2eid must be [vocab, {top_k}]; found "
                             f"{tuple(tid2eid.shape)}")
        if input_ids is None or tuple(input_ids.shape) != (T,):
            raise ValueError(f"moe_route: hash routing needs input_ids [{T}]; found "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              input_ids: torch.Tensor | None, top_k: int, route_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of the gate logits [T, E] fp32: (weights [T, k] fp32, expert ids [T, k] int64).

    Learned routing (``bias`` [E]): the top-k of ``s + bias``; hash routing (``tid2eid``
    [vocab, k], ``input_ids`` [T]): the table's row of each token.  ``bias`` only steers the
    selection; the weights are the unbiased ``s`` normalized to sum 1, times ``route_scale``.
    """
    check_route_args(logits, bias, tid2eid, input_ids, top_k)
    scores = F.softplus(logits).sqrt()
    if tid2eid is not None:
        ids = tid2eid[input_ids]
    else:
        ids = (scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True) * route_scale
    return weights, ids


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``silu(gate) · up`` with the V4 clamp, fp32 math, ``out_dtype`` out.  gate, up [..., I]."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_act: gate and up must have one shape; found "
                         f"{tuple(gate.shape)} and {tuple(up.shape)}")
    return swiglu(gate, up, limit).to(out_dtype)


def moe_combine(routed: torch.Tensor, shared: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``routed + shared`` in fp32 (routed fp32 [T, D], shared [T, D]), ``out_dtype`` out."""
    if routed.shape != shared.shape or routed.dtype != torch.float32:
        raise ValueError(f"moe_combine: expected routed fp32 and shared of one shape; found "
                         f"{routed.dtype} {tuple(routed.shape)} and {tuple(shared.shape)}")
    return (routed + shared.float()).to(out_dtype)


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None, top_k: int,
             route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a V4 MoE layer: the fp32 gate GEMM ``x·weightᵀ`` [T, E], then
    :func:`moe_route`: (weights [T, k] fp32, ids [T, k] int64)."""
    return moe_route(linear_fp32(x, weight), bias, tid2eid, input_ids, top_k, route_scale)


def moe_gate_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None, top_k: int,
                  route_scale: float, experts: ExpertWeights
                  ) -> tuple[torch.Tensor, torch.Tensor, None]:
    """:func:`moe_gate` plus the experts' decode plan of its ids for ``experts`` (the Triton
    kernel builds it in the routing launch; the twins need none): (weights, ids, None)."""
    return (*moe_gate(x, weight, bias, tid2eid, input_ids, top_k, route_scale), None)


def moe_experts_shared(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: ExpertWeights, swiglu_limit: float, shared: torch.Tensor,
                       wait_shared: Callable[[], None] | None = None,
                       plan: object = None) -> torch.Tensor:
    """One rank's MoE output in x's dtype: the routed experts (fp32) plus ``shared``, rounded
    once; ``wait_shared()`` runs before ``shared`` is read; ``plan`` (``moe_gate_plan``'s)
    changes nothing here."""
    routed = moe_experts(x, topk_ids, topk_weights, experts, swiglu_limit)
    if wait_shared is not None:
        wait_shared()
    return moe_combine(routed, shared, x.dtype)
