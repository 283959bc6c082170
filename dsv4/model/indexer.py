"""The Lightning Indexer of V4 CSA layers (spec §3.8) and V4.1's indexer v2 (spec §4.5).

V4: the indexer keeps its own overlapping ratio-4 compressor (d = index_head_dim) whose entries
are the index keys, scores every visible entry of the token's request with
``score(t, s) = Σ_h w_h · ReLU(q_h · K_s)`` and returns the ``index_topk`` best entry ids.

V4.1 (``IndexerV2``): no compressor and no Hadamard; the keys are derived from the KV source's
compressed latent (``wk``, ``k_norm``, owned by KV sources only) and live in the source's key
pool; the candidate source publishes a block mask that later index sources restrict to.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from dsv4.cache.formats import V4_INDEX_BLOCK, V41_INDEX_BLOCK, RecordFormat, rows_view
from dsv4.cache.tensors import CompressorSpec, HybridCache
from dsv4.config import ModelConfig
from dsv4.model.compressor import Compressor, entry_plan, entry_pool_rows
from dsv4.model.context import StepContext
from dsv4.model.layers import Linear, RMSNorm, check_numerics

__all__ = ["Indexer", "IndexerV2", "visible_entries", "token_key_rows", "TOPK_MEMO",
           "CANDIDATES_MEMO"]


def visible_entries(ctx: StepContext, ratio: int) -> Tensor:
    """[T] int64: entries visible to each token, ``(pos + 1) // ratio`` (memoized per step)."""
    key = ("visible", ratio)
    if key not in ctx.memo:
        ctx.memo[key] = torch.div(ctx.positions + 1, ratio, rounding_mode="floor")
    return ctx.memo[key]


def token_key_rows(ctx: StepContext, ratio: int, page_size: int) -> Tensor:
    """[T, L] int64 key pool rows of the entries of each token's request (−1: none), memoized
    per step: every index layer of the ratio shares it.  In a static-shape (decode) step token
    t is request t, so the request rows serve as they are (no gather kernel)."""
    key = ("token_key_rows", ratio, page_size)
    if key not in ctx.memo:
        rows = entry_pool_rows(ctx, ratio, page_size)
        if ctx.static is None:
            rows = rows[ctx.request_of_token]
        ctx.memo[key] = rows
    return ctx.memo[key]


class _IndexScorer(nn.Module):
    """What both indexers share: the projections ``wq_b`` [h·dI, q_lora] (FP8) and
    ``weights_proj`` [h, D] (bf16), and the weighted q·k scores of the visible entries."""

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
        # weights_proj(x) · dI^-0.5 · h^-0.5 (the q·k scale folded into the head weights)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        # FP4 block of the queries' official fake quant (the keys' block, spec §3.8, §4.5).
        self.fp4_block = V41_INDEX_BLOCK if cfg.is_v41 else V4_INDEX_BLOCK

    def queries(self, x: Tensor, qr: Tensor, cos: Tensor, sin: Tensor, hadamard: bool
                ) -> tuple[Tensor, Tensor]:
        """(index queries [T, h, dI], head weights [T, h] fp32) of the step, one fused op after
        the two GEMMs: RoPE of each head's tail, the Hadamard rotation when ``hadamard`` (V4),
        the FP4 fake quant in official numerics, ``weights_proj(x) · weight_scale``."""
        T = x.shape[0]
        q = self.wq_b(qr).view(T, self.n_heads, self.head_dim)
        fp4_block = self.fp4_block if self.numerics == "official" else 0
        return self.ops.indexer_queries(q, self.weights_proj(x), cos, sin, self.weight_scale,
                                        hadamard, fp4_block)

    def scores(self, q: Tensor, w: Tensor, flat_keys: Tensor, ctx: StepContext,
               cache: HybridCache) -> tuple[Tensor, Tensor]:
        """(scores [T, entries], visible entries [T]) of queries q [T, h, dI] with head weights
        w [T, h] fp32 against the layer's key pool rows ``flat_keys``."""
        n_visible = visible_entries(ctx, self.ratio)
        key_rows = token_key_rows(ctx, self.ratio, cache.page_size)
        return self.ops.indexer_scores(q, w, flat_keys, key_rows, n_visible), n_visible


