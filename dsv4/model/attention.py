"""V4 attention on the paged hybrid cache (spec §3.6; CSA §3.7–3.8, HCA §3.7).

Per token: a low-rank query with per-head RMS renorm and RoPE on the tail; one shared KV head
(K = V) from ``kv_norm(wkv(x))``.  The token attends to two sources in one softmax with a
per-head sink: the raw KV of the last ``window_size`` positions of its request (this step's
rows + the slot's window ring) and, on compressed layers, compressed entries from the paged
pool (all visible entries for HCA, the indexer's top-k for CSA).  The output tail is rotated
back by the query position, then goes through the grouped low-rank output projection.

V4.1 (spec §4.2–4.5) has no per-head q renorm and FP8-quantizes the whole window KV; its
compressed layers take one of three roles (``cfg.attn_mode``):

* ``full`` (KV source): own compressor v2 -> pre-RoPE latent -> own index keys; the latent is
  rotated at j·r, FP4-quantized and stored in its own pool; own indexer v2 picks the top-k;
* ``reindex``: own indexer queries scored against the latest KV source's keys, restricted to the
  candidate source's blocks;
* ``reuse``: the latest KV source's pool with the latest index source's top-k, verbatim.

What a layer publishes for later layers of the same step (top-k, candidates) lives in the step's
``ctx.memo``; the pools are found by source layer through the cache.

Record caches (kv_cache_dtype "fp8", ``dsv4.cache.formats``): rows are packed on write
(``encode_rows``, as the ops ``encode_records`` / ``write_records``), which rounds exactly as
the official fake quant of that site, so the fake quant is skipped there; the ops get the pools
as ``PackedRows`` (``rows_view``) and dequantize only the rows they gather.  At prefill that
decodes a record once per token attending to it (and per head block of the kernel), so a
prefill / mixed step dequantizes each record source once per layer instead, into q's dtype, and
hands the op those dense rows with the indices re-mapped (:func:`dense_prefill_pays` says when;
the values are the same, exact in bf16, so the output is the same bit for bit).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dsv4.cache.formats import PackedRows, RecordFormat, rows_view
from dsv4.cache.tensors import HybridCache, compressor_specs
from dsv4.config import ModelConfig
from dsv4.dist.parallel import SINGLE, Parallel
from dsv4.model.compressor import Compressor, CompressorV2, entry_pool_rows, write_entries
from dsv4.model.context import StepContext, ints_to_device
from dsv4.model.indexer import TOPK_MEMO, Indexer, IndexerV2, token_key_rows, visible_entries
from dsv4.model.layers import (Linear, RMSNorm, check_numerics, exact_fp8_copy, fused_linears,
                               rope_cos_sin, rope_params)
from dsv4.model.v41 import quant_compressed_latent, quant_window_kv
from dsv4.ops.streams import (branch_lane, branch_mark, join_branch_lane, join_side_lane,
                              side_lane)

__all__ = ["Attention", "PreworkFormats", "window_plan", "dense_prefill_pays",
           "DENSE_PREFILL_MIN_TOKENS"]

# V4 official numerics: FP8 fake quant of the window KV's nope channels, per 64 (spec §3.6.2).
_WINDOW_NOPE_FP8_BLOCK = 64

# wo_a through the FP8 GEMV (dsv4.ops.fp8_grouped_linear) at this many tokens or fewer; more
# read the bf16 weight (cuBLAS), as the GEMV serves 1-2 rows (triton_dense.GEMV_GROUPED_MAX_M).
WO_A_GEMV_MAX_ROWS = 2

# 1: in V4 window-only and HCA layers the window branch (kv_norm + RoPE, the ring write) runs on
# the side lane, next to q's wq_b GEMV and head norm, where the main stream is the attention's
# critical path (a CSA layer's side lane carries the indexer, which is longer: there it stays on
# the main stream).  H200, 4 layers, B=1 (docs/PERFORMANCE.md, fourteenth session): 900.7 against
# 910.1 µs, the same bits.  DSV4_KV_ON_SIDE_LANE=0 turns it off at import.
KV_ON_SIDE_LANE = int(os.environ.get("DSV4_KV_ON_SIDE_LANE", "1"))

# 1: in V4 CSA layers the index keys are compressed on the branch lane (before the attention's
# compressor) while the side lane computes the indexer's queries, which then wait for the keys
# alone (streams.branch_mark); 0: the keys first on the side lane.  H200, 4 layers, B=1
# (docs/PERFORMANCE.md, fourteenth session, run B): the CSA layer 209 -> 185 µs, the same bits.
INDEX_KEYS_ON_BRANCH = int(os.environ.get("DSV4_INDEX_KEYS_ON_BRANCH", "1"))

# Record sources are dequantized whole (once per layer) in steps of at least this many tokens
# whose dense copy holds at most ROWS_PER_TOKEN·T + SLACK rows (see dense_prefill_pays).
DENSE_PREFILL_MIN_TOKENS = 64
DENSE_PREFILL_ROWS_PER_TOKEN = 4
DENSE_PREFILL_SLACK_ROWS = 4096
# ctx.memo key of the dense copy of a compressed pool: ((pool's layer, dtype), rows).
_DENSE_ENTRIES_MEMO = "dense_entries"


def dense_prefill_pays(ctx: StepContext, fmt: RecordFormat | None, *, window: int = 0,
                       ratio: int = 0) -> bool:
    """Whether this step reads a record source through a dense copy dequantized once per layer
    (the window source of ``window`` rows per slot, or the compressed entries of ``ratio``).

    The op dequantizes the records it gathers, again for every token (and head block) that
    gathers them: fine at decode, 2.6× the bf16 time at prefill (H200, T = 1K–4K).  A dense
    copy costs one pass over its rows, so it pays when the step is a prefill / mixed one (not a
    static or decode-only step: those keep fixed shapes and few gathers) of at least
    ``DENSE_PREFILL_MIN_TOKENS`` tokens and the copy is not much bigger than the step: at most
    ``DENSE_PREFILL_ROWS_PER_TOKEN·T + DENSE_PREFILL_SLACK_ROWS`` rows (R·W + T for the window,
    R·L for the entries, L = max end_pos // ratio), which keeps a prefill chunk among many long
    decode requests on the records, and the copy's memory bounded.  Host values only.
    """
    if fmt is None or ctx.static is not None or ctx.is_decode:
        return False
    T, R = ctx.num_tokens, ctx.num_requests
    if T < DENSE_PREFILL_MIN_TOKENS:
        return False
    if ratio > 0:
        rows = R * max(e // ratio for e in ctx.end_pos_host)
    else:
        rows = R * window + T
    return 0 < rows <= DENSE_PREFILL_ROWS_PER_TOKEN * T + DENSE_PREFILL_SLACK_ROWS


def window_plan(ctx: StepContext, window: int, decode_in_ring: bool) -> dict[str, Tensor]:
    """Indices of the window source of one step, shared by every layer (memoized).

    Workspace mode (``decode_in_ring`` False): the source is ``cat(ring rows of each request's
    slot [R·W], this step's rows [T])`` and ``idx`` [T, Ka] points into it.  Ring mode (a
    decode-only step): this step's rows are written into the ring first and ``idx`` points
    straight into the flat ring [num_slots·W].  Either way token t at position p sees positions
    ``max(0, p−W+1) .. p`` in ascending order, −1 after them.
    Also returns ``ring_rows`` / ``ring_tokens``: where to store the newest W rows per request.
    """
    key = ("window", window, decode_in_ring)
    if key in ctx.memo:
        return ctx.memo[key]
    if ctx.static is not None:
        ctx.memo[key] = _static_window_plan(ctx, window)
        return ctx.memo[key]
    W, dev = window, ctx.device
    req = ctx.request_of_token
    pos = ctx.positions
    p0 = ctx.start_pos[req]
    slot = ctx.slots[req]
    # Ring mode reads W columns whatever the positions: the static-shape step's width, so both
    # give the same bits (trailing masked columns are free, see ops.torch_attn._COL_PAD).
    Ka = W if decode_in_ring else min(W, max(ctx.end_pos_host))
    count = torch.clamp(pos + 1, max=W)                                   # visible window rows
    k = torch.arange(Ka, device=dev)
    wpos = pos[:, None] - count[:, None] + 1 + k[None, :]                 # [T, Ka] ascending
    valid = k[None, :] < count[:, None]
    ring_row = slot[:, None] * W + wpos % W
    if decode_in_ring:
        idx = ring_row
    else:
        R = ctx.num_requests
        step_row = R * W + ctx.cu_seqlens[req][:, None] + (wpos - p0[:, None])
        idx = torch.where(wpos >= p0[:, None], step_row, req[:, None] * W + wpos % W)
    idx = torch.where(valid, idx, -1).to(torch.int32)
    # The newest W tokens of each request (the last min(n, W) of its rows), from the host
    # lists: a device mask and nonzero would synchronize.
    cu = ctx.cu_seqlens_host
    ring_tokens = ints_to_device([np.concatenate(
        [np.arange(cu[r + 1] - min(n, W), cu[r + 1]) for r, n in enumerate(ctx.seqlens_host)])],
        dev)[0]
    plan = {"idx": idx, "ring_tokens": ring_tokens,
            "ring_rows": (slot * W + pos % W).index_select(0, ring_tokens)}
    ctx.memo[key] = plan
    return plan


def _static_window_plan(ctx: StepContext, window: int) -> dict[str, Tensor]:
    """:func:`window_plan` of a static-shape decode step: ring mode, ``Ka = window`` columns,
    every token written (each is its request's newest), all from device tensors."""
    W = window
    pos, slot = ctx.positions, ctx.slots                 # one token per request: row t = request t
    # Visible positions max(0, p−W+1) + k for k = 0.., valid while <= p.
    wpos = (pos - (W - 1)).clamp_(min=0)[:, None] + torch.arange(W, device=ctx.device)
    base = slot * W
    idx = (wpos % W + base[:, None]).masked_fill_(wpos > pos[:, None], -1)
    return {"idx": idx.to(torch.int32), "ring_tokens": ctx.request_of_token,
            "ring_rows": base + pos % W}


def _token_entry_rows(ctx: StepContext, ratio: int, page_size: int,
                      dense: bool = False) -> Tensor:
    """[T, L] pool rows of each token's request's entries (:func:`entry_pool_rows` per token),
    or with ``dense`` their rows in the step's dense copy (:func:`_dense_entry_rows`).
    A static-shape step's token t is request t: no gather."""
    if not dense:
        return token_key_rows(ctx, ratio, page_size)
    rows = _dense_entry_rows(ctx, ratio, page_size)
    return rows if ctx.static is not None else rows[ctx.request_of_token]


def _picked_rows(ctx: StepContext, ratio: int, page_size: int, ids: Tensor,
                 ops: SimpleNamespace, dense: bool = False) -> Tensor:
    """[T, k] int32 pool rows (``dense``: dense-copy rows) of the top-k entry ids ``ids``
    (−1 stays −1).

    The entry-row table gets a −1 column at index L, int32, once per step (memoized, shared by
    every layer of the ratio), and an id −1 becomes L by ``mod L+1`` (ids are < L), so a single
    gather maps picks and blanks alike (``ops.picked_rows``: one kernel on the GPU)."""
    key = ("picked_row_table", ratio, page_size, dense)
    if key not in ctx.memo:
        rows = _token_entry_rows(ctx, ratio, page_size, dense)
        blank = rows.new_full((rows.shape[0], 1), -1)
        ctx.memo[key] = torch.cat((rows, blank), dim=1).to(torch.int32)
    return ops.picked_rows(ctx.memo[key], ids)


def _visible_rows(ctx: StepContext, ratio: int, page_size: int, dense: bool = False) -> Tensor:
    """[T, L] int32 pool rows (``dense``: dense-copy rows) of every entry visible to each token,
    −1 after them (HCA; the same for every layer of the ratio: memoized per step)."""
    key = ("visible_rows", ratio, page_size, dense)
    if key not in ctx.memo:
        rows = _token_entry_rows(ctx, ratio, page_size, dense)
        if ctx.static is None:
            # Prefill / mixed: a token sees fewer entries than its request's last token.
            j = torch.arange(rows.shape[1], device=rows.device)
            rows = rows.masked_fill(j[None, :] >= visible_entries(ctx, ratio)[:, None], -1)
        # Static decode: token t is its request's last token, and entry_pool_rows holds −1
        # past its (pos + 1) // r entries already.
        ctx.memo[key] = rows.to(torch.int32)
    return ctx.memo[key]


def _dense_entry_rows(ctx: StepContext, ratio: int, page_size: int) -> Tensor:
    """[R, L] rows of each request's entries in the dense copy of :func:`_dense_entries`:
    request r's entry j is row ``r·L + j``; −1 where :func:`entry_pool_rows` has none (so the
    blanks are those of the pool rows, and the op sees the same mask)."""
    rows = entry_pool_rows(ctx, ratio, page_size)
    local = torch.arange(rows.numel(), device=rows.device).view(rows.shape)
    return torch.where(rows >= 0, local, -1)


def _dense_entries(ops: SimpleNamespace, ctx: StepContext, pool: Tensor, fmt: RecordFormat,
                   ratio: int, page_size: int, dtype: torch.dtype) -> Tensor:
    """[R·L, d] the entries of the step's requests in the record pool ``pool``, dequantized to
    ``dtype`` (exact; ``ops.read_records``), row ``r·L + j`` = request r's entry j
    (:func:`_dense_entry_rows`); rows of missing entries hold pool row 0 and are never
    referenced."""
    rows = entry_pool_rows(ctx, ratio, page_size).clamp(min=0).view(-1)
    return ops.read_records(pool.view(-1, pool.shape[-1]), rows, fmt, dtype)


def _made(pre: dict[str, Tensor] | None, *names: str) -> tuple[Tensor, ...] | None:
    """The outputs ``names`` of :meth:`Attention.prework`, if it ran (else None: made here)."""
    return None if pre is None else tuple(pre[n] for n in names)


@dataclass(frozen=True)
class PreworkFormats:
    """What :meth:`Attention.prework` needs to know of the cache: the window rings' record
    format and element type, and the index-key pools' format."""

    window: RecordFormat | None
    window_dtype: torch.dtype
    index_keys: RecordFormat | None

    @classmethod
    def of(cls, cache: HybridCache) -> "PreworkFormats":
        return cls(cache.window_format,
                   torch.uint8 if cache.window_format is not None else cache.dtype,
                   cache.index_key_format)


class Attention(nn.Module):
    """One attention layer; parameter paths equal the official names under ``attn.``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str = "bf16",
                 ops: SimpleNamespace | None = None, dtype: torch.dtype = torch.bfloat16,
                 parallel: Parallel | None = None) -> None:
        super().__init__()
        if ops is None:
            from dsv4.ops import get_ops
            ops = get_ops("torch")
        self.cfg = cfg
        self.layer_id = layer_id
        self.numerics = check_numerics(numerics)
        self.ops = ops
        self.dtype = dtype
        self.mode = cfg.attn_mode(layer_id)
        self.ratio = cfg.ratio(layer_id)
        # Tensor parallel: this rank's query heads and output groups (all of them on one
        # process); wo_b's partial outputs are summed over the ranks (dsv4.dist.sharding).
        self.parallel = parallel or SINGLE
        h_lo, h_hi = self.parallel.split(cfg.n_heads, "num_attention_heads")
        g_lo, g_hi = self.parallel.split(cfg.o_groups, "o_groups")
        self.n_heads = H = h_hi - h_lo
        self.head_dim = hd = cfg.head_dim
        self.rope_dim = cfg.rope_head_dim
        self.window = cfg.window_size
        self.n_groups = g_hi - g_lo
        self.o_lora = cfg.o_lora_rank
        self.scale = hd ** -0.5
        qfmt = "fp8" if cfg.quantized else "bf16"
        lin = dict(block=cfg.weight_block_size, numerics=numerics, dtype=dtype)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, fmt=qfmt, **lin)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, ops)
        self.wq_b = Linear(cfg.q_lora_rank, H * hd, fmt=qfmt, **lin)
        self.wkv = Linear(cfg.dim, hd, fmt=qfmt, **lin)
        self.kv_norm = RMSNorm(hd, cfg.norm_eps, ops)
        # wo_a is dequantized by the loader (spec §2.4 item 1): a dense GEMM, no act quant.
        # (Kept FP8 with a grouped kernel dequantizing in registers it measured slower at 16+
        # rows and only 7% faster at one: docs/PERFORMANCE.md, seventh session.  At 1-2 tokens
        # on the GPU its exact FP8 form runs the CUDA-core GEMV: _wo_a.)
        self.wo_a = Linear(cfg.n_heads * hd // cfg.o_groups, self.n_groups * self.o_lora,
                           fmt="bf16", **lin)
        self.wo_b = Linear(self.n_groups * self.o_lora, cfg.dim, fmt=qfmt, **lin)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)
        self.compressor: Compressor | CompressorV2 | None = None
        self.indexer: Indexer | IndexerV2 | None = None
        if cfg.is_v41:
            self._init_v41_roles(cfg, layer_id, numerics, ops, dtype)
            return
        for spec in compressor_specs(cfg, layer_id):
            if spec.name == "attn":
                self.compressor = Compressor(cfg, layer_id, spec, numerics, ops, dtype)
        if cfg.has_indexer(layer_id):
            self.indexer = Indexer(cfg, layer_id, numerics, ops, dtype)

    def _init_v41_roles(self, cfg: ModelConfig, layer_id: int, numerics: str,
                        ops: SimpleNamespace, dtype: torch.dtype) -> None:
        """V4.1: compressor on KV sources, indexer v2 on index sources; checks the sources."""
        self.topk_source = -1
        if self.ratio == 0:
            return
        # A published top-k holds entry ids of the source's pool: a source of another ratio
        # would number its entries differently.
        for what, src in (("KV source", cfg.kv_source_of(layer_id)),
                          ("index source", cfg.index_source_of(layer_id))):
            if src < 0 or cfg.ratio(src) != self.ratio:
                raise ValueError(f"Attention(layer {layer_id}): needs a {what} of ratio "
                                 f"{self.ratio} at or before it; found layer {src}")
        if self.mode == "full":
            self.compressor = CompressorV2(cfg, layer_id, numerics, ops, dtype)
        if self.mode in ("full", "reindex"):
            self.indexer = IndexerV2(cfg, layer_id, numerics, ops, dtype)
        self.topk_source = cfg.index_source_of(layer_id)

    # ------------------------------------------------------------------ helpers
    def _rope(self, ctx: StepContext) -> tuple[Tensor, Tensor]:
        """cos/sin of this layer's table at the step's positions (shared by same-table layers)."""
        key = ("rope",) + rope_params(self.cfg, self.layer_id)
        if key not in ctx.memo:
            ctx.memo[key] = rope_cos_sin(self.cfg, self.layer_id, ctx.positions)
        return ctx.memo[key]

    def _window_branch(self, kv_lat: Tensor, ctx: StepContext, cache: HybridCache, cos: Tensor,
                       sin: Tensor, dtype: torch.dtype, pre: dict[str, Tensor] | None = None
                       ) -> tuple[Tensor | PackedRows, Tensor]:
        """kv = kv_norm(kv_lat) with RoPE on its tail (spec §3.6), stored into the window ring:
        (kv_a, idx_a) of :meth:`_window_source`.  ``pre``: :meth:`prework`'s outputs."""
        if pre is not None:
            return self._window_source(pre["window_kv"], ctx, cache, dtype, pre["window_rows"])
        kv = self._window_kv(kv_lat, cos, sin, cache.window_format)
        return self._window_source(kv, ctx, cache, dtype)

    def _window_kv(self, kv_lat: Tensor, cos: Tensor, sin: Tensor, fmt: RecordFormat | None
                   ) -> Tensor:
        """The window kv of this step's tokens for a ring of record format ``fmt``."""
        # Record rings quantize on write exactly as the fake quant would: only tensor rings in
        # official numerics fake-quantize here (V4: the nope channels per 64, fused; V4.1: all
        # channels per 32).
        fake_quant = fmt is None and self.numerics == "official"
        kv = self.ops.norm_rope(kv_lat, self.kv_norm.weight, cos, sin, self.kv_norm.eps,
                                fp8_block=_WINDOW_NOPE_FP8_BLOCK
                                if fake_quant and not self.cfg.is_v41 else 0)
        if fake_quant and self.cfg.is_v41:
            kv = quant_window_kv(kv, self.numerics)
        return kv

    def _window_source(self, kv: Tensor, ctx: StepContext, cache: HybridCache,
                       dtype: torch.dtype, new_rows: Tensor | None = None
                       ) -> tuple[Tensor | PackedRows, Tensor]:
        """(kv_a, idx_a) of the window branch; stores the newest W rows into the ring.

        With record pools this step's rows are packed once and read back through the same
        records as the ring's, so prefill and decode see the same values; when
        :func:`dense_prefill_pays`, the step's source (ring rows + new rows) is dequantized once
        into ``dtype`` and the op reads those rows (same indices).  ``new_rows``: kv encoded
        for the ring already (:meth:`prework`)."""
        ring = cache.window_ring(self.layer_id)
        fmt = cache.window_format
        width = ring.shape[-1]
        flat = ring.view(-1, width)
        decode = ctx.is_decode
        plan = window_plan(ctx, self.window, decode)
        if decode:
            # One token per request: encode + write first (one fused op), then attend straight
            # to the ring.
            self.ops.write_records(flat, plan["ring_rows"], kv, plan["ring_tokens"], fmt)
            return rows_view(flat, fmt), plan["idx"]
        if new_rows is None:
            new_rows = self.ops.encode_records(kv, fmt, ring.dtype)
        source = torch.cat((ring[ctx.slots].view(-1, width), new_rows), dim=0)
        flat.index_copy_(0, plan["ring_rows"], new_rows[plan["ring_tokens"]])
        if dense_prefill_pays(ctx, fmt, window=self.window):
            return self.ops.read_records(source, None, fmt, dtype), plan["idx"]
        return rows_view(source, fmt), plan["idx"]

    def _entry_source(self, ctx: StepContext, cache: HybridCache, dtype: torch.dtype
                      ) -> tuple[Tensor | PackedRows, bool]:
        """The compressed entries this layer reads (after this step's writes) and whether they
        are a dense copy (its indices are :func:`_dense_entry_rows`, not pool rows).

        The flat pool (records as ``PackedRows``), or when :func:`dense_prefill_pays` the step's
        requests' entries dequantized once into ``dtype``; the copy is kept for the layers
        that read the same pool next (V4.1 reuse / reindex layers), one copy at a time."""
        pool = cache.compressed_pool(self.layer_id)
        fmt = cache.compressed_format
        if not dense_prefill_pays(ctx, fmt, ratio=self.ratio):
            return rows_view(pool.view(-1, pool.shape[-1]), fmt), False
        owner = (self.cfg.kv_source_of(self.layer_id) if self.cfg.is_v41 else self.layer_id,
                 dtype)
        held = ctx.memo.get(_DENSE_ENTRIES_MEMO)
        if held is None or held[0] != owner:
            held = (owner, _dense_entries(self.ops, ctx, pool, fmt, self.ratio,
                                          cache.page_size, dtype))
            ctx.memo[_DENSE_ENTRIES_MEMO] = held
        return held[1], True

    def _compressed_source(self, x: Tensor, qr: Tensor, ctx: StepContext, cache: HybridCache,
                           cos: Tensor, sin: Tensor, dtype: torch.dtype,
                           pre: dict[str, Tensor] | None = None
                           ) -> tuple[Tensor | PackedRows, Tensor]:
        """(kv_b, idx_b): the compressed entries (:meth:`_entry_source`) and the rows of them
        each token attends to.  ``pre``: :meth:`prework`'s outputs (V4)."""
        if self.cfg.is_v41:
            return self._compressed_source_v41(x, qr, ctx, cache, cos, sin, dtype, pre)
        pool = cache.compressed_pool(self.layer_id)
        fmt = cache.compressed_format
        ids = None
        keys_written = None
        if self.indexer is not None:
            # The step's shared plans first (ctx.memo), on this lane.  Then the index keys —
            # here, or with INDEX_KEYS_ON_BRANCH on the branch lane, where the queries wait for
            # them alone before the scoring — and the attention's compressor on a branch of
            # this lane next to the indexer (dsv4.ops.streams).
            self.indexer.prepare(ctx, cache)
            if not INDEX_KEYS_ON_BRANCH:
                self.indexer.write_keys(x, ctx, cache, _made(pre, "index_kv", "index_score"))
        # (Without an indexer, as in HCA layers, nothing would run beside it: no branch.)
        with (branch_lane(x.device, x.shape[0]) if self.indexer is not None
              else contextlib.nullcontext()):
            if self.indexer is not None and INDEX_KEYS_ON_BRANCH:
                self.indexer.write_keys(x, ctx, cache, _made(pre, "index_kv", "index_score"))
                keys_written = branch_mark(x.device)
            if self.compressor is not None:
                self.compressor(x, ctx, cache.compressor_state(self.layer_id, "attn"), pool,
                                fmt, rows=_made(pre, "attn_kv", "attn_score"))
        if self.indexer is not None:
            ids = self.indexer.pick(x, qr, ctx, cache, cos, sin, keys_written,  # [T, k]
                                    queries=_made(pre, "index_q", "index_w"))
        join_branch_lane(x.device)
        kv_b, dense = self._entry_source(ctx, cache, dtype)
        if ids is not None:
            idx_b = _picked_rows(ctx, self.ratio, cache.page_size, ids, self.ops, dense)
        else:
            idx_b = _visible_rows(ctx, self.ratio, cache.page_size, dense)
        return kv_b, idx_b

    def _compressed_source_v41(self, x: Tensor, qr: Tensor, ctx: StepContext,
                               cache: HybridCache, cos: Tensor, sin: Tensor, dtype: torch.dtype,
                               pre: dict[str, Tensor] | None = None
                               ) -> tuple[Tensor | PackedRows, Tensor]:
        """V4.1 roles: (kv_b, idx_b) over the latest KV source's pool (spec §4.3–4.5).
        ``pre``: :meth:`prework`'s outputs."""
        pool = cache.compressed_pool(self.layer_id)
        fmt = cache.compressed_format
        if isinstance(self.compressor, CompressorV2):
            state = (cache.compressor_state(self.layer_id, "attn")
                     if self.compressor.spec is not None else None)
            rows = (_made(pre, "attn_latent") if self.compressor.spec is None
                    else _made(pre, "attn_kv", "attn_score"))
            plan, latent = self.compressor(x, ctx, state, rows)
            if plan.num_entries:
                cos_e, sin_e = rope_cos_sin(self.cfg, self.layer_id, plan.entry * self.ratio)
                # Keys come from the latent before its rotation (spec §4.3 (a)).  Record pools
                # quantize on write exactly as the fake quant would: skip it then.
                key_fmt = cache.index_key_format
                keys = self.indexer.keys_from_latent(  # type: ignore[union-attr]
                    latent, cos_e, sin_e, quantize=key_fmt is None)
                write_entries(cache.index_key_pool(self.layer_id), ctx, plan, keys, key_fmt,
                              ops=self.ops)
                entries = self.ops.apply_rope(latent, cos_e, sin_e)
                if fmt is None:
                    entries = quant_compressed_latent(entries, self.numerics)
                write_entries(pool, ctx, plan, entries, fmt, ops=self.ops)
        if self.indexer is not None:
            ids = self.indexer(x, qr, ctx, cache, cos, sin, _made(pre, "index_q", "index_w"))
        else:
            key = (TOPK_MEMO, self.topk_source)
            if key not in ctx.memo:
                raise ValueError(f"Attention(layer {self.layer_id}): reuses the top-k of layer "
                                 f"{self.topk_source}, which has not run in this step")
            ids = ctx.memo[key]
        kv_b, dense = self._entry_source(ctx, cache, dtype)
        return kv_b, _picked_rows(ctx, self.ratio, cache.page_size, ids, self.ops, dense)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, ctx: StepContext, cache: HybridCache) -> Tensor:
        """x [T, D] (the normalized block input) -> [T, D]."""
        T = x.shape[0]
        self._check_step(x, ctx, cache)
        cos, sin = self._rope(ctx)

        q_lat, kv_lat, qr = self._latents(x)
        kv_b = idx_b = kv_a = idx_a = None
        overlap = self.ratio > 0 and not self.cfg.is_v41
        window_on_side = bool(KV_ON_SIDE_LANE) and not self.cfg.is_v41 and self.indexer is None
        if overlap or window_on_side:
            # V4: the compressed branch (compressor, indexer, picked rows) reads only x, qr and
            # its own pools, the window branch only kv_lat and its ring; on the GPU they run on
            # a side stream next to wq_b (dsv4.ops.streams), joined before the attention reads
            # their outputs.  (q's dtype is x's: wq_b keeps its input's.)
            with side_lane(x.device, T):
                if overlap:
                    kv_b, idx_b = self._compressed_source(x, qr, ctx, cache, cos, sin, x.dtype)
                if window_on_side:
                    kv_a, idx_a = self._window_branch(kv_lat, ctx, cache, cos, sin, x.dtype)
        q = self._queries(qr, cos, sin)
        if not window_on_side:
            kv_a, idx_a = self._window_branch(kv_lat, ctx, cache, cos, sin, q.dtype)
        if overlap or window_on_side:
            join_side_lane(x.device)
        elif self.ratio > 0:
            kv_b, idx_b = self._compressed_source(x, qr, ctx, cache, cos, sin, q.dtype)
        # The output's inverse RoPE inside the attention op (the GPU merges it into the
        # split-KV combine at decode: one launch less a layer).
        o = self._sparse_attn(q, kv_a, idx_a, kv_b, idx_b, kv_lat.dtype, rope_out=(cos, sin))
        return self._output(o, cos, sin, x.dtype, rotated=True)

    # ------------------------------------------------------------------ the step in three parts
    # A piecewise step (dsv4/engine/prefill_graphs.py) runs the token-local parts — ``project``
    # and ``output`` — inside CUDA graphs of bucketed token counts and ``attend``, the part
    # that reads and writes the caches, eagerly between them.  ``forward`` runs the same ops.
    def project(self, x: Tensor, ctx: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Token-local first part: x [T, D] -> (q [T, H, hd] normed and rotated, qr [T, q_lora],
        kv_lat [T, hd]).  ``ctx`` needs only ``positions`` and ``memo``."""
        cos, sin = self._rope(ctx)
        _, kv_lat, qr = self._latents(x)
        return self._queries(qr, cos, sin), qr, kv_lat

    def prework(self, x: Tensor, qr: Tensor, kv_lat: Tensor, ctx: Any,
                formats: PreworkFormats) -> dict[str, Tensor]:
        """The token-local inputs of :meth:`attend`, made ahead (in a piecewise step's graph):
        the window kv (normed, rotated) and its rows encoded for the ring; the compressors' fp32
        rows (V4.1 ratio 1: the finished latents) and the indexer's queries and head weights.
        ``formats``: the cache's (:meth:`PreworkFormats.of`), which some of them depend on.
        Same ops and values as :meth:`attend` computes without them."""
        cos, sin = self._rope(ctx)
        kv = self._window_kv(kv_lat, cos, sin, formats.window)
        pre = {"window_kv": kv,
               "window_rows": self.ops.encode_records(kv, formats.window, formats.window_dtype)}
        if self.ratio == 0:
            return pre
        if self.cfg.is_v41:
            if isinstance(self.compressor, CompressorV2):
                rows = self.compressor.rows(x)
                names = ("attn_latent",) if len(rows) == 1 else ("attn_kv", "attn_score")
                pre.update(zip(names, rows))
            if self.indexer is not None:   # no Hadamard in V4.1
                pre["index_q"], pre["index_w"] = self.indexer.queries(x, qr, cos, sin,
                                                                      hadamard=False)
            return pre
        if self.compressor is not None:
            pre["attn_kv"], pre["attn_score"] = self.compressor.rows(x, ctx)
        if self.indexer is not None:
            pre["index_kv"], pre["index_score"] = self.indexer.compressor.rows(x, ctx)
            pre["index_q"], pre["index_w"] = self.indexer.queries(
                x, qr, cos, sin, hadamard=self.indexer.rotates(formats.index_keys))
        return pre

    def attend(self, x: Tensor, q: Tensor, qr: Tensor, kv_lat: Tensor, ctx: StepContext,
               cache: HybridCache, pre: dict[str, Tensor] | None = None) -> Tensor:
        """The cache part of :meth:`project`'s outputs: writes this step's window rows,
        compressed entries and index keys, and returns the attention output o [T, H, hd]
        (before the inverse RoPE of :meth:`output`).  Runs in stream order (no side lanes).
        ``pre``: :meth:`prework`'s outputs for this cache's formats (None: made here)."""
        self._check_step(x, ctx, cache)
        cos, sin = self._rope(ctx)
        kv_b = idx_b = None
        if self.ratio > 0:
            kv_b, idx_b = self._compressed_source(x, qr, ctx, cache, cos, sin, q.dtype, pre)
        kv_a, idx_a = self._window_branch(kv_lat, ctx, cache, cos, sin, q.dtype, pre)
        return self._sparse_attn(q, kv_a, idx_a, kv_b, idx_b, kv_lat.dtype)

    def output(self, o: Tensor, ctx: Any, dtype: torch.dtype) -> Tensor:
        """Token-local last part: o [T, H, hd] -> [T, D] in ``dtype`` (the block input's)."""
        cos, sin = self._rope(ctx)
        return self._output(o, cos, sin, dtype)

    def _check_step(self, x: Tensor, ctx: StepContext, cache: HybridCache) -> None:
        if x.shape[0] != ctx.num_tokens:
            raise ValueError(f"Attention(layer {self.layer_id}): x has {x.shape[0]} rows; the "
                             f"step has {ctx.num_tokens} tokens")
        if "checked" not in ctx.memo:
            cache.check_step(ctx.seqlens_host, ctx.start_pos_host, ctx.slots_host,
                             ctx.block_tables_host)
            ctx.memo["checked"] = True

    def _latents(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(q_lat, kv_lat, qr = q_norm(q_lat)): wq_a and wkv read the same x, one FP8 GEMM on
        the GPU (column slices of its output)."""
        q_lat, kv_lat = fused_linears(x, (self.wq_a, self.wkv))
        return q_lat, kv_lat, self.q_norm(q_lat)

    def _queries(self, qr: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """q [T, H, hd]: wq_b, then (V4) the per-head unweighted renorm in q's dtype (V4.1 has
        none) and RoPE of each head's tail — one fused op, in place on wq_b's fresh output."""
        T = qr.shape[0]
        return self.ops.head_norm_rope(self.wq_b(qr).view(T, self.n_heads, self.head_dim),
                                       cos, sin, self.cfg.norm_eps, renorm=not self.cfg.is_v41,
                                       inplace=True)

    def _sparse_attn(self, q: Tensor, kv_a: Tensor | PackedRows, idx_a: Tensor,
                     kv_b: Tensor | PackedRows | None, idx_b: Tensor | None,
                     p_dtype: torch.dtype, rope_out: tuple[Tensor, Tensor] | None = None
                     ) -> Tensor:
        """o [T, H, hd]; with ``rope_out`` (cos, sin) its tail rotated back already."""
        kw: dict[str, Any] = {} if rope_out is None else {"rope_out": rope_out}
        if self.numerics == "official":
            # bf16 P before P·V, as the reference kernel (spec §3.6.5)
            kw["p_dtype"] = p_dtype
        return self.ops.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, self.attn_sink, self.scale,
                                    **kw)

    def _output(self, o: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype,
                rotated: bool = False) -> Tensor:
        """Inverse RoPE (unless ``rotated``: the attention op did it), then the grouped
        low-rank output: group g = heads g·H/G .. (g+1)·H/G − 1, head-major."""
        T = o.shape[0]
        if not rotated:
            # (A new tensor: under the prefill graphs o is a persistent input buffer.)
            o = self.ops.apply_rope(o, cos, sin, inverse=True)
        G = self.n_groups
        u = self._wo_a(o.reshape(T, G, -1))
        return self.parallel.all_reduce(self.wo_b(u.reshape(T, G * self.o_lora).to(dtype)))

    def _wo_a_gemv_on(self, device: torch.device) -> bool:
        return (device.type == "cuda"
                and self.ops.fp8_grouped_linear.__module__ == "dsv4.ops.triton_dense")

    def prepare_decode_weights(self) -> int:
        """Make the decode-only weight forms now (wo_a's exact FP8 copy for the 1-2-token
        GEMV), so that the engine's memory sizing sees them; returns their bytes."""
        if not self._wo_a_gemv_on(self.wo_a.weight.device):
            return 0
        fp8 = exact_fp8_copy(self.wo_a)
        return 0 if fp8 is None else sum(t.numel() * t.element_size() for t in fp8)

    def _wo_a(self, o: Tensor) -> Tensor:
        """o [T, G, K] -> [T, G, o_lora] in wo_a's dtype.  At 1-2 tokens on the GPU the FP8
        GEMV reads the weight's exact FP8 form (:func:`exact_fp8_copy`: half of bf16's bytes,
        the same products); otherwise the bf16 weight (the reference's dense GEMM)."""
        w = self.wo_a.weight
        if o.shape[0] <= WO_A_GEMV_MAX_ROWS and self._wo_a_gemv_on(o.device):
            fp8 = exact_fp8_copy(self.wo_a)
            if fp8 is not None:
                return self.ops.fp8_grouped_linear(o.to(w.dtype), fp8[0], fp8[1],
                                                   self.wo_a.block, w.dtype)
        wo_a = w.view(self.n_groups, self.o_lora, -1)
        # One batched GEMM over the groups, written straight into [T, G, o_lora] (the
        # batch-major result of einsum("tgd,grd->tgr") would be copied by wo_b's reshape:
        # 128 MiB at 8K tokens).
        u = torch.empty(o.shape[0], self.n_groups, self.o_lora, dtype=wo_a.dtype,
                        device=o.device)
        torch.bmm(o.to(wo_a.dtype).transpose(0, 1), wo_a.transpose(1, 2), out=u.transpose(0, 1))
        return u
