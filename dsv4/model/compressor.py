"""The compressor (spec §3.7) and its carry-over state, over a batch of requests.

Every token gives fp32 rows ``kv = wkv(x)`` and ``score = wgate(x) + ape[pos % r]``.  Entry j of
a request pools group j (positions ``j·r .. j·r + r − 1``) with a per-channel softmax over its
slots; the overlapping ratio-4 compressor pools 2r slots: the previous group's first ``d``
channels and the current group's last ``d`` channels.  An entry is produced in the step that
brings its last token; rows of groups that are still open (and, with overlap, the last complete
group) are kept in the slot's state for the next step (V4's C128 keeps their one-pseudo-row
summary instead, the compact form: dsv4/ops/torch_compress.py; this module only passes the
state tensors to the ops, whichever form the cache holds).

Each entry is computed from exactly the same rows in the same order whatever the split of the
sequence into steps, so chunked prefill and decode give the entries of a one-shot prefill.
The whole batch is handled at once: a row of a group is located either among this step's tokens
or in the request's state and read from there.  The forward runs two ops per compressor and step
(``dsv4/ops/torch_compress.py`` documents them; Triton kernels in ``triton_compress.py``):
``compress_entries`` (pooling, cast, norm, RoPE of every completed entry) and
``compress_update_state`` (the carry-over rows).  Both add the position bias themselves: the
forward hands them ``ape`` and the unbiased ``wgate(x)`` rows (the same bits as adding it here,
two launches fewer per call), unless the op table says its kernels do not fuse it yet
(``ops.compress_entries.ape_fused()`` False: dsv4.ops.triton_compress.APE_FUSED_VERIFIED); the
plain-torch :func:`pool_entries` path adds it in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dsv4.cache.formats import RecordFormat, encode_rows
from dsv4.cache.tensors import CompressorSpec, CompressorState
from dsv4.config import ModelConfig
from dsv4.model.context import StepContext, ints_to_device
from dsv4.model.layers import (Linear, RMSNorm, check_numerics, fp32_math_dtype, rope_cos_sin,
                               rope_params, stacked_weight)
from dsv4.ops import torch_compress

__all__ = ["Compressor", "CompressorV2", "EntryPlan", "entry_plan", "entry_pool_rows",
           "entry_write_rows", "write_entries", "pool_entries", "compress_step", "entry_rope",
           "ops_fuse_ape"]

# Gathered group rows per block of entries stay near this many fp32 elements.
_BLOCK_ELEMS = 1 << 24


@dataclass
class EntryPlan:
    """The entries that complete in one step for one ratio.

    ``request`` [E] (request index), ``entry`` [E] (entry id j in its request) and the per-request
    counts ``counts_host``.  ``start_entry_host[i]`` = first entry id request i completes.

    A static-shape step (``ctx.static``) has one candidate entry per request, ``valid`` [E]
    bool saying which complete (the host lists are empty there): the others are computed too,
    then written to the scratch page, so the step's shapes never depend on the positions.
    """

    ratio: int
    request: Tensor
    entry: Tensor
    counts_host: list[int]
    start_entry_host: list[int]
    valid: Tensor | None = None

    @property
    def num_entries(self) -> int:
        return int(self.request.shape[0])


def entry_plan(ctx: StepContext, ratio: int) -> EntryPlan:
    """Entries j with ``start_pos <= j·r + r − 1 < end_pos`` of every request (memoized)."""
    key = ("entry_plan", ratio)
    if key not in ctx.memo and ctx.static is not None:
        # Decode: request t's token at position p completes entry (p+1)/r − 1 when r | p+1,
        # i.e. floor((p+1−r)/r), when p % r == r − 1.  Token t is request t: the request ids are
        # the step's (memoized) request_of_token.
        pos = ctx.positions
        ent = torch.div(pos - (ratio - 1), ratio, rounding_mode="floor").clamp_(min=0)
        ctx.memo[key] = EntryPlan(ratio, ctx.request_of_token, ent, [], [],
                                  valid=pos % ratio == ratio - 1)
    if key not in ctx.memo:
        first = [s // ratio for s in ctx.start_pos_host]
        counts = [e // ratio - f for e, f in zip(ctx.end_pos_host, first)]
        # On the host (host lists only): no device sync, one copy.
        cnt = np.asarray(counts, dtype=np.int64)
        req = np.repeat(np.arange(len(counts)), cnt)
        offs = np.cumsum(cnt) - cnt
        ent = np.arange(req.shape[0]) - offs[req] + np.asarray(first, dtype=np.int64)[req]
        req_d, ent_d = ints_to_device([req, ent], ctx.device)
        ctx.memo[key] = EntryPlan(ratio, req_d, ent_d, counts, first)
    return ctx.memo[key]


def entry_pool_rows(ctx: StepContext, ratio: int, page_size: int) -> Tensor:
    """[R, L] int64 flat pool rows of entries 0..L−1 of each request (L = max end_pos // r);
    −1 where the request has no such entry (memoized per step)."""
    key = ("entry_rows", ratio, page_size)
    if key not in ctx.memo and ctx.static is not None:
        # Static shape: every column of the block table, L = max_pages · page_size // r.
        # Entry j exists when its last position j·r + r − 1 <= pos; a page id < 0 gives rows
        # <= −1 (page·epp + j % epp), clamped to −1.
        epp = page_size // ratio
        bt = ctx.block_tables
        R, L = bt.shape[0], bt.shape[1] * epp
        rows = ((bt * epp)[:, :, None] + torch.arange(epp, device=ctx.device)).view(R, L)
        last = torch.arange(ratio - 1, L * ratio, ratio, device=ctx.device)
        rows = rows.masked_fill_(last[None, :] > ctx.positions[:, None], -1)
        ctx.memo[key] = rows.clamp_(min=-1)
    if key not in ctx.memo:
        epp = page_size // ratio
        n_ent = [e // ratio for e in ctx.end_pos_host]
        L = max(n_ent + [0])
        j = torch.arange(L, device=ctx.device)
        pages = ctx.block_tables.gather(1, (j // epp).clamp(max=ctx.block_tables.shape[1] - 1)
                                        .expand(ctx.num_requests, L))
        rows = pages * epp + j % epp
        have = j[None, :] < ints_to_device([n_ent], ctx.device)[0][:, None]
        ctx.memo[key] = torch.where(have & (pages >= 0), rows, -1)
    return ctx.memo[key]


def entry_write_rows(ctx: StepContext, plan: EntryPlan, entries_per_page: int) -> Tensor:
    """[E] flat pool rows the plan's entries are stored at (memoized per step and ratio: the
    attention and index-key pools of a ratio, and every layer of it, share them).  In a
    static-shape step the candidates that do not complete go to the scratch page."""
    key = ("entry_write_rows", plan.ratio, entries_per_page)
    if key not in ctx.memo:
        epp = entries_per_page
        page = ctx.block_tables[plan.request, plan.entry // epp]
        if plan.valid is not None:
            page = torch.where(plan.valid, page, ctx.static.scratch_page)
        ctx.memo[key] = page * epp + plan.entry % epp
    return ctx.memo[key]


def write_entries(pool: Tensor, ctx: StepContext, plan: EntryPlan, entries: Tensor,
                  fmt: RecordFormat | None = None, ops: SimpleNamespace | None = None, *,
                  hadamard: bool = False, zeroed: bool = False) -> None:
    """Store ``entries`` [E, d] at their rows of ``pool`` [num_pages, page_size // r, d]
    (packed as ``fmt`` records when the pool holds records [.., record_bytes]); with ``ops``,
    encode and scatter are its one fused ``write_records`` op (the same bytes).

    ``hadamard``: store ``formats.hadamard_transform(entries)`` (fused into the write with
    ``ops``).  ``zeroed``: the caller guarantees that a static-shape step's candidates that do
    not complete are zeros already (``compress_entries`` makes them so).
    """
    if plan.num_entries == 0:
        return
    rows = entry_write_rows(ctx, plan, pool.shape[1])
    if plan.valid is not None and not zeroed:
        # Static shape: the scratch page gets zeros, so that nothing non-finite sits there.
        entries = torch.where(plan.valid[:, None], entries, 0.0)
    flat = pool.view(-1, pool.shape[-1])
    if ops is not None:
        if hadamard:
            ops.write_records(flat, rows, entries, None, fmt, hadamard=True)
        else:
            ops.write_records(flat, rows, entries, None, fmt)
        return
    if hadamard:
        from dsv4.formats import hadamard_transform
        entries = hadamard_transform(entries)
    flat.index_copy_(0, rows, encode_rows(entries, fmt, pool.dtype))


def entry_rope(ctx: StepContext, cfg: ModelConfig, layer_id: int, plan: EntryPlan
               ) -> tuple[Tensor, Tensor]:
    """(cos, sin) [E, rd/2] of the layer's rotation at the entries' first positions j·r
    (memoized per step: every layer with the same table and ratio shares them)."""
    key = ("entry_rope", plan.ratio, rope_params(cfg, layer_id))
    if key not in ctx.memo:
        ctx.memo[key] = rope_cos_sin(cfg, layer_id, plan.entry * plan.ratio)
    return ctx.memo[key]


def kv_score_rows(ops: SimpleNamespace, x: Tensor, wkv: Linear, wgate: Linear
                  ) -> tuple[Tensor, Tensor]:
    """fp32 ``wkv(x)`` and ``wgate(x)`` (the reference's fp32 GEMMs, no activation quant) through
    the op table's skinny GEMM; on the GPU one GEMM over the stacked weights (the outputs are
    column slices of it, which the compressor kernels read in place)."""
    w = stacked_weight(x, (wkv, wgate))
    if w is None:
        return ops.linear_fp32(x, wkv.weight), ops.linear_fp32(x, wgate.weight)
    kv, score = ops.linear_fp32(x, w).split((wkv.out_features, wgate.out_features), dim=-1)
    return kv, score


def pool_entries(ctx: StepContext, state: CompressorState, kv: Tensor, score: Tensor
                 ) -> tuple[EntryPlan, Tensor]:
    """Pool the entries that complete in this step and update the carry-over state.

    ``kv`` / ``score`` [T, coff·d] fp32 are the rows of this step's tokens (score including any
    position bias).  Returns the plan and the pooled entries [E, d] fp32 (before the norm).
    The plain-torch path (the twin's pooling); the model's forward runs the fused op instead.
    """
    spec = state.spec
    plan = entry_plan(ctx, spec.ratio)
    pooled = torch_compress.compress_pool(kv, score, state.kv, state.score, plan.request,
                                          plan.entry, ctx.start_pos, ctx.cu_seqlens, ctx.slots,
                                          spec.ratio, spec.overlap, block_elems=_BLOCK_ELEMS)
    torch_compress.compress_update_state(kv, score, state.kv, state.score, ctx.start_pos,
                                         ctx.cu_seqlens, ctx.slots, spec.ratio, spec.overlap)
    return plan, pooled


def compress_step(ops: SimpleNamespace, ctx: StepContext, state: CompressorState, kv: Tensor,
                  score: Tensor, norm: RMSNorm, out_dtype: torch.dtype,
                  rope: tuple[Tensor, Tensor] | None, ape: Tensor | None = None
                  ) -> tuple[EntryPlan, Tensor]:
    """The entries completed in this step, finished (pooled, cast to ``out_dtype``, ``norm``,
    RoPE with ``rope`` = (cos, sin) at the entries' positions when given), then the carry-over
    state update: two ops (``compress_entries``, ``compress_update_state``).  ``ape`` [r, W]:
    ``score`` is unbiased and the ops add ``ape[pos % r]`` (None: ``score`` is final).

    In a static-shape step the candidates that do not complete come out as zeros.
    """
    spec = state.spec
    plan = entry_plan(ctx, spec.ratio)
    cos, sin = rope if rope is not None else (None, None)
    entries = ops.compress_entries(kv, score, state.kv, state.score, plan.request, plan.entry,
                                   plan.valid, ctx.start_pos, ctx.cu_seqlens, ctx.slots,
                                   spec.ratio, spec.overlap, norm.weight, norm.eps, cos, sin,
                                   out_dtype, ape=ape)
    ops.compress_update_state(kv, score, state.kv, state.score, ctx.start_pos, ctx.cu_seqlens,
                              ctx.slots, spec.ratio, spec.overlap, ape=ape)
    return plan, entries


def ops_fuse_ape(ops: SimpleNamespace) -> bool:
    """Whether the op table's compressor ops add ``ape`` in their own launches: the torch twins
    always do; Triton wrappers say so through their ``ape_fused()`` (False until GPU-verified,
    where passing ``ape`` would only move the model's add into more torch launches)."""
    check = getattr(ops.compress_entries, "ape_fused", None)
    return check is None or bool(check())


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens into one entry of width ``head_dim`` (spec §3.7).

    Parameters (official names under ``compressor.``): ``wkv``, ``wgate`` [coff·d, D] (fp32
    compute, as the reference promotes them), ``ape`` [r, coff·d] fp32, ``norm`` [d].
    ``rotate`` marks the V4 indexer's compressor: in official numerics its entries get a
    Hadamard rotation and FP4 fake quantization (the attention compressor: FP8 on the nope part).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, spec: CompressorSpec, numerics: str,
                 ops: SimpleNamespace, dtype: torch.dtype, rotate: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.spec = spec
        self.numerics = check_numerics(numerics)
        self.ops = ops
        self.dtype = dtype
        self.rotate = rotate
        d, w = spec.dim, spec.state_width
        # fp32 math on the checkpoint's bf16 values (held in bf16 on the GPU: fp32_math_dtype).
        wdtype = fp32_math_dtype(dtype)
        self.wkv = Linear(cfg.dim, w, fmt="bf16", numerics=numerics, dtype=wdtype)
        self.wgate = Linear(cfg.dim, w, fmt="bf16", numerics=numerics, dtype=wdtype)
        self.ape = nn.Parameter(torch.zeros(spec.ratio, w, dtype=torch.float32),
                                requires_grad=False)
        self.norm = RMSNorm(d, cfg.norm_eps, ops)

    # ------------------------------------------------------------------ pooling
    def pool(self, x: Tensor, ctx: StepContext, state: CompressorState
             ) -> tuple[EntryPlan, Tensor]:
        """Pool every entry completed in this step and update the carry-over state.

        x [T, D].  Returns the plan and the pooled entries [E, d] in fp32 (before the norm).
        """
        self._check_state(state)
        kv, score = self._rows(x, ctx)
        return pool_entries(ctx, state, kv, score)

    def _check_state(self, state: CompressorState) -> None:
        if state.spec != self.spec:
            raise ValueError(f"Compressor(layer {self.layer_id}): state is for {state.spec}; "
                             f"expected {self.spec}")

    def _rows(self, x: Tensor, ctx: StepContext, biased: bool = True) -> tuple[Tensor, Tensor]:
        """The step's fp32 rows: kv = wkv(x), score = wgate(x) + ape[pos % r] (``biased``;
        else wgate(x) alone, for ops that add ``ape`` themselves)."""
        # fp32 GEMMs on the Linears' weights (what their forward computes for fmt "bf16" held in
        # fp32: no activation fake quant), through the op table's skinny-GEMM kernel.
        kv, score = kv_score_rows(self.ops, x, self.wkv, self.wgate)
        if not biased:
            return kv, score
        # Each token's slot in its group: the same for every compressor of the ratio (memoized).
        key = ("group_slot", self.spec.ratio)
        if key not in ctx.memo:
            ctx.memo[key] = ctx.positions % self.spec.ratio
        return kv, score + self.ape[ctx.memo[key]]

    # ------------------------------------------------------------------ entries
    def rows(self, x: Tensor, ctx: Any) -> tuple[Tensor, Tensor]:
        """The step's fp32 (kv, score) rows as :meth:`forward` takes them: token-local (a
        piecewise step makes them inside its graphs).  ``ctx`` needs ``positions`` and
        ``memo``."""
        # ape goes into the ops' own score reads where they fuse it (bit-identical to adding it
        # here: one fp32 add of the same values); else the two-launch add of _rows.
        return self._rows(x, ctx, biased=not ops_fuse_ape(self.ops))

    def forward(self, x: Tensor, ctx: StepContext, state: CompressorState, pool: Tensor,
                fmt: RecordFormat | None = None,
                rows: tuple[Tensor, Tensor] | None = None) -> EntryPlan:
        """Pool, normalize, rotate (RoPE at j·r) and store this step's entries into ``pool``
        (``fmt``: the pool's record format, None for a pool of rows), then update the state.
        ``rows``: :meth:`rows` of x, made already.

        The pooling, norm and RoPE of all entries are one op (``compress_entries``), the state
        update another; what ``pool`` + ``finish`` compute, to the bit on the torch backend.
        """
        self._check_state(state)
        fused = ops_fuse_ape(self.ops)
        kv, score = self.rows(x, ctx) if rows is None else rows
        plan = entry_plan(ctx, self.spec.ratio)
        rope = entry_rope(ctx, self.cfg, self.layer_id, plan) if plan.num_entries else None
        plan, entries = compress_step(self.ops, ctx, state, kv, score, self.norm, self.dtype,
                                      rope, ape=self.ape if fused else None)
        if plan.num_entries:
            if fmt is not None:
                # Record pool: packing rounds as the fake quant would; the indexer's Hadamard
                # rotation is fused into the record write (the bytes _stored + write give).
                write_entries(pool, ctx, plan, entries, fmt, ops=self.ops, hadamard=self.rotate,
                              zeroed=True)
            else:
                write_entries(pool, ctx, plan, self._stored(entries, False), fmt, ops=self.ops,
                              zeroed=True)
        return plan

    def finish(self, pooled: Tensor, positions: Tensor, store_quantizes: bool = False) -> Tensor:
        """norm(pooled in the compute dtype), RoPE at ``positions``, official fake quant.

        ``store_quantizes``: the entries go to a record pool, whose packing rounds them exactly
        as the fake quant does, so it is skipped; the indexer's Hadamard rotation is then
        applied in every numerics (its queries are rotated alike, dsv4.model.indexer).
        """
        entries = self.norm(pooled.to(self.dtype))
        cos, sin = rope_cos_sin(self.cfg, self.layer_id, positions)
        return self._stored(self.ops.apply_rope(entries, cos, sin), store_quantizes)

    def _stored(self, entries: Tensor, store_quantizes: bool) -> Tensor:
        """The official Hadamard rotation / fake quantization of finished entries."""
        from dsv4.formats import fake_quant_fp4, fake_quant_fp8, hadamard_transform
        rd = self.cfg.rope_head_dim
        if self.rotate and (self.numerics == "official" or store_quantizes):
            entries = hadamard_transform(entries)
        if self.numerics == "official" and not store_quantizes:
            if self.rotate:
                entries = fake_quant_fp4(entries, 32)
            else:
                nope = fake_quant_fp8(entries[:, :-rd], 64)
                entries = torch.cat((nope, entries[:, -rd:]), dim=-1)
        return entries


class CompressorV2(nn.Module):
    """V4.1 compressor of a KV-source layer (spec §4.3): the **pre-RoPE** latent of new entries.

    Ratio 2 (``wkv``, ``wgate``, ``norm``): entry j pools tokens 2j, 2j+1 with a per-channel
    softmax of the gate (fp32, no ``ape``, no overlap), cast to the compute dtype, then ``norm``.
    Ratio 1 (``wkv``, ``norm``): every token is an entry, ``norm(wkv(x))`` in the compute dtype
    (no gate, no pooling).  The caller derives the index keys from the latent, then rotates and
    stores it (attention.py).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: SimpleNamespace,
                 dtype: torch.dtype) -> None:
        super().__init__()
        r = cfg.compressor_ratio(layer_id)
        if not cfg.is_v41 or r <= 0:
            raise ValueError(f"CompressorV2: layer {layer_id} is not a V4.1 KV-source layer "
                             f"(compress ratio {cfg.ratio(layer_id)}, variant {cfg.variant})")
        self.layer_id = layer_id
        self.ratio = r
        self.dtype = dtype
        self.ops = ops
        hd = cfg.head_dim
        self.spec: CompressorSpec | None = CompressorSpec("attn", r, hd, False) if r > 1 else None
        if r > 1:
            # The reference promotes the pooling weights to fp32 (spec §4.3): fp32 math on the
            # checkpoint's bf16 values (held in bf16 on the GPU: fp32_math_dtype).
            wdtype = fp32_math_dtype(dtype)
            self.wkv = Linear(cfg.dim, hd, fmt="bf16", numerics=numerics, dtype=wdtype)
            self.wgate = Linear(cfg.dim, hd, fmt="bf16", numerics=numerics, dtype=wdtype)
        else:
            self.wkv = Linear(cfg.dim, hd, fmt="bf16", numerics=numerics, dtype=dtype)
        self.norm = RMSNorm(hd, cfg.norm_eps, ops)

    def rows(self, x: Tensor) -> tuple[Tensor, ...]:
        """The token-local part of :meth:`forward`: ratio 2 the fp32 (kv, score) rows, ratio 1
        the finished latents (latent,) — one per token."""
        if self.spec is None:
            return (self.norm(self.wkv(x.to(self.dtype))),)
        return kv_score_rows(self.ops, x, self.wkv, self.wgate)

    def forward(self, x: Tensor, ctx: StepContext, state: CompressorState | None,
                rows: tuple[Tensor, ...] | None = None) -> tuple[EntryPlan, Tensor]:
        """x [T, D] -> (plan of the entries completed in this step, latents [E, hd] pre-RoPE).

        ``state`` is the slot carry-over of a ratio-2 compressor (None for ratio 1); ``rows``:
        :meth:`rows` of x, made already.
        """
        plan = entry_plan(ctx, self.ratio)
        rows = self.rows(x) if rows is None else rows
        if self.spec is None:
            # Ratio 1: the entries of a step are its tokens, in the same (request, position) order.
            return plan, rows[0]
        if state is None or state.spec != self.spec:
            raise ValueError(f"CompressorV2(layer {self.layer_id}): needs a carry-over state for "
                             f"{self.spec}; got {None if state is None else state.spec}")
        kv, score = rows
        return compress_step(self.ops, ctx, state, kv, score, self.norm, self.dtype, None)
