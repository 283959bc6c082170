"""Manifold-constrained hyper-connections (mHC, spec §3.4 and §3.10).

The residual stream of V4 is ``n_hc`` parallel copies ``X [T, n_hc, D]``. Before each sublayer,
``hc_pre`` collapses them into the sublayer input and derives ``post`` / ``comb``; after it,
``hc_post`` expands the output back into ``n_hc`` streams. ``hc_head`` collapses the streams once
more before the final norm. ``post_pre`` fuses a post with the next sublayer's pre (V4 chains
them within and across blocks).

The official tensors are flat attributes of their owner (``layers.{L}.hc_attn_fn``,
``hc_head_base``, ...). Here each triple lives in a small module (``hc_attn.fn``,
``hc_head.base``); ``official_names`` gives the official spelling of each parameter.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4.config import ModelConfig

if TYPE_CHECKING:
    from dsv4.model.layers import RMSNorm


class _FlatOfficialNames:
    """The triple of a module registered as ``<owner>.hc_attn`` is officially named
    ``<owner>.hc_attn_fn`` / ``_base`` / ``_scale``."""

    def official_names(self, prefix: str) -> dict[str, str]:
        """Official tensor name -> local parameter name, for this module at ``prefix``."""
        side = prefix.rstrip(".")
        return {f"{side}_{p}": p for p in ("fn", "base", "scale")}


class HyperConnection(_FlatOfficialNames, nn.Module):
    """The mHC parameters of one block side (attention or FFN) and its pre/post steps.

    ``fn [(2+n)·n, n·D]``, ``base [(2+n)·n]``, ``scale [3]``, all fp32 whatever the compute dtype.
    """

    def __init__(self, cfg: ModelConfig, ops: SimpleNamespace) -> None:
        super().__init__()
        n, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        self.ops = ops
        self.norm_eps = cfg.norm_eps
        self.hc_eps = cfg.hc_eps
        self.iters = cfg.hc_sinkhorn_iters
        self.fn = nn.Parameter(torch.zeros(mix, n * cfg.dim, dtype=torch.float32),
                               requires_grad=False)
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def pre(self, x: torch.Tensor, norm: RMSNorm | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, n, D] -> (sublayer input [T, D], post [T, n], comb [T, n, n]).

        With ``norm`` (the sublayer's input RMSNorm), the input comes out normed: the same bits
        as ``norm(y)``, in the collapse kernel itself at decode on the Triton path."""
        return self.ops.hc_pre(x, self.fn, self.scale, self.base, self.norm_eps, self.hc_eps,
                               self.iters, *_norm_args(norm))

    def post(self, out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        """Sublayer output [T, D] + residual streams [T, n, D] -> new streams [T, n, D]."""
        return self.ops.hc_post(out, x_res, post, comb)

    def post_pre(self, out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor, following: HyperConnection, norm: RMSNorm | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This side's ``post`` fused with ``following.pre`` on the new streams (spec §3.5).

        Returns ``(x_new [T, n, D], y [T, D], post' [T, n], comb' [T, n, n])``, the same as
        ``x_new = self.post(...)`` then ``following.pre(x_new, norm)``; one pass over x_new
        instead of two on the Triton path.  Op tables without ``hc_post_pre`` run the two ops.
        """
        fused = getattr(self.ops, "hc_post_pre", None)
        if fused is None:
            x_new = self.post(out, x_res, post, comb)
            return (x_new, *following.pre(x_new, norm))
        return fused(out, x_res, post, comb, following.fn, following.scale, following.base,
                     following.norm_eps, following.hc_eps, following.iters, *_norm_args(norm))


class HyperHead(_FlatOfficialNames, nn.Module):
    """The final stream collapse before the model norm: ``fn [n, n·D]``, ``base [n]``,
    ``scale [1]`` (fp32), no Sinkhorn and no post (spec §3.10)."""

    def __init__(self, cfg: ModelConfig, ops: SimpleNamespace) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.ops = ops
        self.norm_eps = cfg.norm_eps
        self.hc_eps = cfg.hc_eps
        self.fn = nn.Parameter(torch.zeros(n, n * cfg.dim, dtype=torch.float32),
                               requires_grad=False)
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """x [T, n, D] -> [T, D] in x.dtype; with ``norm`` (the model's final norm) normed, the
        same bits as ``norm(hc_head(x))``."""
        return self.ops.hc_head(x, self.fn, self.scale, self.base, self.norm_eps, self.hc_eps,
                                *_norm_args(norm))


def _norm_args(norm: RMSNorm | None) -> tuple:
    """The (norm_weight, rms_eps) arguments of the hc ops for an optional RMSNorm module (none
    when absent: op tables written before the fused norm keep working)."""
    return () if norm is None else (norm.weight, norm.eps)


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """Embedding output [T, D] -> n identical streams [T, n, D] (spec §3.3)."""
    return h.unsqueeze(1).expand(h.shape[0], n, h.shape[1]).contiguous()
