"""The Lightning Indexer of V4 CSA layers (spec §3.8).

It keeps its own overlapping ratio-4 compressor (d = index_head_dim) whose entries are the index
keys, scores every visible entry of the token's request with
``score(t, s) = Σ_h w_h · ReLU(q_h · K_s)`` and returns the ``index_topk`` best entry ids.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from dsv4.cache.tensors import CompressorSpec, HybridCache
from dsv4.config import ModelConfig
from dsv4.model.compressor import Compressor, entry_pool_rows
from dsv4.model.context import StepContext
from dsv4.model.layers import Linear, check_numerics

__all__ = ["Indexer", "visible_entries"]


def visible_entries(ctx: StepContext, ratio: int) -> Tensor:
    """[T] int64: entries visible to each token, ``(pos + 1) // ratio`` (memoized per step)."""
    key = ("visible", ratio)
    if key not in ctx.memo:
        ctx.memo[key] = torch.div(ctx.positions + 1, ratio, rounding_mode="floor")
    return ctx.memo[key]


class Indexer(nn.Module):
    """Parameters (official names under ``indexer.``): ``wq_b`` [h·dI, q_lora] (FP8),
    ``weights_proj`` [h, D] (bf16), ``compressor.{wkv, wgate, ape, norm}``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: SimpleNamespace,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.numerics = check_numerics(numerics)
        self.ops = ops
        self.ratio = cfg.ratio(layer_id)
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        qfmt = "fp8" if cfg.quantized else "bf16"
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, fmt=qfmt,
                           block=cfg.weight_block_size, numerics=numerics, dtype=dtype)
        self.weights_proj = Linear(cfg.dim, self.n_heads, fmt="bf16", numerics=numerics,
                                   dtype=dtype)
        spec = CompressorSpec("index", self.ratio, self.head_dim, overlap=True)
        self.compressor = Compressor(cfg, layer_id, spec, numerics, ops, dtype, rotate=True)
        # weights_proj(x) · dI^-0.5 · h^-0.5 (the q·k scale folded into the head weights)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def forward(self, x: Tensor, qr: Tensor, ctx: StepContext, cache: HybridCache,
                cos: Tensor, sin: Tensor) -> Tensor:
        """Entry ids [T, index_topk] (ascending, −1 = none) picked for every token.

        x [T, D] is the attention input, qr [T, q_lora] the normalized query latent, cos/sin the
        layer's RoPE rows at the tokens' positions.
        """
        T = x.shape[0]
        keys = cache.index_key_pool(self.layer_id)
        self.compressor(x, ctx, cache.compressor_state(self.layer_id, "index"), keys)

        q = self.wq_b(qr).view(T, self.n_heads, self.head_dim)
        q = self.ops.apply_rope(q, cos, sin)
        if self.numerics == "official":
            from dsv4.formats import fake_quant_fp4, hadamard_transform
            q = fake_quant_fp4(hadamard_transform(q), 32)
        w = (self.weights_proj(x) * self.weight_scale).float()

        n_visible = visible_entries(ctx, self.ratio)
        key_rows = entry_pool_rows(ctx, self.ratio, cache.page_size)[ctx.request_of_token]
        scores = self.ops.indexer_scores(q, w, keys.view(-1, self.head_dim), key_rows, n_visible)
        return self.ops.topk_indices(scores, n_visible, self.topk)