class Indexer(_IndexScorer):
    """Parameters (official names under ``indexer.``): ``wq_b`` [h·dI, q_lora] (FP8),
    ``weights_proj`` [h, D] (bf16), ``compressor.{wkv, wgate, ape, norm}``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: SimpleNamespace,
                 dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_id, numerics, ops, dtype)
        spec = CompressorSpec("index", self.ratio, self.head_dim, overlap=True)
        self.compressor = Compressor(cfg, layer_id, spec, numerics, ops, dtype, rotate=True)

    def forward(self, x: Tensor, qr: Tensor, ctx: StepContext, cache: HybridCache,
                cos: Tensor, sin: Tensor) -> Tensor:
        """Entry ids [T, index_topk] (ascending, −1 = none) picked for every token.

        x [T, D] is the attention input, qr [T, q_lora] the normalized query latent, cos/sin the
        layer's RoPE rows at the tokens' positions.  = :meth:`write_keys`, then :meth:`pick`.
        """
        self.write_keys(x, ctx, cache)
        return self.pick(x, qr, ctx, cache, cos, sin)

    def write_keys(self, x: Tensor, ctx: StepContext, cache: HybridCache,
                   rows: tuple[Tensor, Tensor] | None = None) -> None:
        """Compress this step's new index keys into the layer's key pool (``rows``: the
        compressor's rows of x, made already)."""
        self.compressor(x, ctx, cache.compressor_state(self.layer_id, "index"),
                        cache.index_key_pool(self.layer_id), cache.index_key_format, rows=rows)

    def rotates(self, key_fmt: RecordFormat | None) -> bool:
        """Whether the queries get the Hadamard rotation against keys of ``key_fmt``."""
        # Official numerics rotate (Hadamard) then FP4-quantize the queries.  fp4 record keys
        # are stored Hadamard-rotated in every numerics: the queries are rotated alike then (an
        # orthogonal rotation of both leaves q·k unchanged).
        return self.numerics == "official" or key_fmt is not None

    def prepare(self, ctx: StepContext, cache: HybridCache) -> None:
        """Make the step's shared index plans now (ctx.memo: the entry plan, the requests' and
        tokens' pool rows), on the current stream, before :meth:`write_keys` and :meth:`pick`
        are issued on two lanes that both read them."""
        entry_plan(ctx, self.ratio)
        visible_entries(ctx, self.ratio)
        token_key_rows(ctx, self.ratio, cache.page_size)

    def pick(self, x: Tensor, qr: Tensor, ctx: StepContext, cache: HybridCache,
             cos: Tensor, sin: Tensor, keys_written: torch.cuda.Event | None = None,
             queries: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The top-k entry ids of every token against the key pool (after :meth:`write_keys`).

        ``keys_written``: :meth:`write_keys` ran on another stream (the branch lane) up to this
        event; the queries, which do not read the keys, are issued before the wait for it.
        ``queries``: (q, w) of :meth:`queries` with :meth:`rotates` of the pool's format, made
        already."""
        keys = cache.index_key_pool(self.layer_id)
        key_fmt = cache.index_key_format
        q, w = (self.queries(x, qr, cos, sin, hadamard=self.rotates(key_fmt))
                if queries is None else queries)
        if keys_written is not None:
            torch.cuda.current_stream(x.device).wait_event(keys_written)
        flat_keys = rows_view(keys.view(-1, keys.shape[-1]), key_fmt)
        scores, n_visible = self.scores(q, w, flat_keys, ctx, cache)
        return self.ops.topk_indices(scores, n_visible, self.topk)


# Keys of the per-step scratch (StepContext.memo) where V4.1 layers publish what later layers of
# the same step read: ``(TOPK_MEMO, layer)`` -> entry ids [T, k]; ``(CANDIDATES_MEMO, layer)`` ->
# the candidate mask [T, L] bool.  The step object, not process-global state, carries them.
TOPK_MEMO = "v41_topk"
CANDIDATES_MEMO = "v41_candidates"


class IndexerV2(_IndexScorer):
    """V4.1 indexer of an index-source layer (spec §4.5).

    Parameters (official names under ``indexer.``): ``wq_b`` [h·dI, q_lora] (FP8),
    ``weights_proj`` [h, D] (bf16); KV sources also own ``wk`` [dI, head_dim] and ``k_norm`` [dI],
    which turn the source's pre-RoPE compressed latent into index keys (``keys_from_latent``).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: SimpleNamespace,
                 dtype: torch.dtype) -> None:
        if not cfg.is_v41 or layer_id not in cfg.index_source_layers:
            raise ValueError(f"IndexerV2: layer {layer_id} is not a V4.1 index source "
                             f"(index_source_layer_ids {list(cfg.index_source_layers)})")
        super().__init__(cfg, layer_id, numerics, ops, dtype)
        self.is_candidate_source = layer_id == cfg.candidate_source_layer
        self.uses_candidates = cfg.uses_candidates(layer_id)
        if self.uses_candidates and cfg.ratio(cfg.candidate_source_layer) != self.ratio:
            raise ValueError(f"IndexerV2(layer {layer_id}): ratio {self.ratio} differs from the "
                             f"candidate source layer {cfg.candidate_source_layer}'s ratio "
                             f"{cfg.ratio(cfg.candidate_source_layer)}")
        self.owns_keys = layer_id in cfg.kv_source_layers
        if self.owns_keys:
            self.wk = Linear(cfg.head_dim, self.head_dim, fmt="bf16", numerics=numerics,
                             dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, ops)

    def keys_from_latent(self, latent: Tensor, cos: Tensor, sin: Tensor,
                         quantize: bool = True) -> Tensor:
        """Index keys [E, dI] of new entries from their pre-RoPE latent [E, head_dim]
        (``cos``/``sin`` at the entries' positions j·r).  ``quantize`` False skips the official
        fake quant (for a record pool, whose packing rounds the keys the same way)."""
        from dsv4.model.v41 import index_keys_from_latent

        if not self.owns_keys:
            raise ValueError(f"IndexerV2(layer {self.layer_id}): only KV-source layers own index "
                             f"keys (kv_source_layer_ids {list(self.cfg.kv_source_layers)})")
        return index_keys_from_latent(latent, self.wk, self.k_norm, cos, sin,
                                      self.numerics if quantize else "bf16", ops=self.ops)

    def forward(self, x: Tensor, qr: Tensor, ctx: StepContext, cache: HybridCache,
                cos: Tensor, sin: Tensor, queries: tuple[Tensor, Tensor] | None = None
                ) -> Tensor:
        """Entry ids [T, index_topk] (ascending, −1 = none) picked for every token; also
        published in ``ctx.memo[(TOPK_MEMO, layer)]`` (and the candidate mask of the candidate
        source in ``ctx.memo[(CANDIDATES_MEMO, layer)]``).

        Scores run against the key pool of the layer's KV source, which for a KV source is its
        own (spec §6.13: never another source's keys).  ``queries``: (q, w) of
        :meth:`queries` (no Hadamard), made already.
        """
        from dsv4.model.v41 import restrict_to_candidates, select_candidate_blocks, topk_sorted

        cfg = self.cfg
        keys = cache.index_key_pool(self.layer_id)
        keys = rows_view(keys.view(-1, keys.shape[-1]), cache.index_key_format)
        # No Hadamard in V4.1 (spec §4.5 scoring step 1).
        q, w = self.queries(x, qr, cos, sin, hadamard=False) if queries is None else queries
        scores, n_visible = self.scores(q, w, keys, ctx, cache)
        if self.is_candidate_source:
            # From the unrestricted (causally masked) scores (spec §4.5 item 5).
            ctx.memo[(CANDIDATES_MEMO, self.layer_id)] = select_candidate_blocks(
                scores, n_visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        if self.uses_candidates:
            key = (CANDIDATES_MEMO, cfg.candidate_source_layer)
            if key not in ctx.memo:
                raise ValueError(f"IndexerV2(layer {self.layer_id}): the candidate source layer "
                                 f"{cfg.candidate_source_layer} has not run in this step")
            scores = restrict_to_candidates(scores, ctx.memo[key])
        ids = topk_sorted(scores, n_visible, self.topk, ops=self.ops)
        ctx.memo[(TOPK_MEMO, self.layer_id)] = ids
        return ids
