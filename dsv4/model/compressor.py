"""The compressor (spec §3.7) and its carry-over state, over a batch of requests.

Every token gives fp32 rows ``kv = wkv(x)`` and ``score = wgate(x) + ape[pos % r]``.  Entry j of
a request pools group j (positions ``j·r .. j·r + r − 1``) with a per-channel softmax over its
slots; the overlapping ratio-4 compressor pools 2r slots: the previous group's first ``d``
channels and the current group's last ``d`` channels.  An entry is produced in the step that
brings its last token; rows of groups that are still open (and, with overlap, the last complete
group) are kept in the slot's state for the next step.

Each entry is computed from exactly the same rows in the same order whatever the split of the
sequence into steps, so chunked prefill and decode give the entries of a one-shot prefill.
The whole batch is handled at once: a row of a group is located either among this step's tokens
or in the request's state (``_locate_rows``) and gathered from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from dsv4.cache.formats import RecordFormat, encode_rows
from dsv4.cache.tensors import CompressorSpec, CompressorState
from dsv4.config import ModelConfig
from dsv4.model.context import StepContext
from dsv4.model.layers import Linear, RMSNorm, check_numerics

__all__ = ["Compressor", "EntryPlan", "entry_plan", "entry_pool_rows", "write_entries"]

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
        # Decode: request t's token at position p completes entry (p+1)/r − 1 when r | p+1.
        end = ctx.positions + 1
        req = torch.arange(ctx.num_requests, device=ctx.device)
        ent = torch.clamp(torch.div(end, ratio, rounding_mode="floor") - 1, min=0)
        ctx.memo[key] = EntryPlan(ratio, req, ent, [], [], valid=end % ratio == 0)
    if key not in ctx.memo:
        first = [s // ratio for s in ctx.start_pos_host]
        counts = [e // ratio - f for e, f in zip(ctx.end_pos_host, first)]
        dev = ctx.device
        cnt = torch.tensor(counts, dtype=torch.int64, device=dev)
        req = torch.repeat_interleave(torch.arange(len(counts), device=dev), cnt)
        offs = torch.cumsum(cnt, 0) - cnt
        ent = torch.arange(req.shape[0], device=dev) - offs[req]
        ent = ent + torch.tensor(first, dtype=torch.int64, device=dev)[req]
        ctx.memo[key] = EntryPlan(ratio, req, ent, counts, first)
    return ctx.memo[key]


def entry_pool_rows(ctx: StepContext, ratio: int, page_size: int) -> Tensor:
    """[R, L] int64 flat pool rows of entries 0..L−1 of each request (L = max end_pos // r);
    −1 where the request has no such entry (memoized per step)."""
    key = ("entry_rows", ratio, page_size)
    if key not in ctx.memo and ctx.static is not None:
        # Static shape: every column of the block table, L = max_pages · page_size // r.
        epp = page_size // ratio
        L = ctx.block_tables.shape[1] * epp
        j = torch.arange(L, device=ctx.device)
        pages = ctx.block_tables[:, j // epp]
        n_ent = torch.div(ctx.positions + 1, ratio, rounding_mode="floor")
        have = (j[None, :] < n_ent[:, None]) & (pages >= 0)
        ctx.memo[key] = torch.where(have, pages * epp + j % epp, -1)
    if key not in ctx.memo:
        epp = page_size // ratio
        n_ent = [e // ratio for e in ctx.end_pos_host]
        L = max(n_ent + [0])
        j = torch.arange(L, device=ctx.device)
        pages = ctx.block_tables.gather(1, (j // epp).clamp(max=ctx.block_tables.shape[1] - 1)
                                        .expand(ctx.num_requests, L))
        rows = pages * epp + j % epp
        have = j[None, :] < torch.tensor(n_ent, dtype=torch.int64, device=ctx.device)[:, None]
        ctx.memo[key] = torch.where(have & (pages >= 0), rows, -1)
    return ctx.memo[key]


def write_entries(pool: Tensor, ctx: StepContext, plan: EntryPlan, entries: Tensor,
                  fmt: RecordFormat | None = None) -> None:
    """Store ``entries`` [E, d] at their rows of ``pool`` [num_pages, page_size // r, d]
    (packed as ``fmt`` records when the pool holds records [.., record_bytes])."""
    if plan.num_entries == 0:
        return
    epp = pool.shape[1]
    page = ctx.block_tables[plan.request, plan.entry // epp]
    if plan.valid is not None:
        # Static shape: entries that do not complete go to the scratch page (zeros, so that
        # nothing non-finite sits there).
        page = torch.where(plan.valid, page, ctx.static.scratch_page)
        entries = torch.where(plan.valid[:, None], entries, 0.0)
    rows = page * epp + plan.entry % epp
    pool.view(-1, pool.shape[-1]).index_copy_(0, rows, encode_rows(entries, fmt, pool.dtype))


def _locate_rows(ctx: StepContext, spec: CompressorSpec, req: Tensor, pos: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Where the fp32 row of position ``pos`` of request ``req`` lives (same shapes in/out).

    Returns ``(from_step, step_row, state_row)``: this step's token row when ``from_step``, else
    a row of the flattened state (−1 when the position holds nothing: before the sequence, or a
    group that is no longer kept).
    """
    r = spec.ratio
    p0 = ctx.start_pos[req]
    from_step = pos >= p0
    step_row = ctx.cu_seqlens[req] + (pos - p0)
    g0 = torch.div(p0, r, rounding_mode="floor") * r           # first position of p0's group
    base = ctx.slots[req] * spec.state_rows
    in_partial = (pos >= g0) & ~from_step
    state_row = torch.where(in_partial, base + spec.partial_offset + pos % r, -1)
    if spec.overlap:
        in_prev = (pos >= g0 - r) & (pos < g0) & (pos >= 0)
        state_row = torch.where(in_prev, base + pos % r, state_row)
    return from_step, step_row, state_row


def _gather_rows(step_rows: Tensor, state_rows: Tensor, fill: float, where: tuple[Tensor, ...]
                 ) -> Tensor:
    """Rows [..., w] picked from this step's rows or the flat state; ``fill`` where empty."""
    from_step, step_row, state_row = where
    a = step_rows.index_select(0, step_row.clamp(0, max(step_rows.shape[0] - 1, 0)).reshape(-1))
    b = state_rows.index_select(0, state_row.clamp_min(0).reshape(-1))
    shape = (*from_step.shape, step_rows.shape[-1])
    a, b = a.view(shape), b.view(shape)
    out = torch.where(from_step[..., None], a, b)
    empty = (~from_step & (state_row < 0))[..., None]
    return out.masked_fill(empty, fill)


def _softmax_pool(rows_kv: Tensor, rows_score: Tensor) -> Tensor:
    """Per-channel softmax over the slots (dim 1) weighting the kv rows: [e, slots, d] -> [e, d].

    Computed in float64 and rounded once to fp32: CPU kernels pick vector or scalar code (exp)
    and reduction orders by tensor shape and thread count, which would make an entry's fp32 bits
    depend on how many entries the step pools; in float64 those differences vanish in the final
    rounding, so an entry is the same whatever the split of the sequence into steps.
    """
    score = rows_score.double()
    p = torch.exp(score - score.amax(dim=1, keepdim=True))
    p = p / p.sum(dim=1, keepdim=True)
    return (p * rows_kv.double()).sum(dim=1).float()


def pool_entries(ctx: StepContext, state: CompressorState, kv: Tensor, score: Tensor
                 ) -> tuple[EntryPlan, Tensor]:
    """Pool the entries that complete in this step and update the carry-over state.

    ``kv`` / ``score`` [T, coff·d] fp32 are the rows of this step's tokens (score including any
    position bias).  Returns the plan and the pooled entries [E, d] fp32 (before the norm).
    Shared by the V4 compressor and the V4.1 ratio-2 compressor.
    """
    spec = state.spec
    r, d = spec.ratio, spec.dim
    state_kv = state.kv.view(-1, spec.state_width)
    state_score = state.score.view(-1, spec.state_width)
    plan = entry_plan(ctx, r)
    pooled = kv.new_empty(plan.num_entries, d)
    slots = 2 * r if spec.overlap else r
    step = max(1, _BLOCK_ELEMS // (slots * spec.state_width))   # bounds the gathered rows
    k = torch.arange(r, device=kv.device)
    for e0 in range(0, plan.num_entries, step):
        ent = plan.entry[e0:e0 + step]
        cur_pos = ent[:, None] * r + k[None, :]                              # [e, r]
        req = plan.request[e0:e0 + step, None].expand_as(cur_pos)
        if spec.overlap:
            pos = torch.cat((cur_pos - r, cur_pos), dim=1)                    # [e, 2r]
            req = torch.cat((req, req), dim=1)
        else:
            pos = cur_pos
        where = _locate_rows(ctx, spec, req, pos)
        rows_kv = _gather_rows(kv, state_kv, 0.0, where)
        rows_score = _gather_rows(score, state_score, float("-inf"), where)
        if spec.overlap:
            # previous group: channels [:d]; current group: channels [d:]
            rows_kv = torch.cat((rows_kv[:, :r, :d], rows_kv[:, r:, d:]), dim=1)
            rows_score = torch.cat((rows_score[:, :r, :d], rows_score[:, r:, d:]), dim=1)
        pooled[e0:e0 + step] = _softmax_pool(rows_kv, rows_score)
    _update_state(ctx, state, kv, score)
    return plan, pooled


def _update_state(ctx: StepContext, state: CompressorState, kv: Tensor, score: Tensor) -> None:
    """Keep the open group (and with overlap the last complete group) of every request."""
    spec = state.spec
    r, R = spec.ratio, ctx.num_requests
    end = ctx.start_pos + (ctx.cu_seqlens[1:] - ctx.cu_seqlens[:-1])
    g_end = torch.div(end, r, rounding_mode="floor") * r                     # open group start
    k = torch.arange(r, device=kv.device)
    pos = g_end[:, None] + k[None, :]                                         # [R, r]
    pos = torch.where(pos < end[:, None], pos, -1)
    if spec.overlap:
        prev = g_end[:, None] - r + k[None, :]
        pos = torch.cat((prev, pos), dim=1)                                   # [R, 2r]
    req = torch.arange(R, device=kv.device)[:, None].expand_as(pos)
    where = _locate_rows(ctx, spec, req, pos)
    new_kv = _gather_rows(kv, state.kv.view(-1, spec.state_width), 0.0, where)
    new_score = _gather_rows(score, state.score.view(-1, spec.state_width), float("-inf"),
                             where)
    state.kv.index_copy_(0, ctx.slots, new_kv)
    state.score.index_copy_(0, ctx.slots, new_score)


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
        self.wkv = Linear(cfg.dim, w, fmt="bf16", numerics=numerics, dtype=torch.float32)
        self.wgate = Linear(cfg.dim, w, fmt="bf16", numerics=numerics, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(spec.ratio, w, dtype=torch.float32),
                                requires_grad=False)
        self.norm = RMSNorm(d, cfg.norm_eps, ops)

    # ------------------------------------------------------------------ pooling
    def pool(self, x: Tensor, ctx: StepContext, state: CompressorState
             ) -> tuple[EntryPlan, Tensor]:
        """Pool every entry completed in this step and update the carry-over state.

        x [T, D].  Returns the plan and the pooled entries [E, d] in fp32 (before the norm).
        """
        if state.spec != self.spec:
            raise ValueError(f"Compressor(layer {self.layer_id}): state is for {state.spec}; "
                             f"expected {self.spec}")
        xf = x.float()
        kv = self.wkv(xf)
        score = self.wgate(xf) + self.ape[ctx.positions % self.spec.ratio]
        return pool_entries(ctx, state, kv, score)

    # ------------------------------------------------------------------ entries
    def forward(self, x: Tensor, ctx: StepContext, state: CompressorState, pool: Tensor,
                fmt: RecordFormat | None = None) -> EntryPlan:
        """Pool, normalize, rotate (RoPE at j·r) and store this step's entries into ``pool``
        (``fmt``: the pool's record format, None for a pool of rows)."""
        plan, pooled = self.pool(x, ctx, state)
        if plan.num_entries:
            entries = self.finish(pooled, plan.entry * self.spec.ratio,
                                  store_quantizes=fmt is not None)
            write_entries(pool, ctx, plan, entries, fmt)
        return plan

    def finish(self, pooled: Tensor, positions: Tensor, store_quantizes: bool = False) -> Tensor:
        """norm(pooled in the compute dtype), RoPE at ``positions``, official fake quant.

        ``store_quantizes``: the entries go to a record pool, whose packing rounds them exactly
        as the fake quant does, so it is skipped; the indexer's Hadamard rotation is then
        applied in every numerics (its queries are rotated alike, dsv4.model.indexer).
        """
        from dsv4.model.layers import rope_cos_sin
        rd = self.cfg.rope_head_dim
        entries = self.norm(pooled.to(self.dtype))
        cos, sin = rope_cos_sin(self.cfg, self.layer_id, positions)
        entries = self.ops.apply_rope(entries, cos, sin)
        from dsv4.formats import fake_quant_fp4, fake_quant_fp8, hadamard_transform
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
        hd = cfg.head_dim
        self.spec: CompressorSpec | None = CompressorSpec("attn", r, hd, False) if r > 1 else None
        if r > 1:
            # The reference promotes the pooling weights to fp32 (spec §4.3).
            self.wkv = Linear(cfg.dim, hd, fmt="bf16", numerics=numerics, dtype=torch.float32)
            self.wgate = Linear(cfg.dim, hd, fmt="bf16", numerics=numerics, dtype=torch.float32)
        else:
            self.wkv = Linear(cfg.dim, hd, fmt="bf16", numerics=numerics, dtype=dtype)
        self.norm = RMSNorm(hd, cfg.norm_eps, ops)

    def forward(self, x: Tensor, ctx: StepContext, state: CompressorState | None
                ) -> tuple[EntryPlan, Tensor]:
        """x [T, D] -> (plan of the entries completed in this step, latents [E, hd] pre-RoPE).

        ``state`` is the slot carry-over of a ratio-2 compressor (None for ratio 1).
        """
        plan = entry_plan(ctx, self.ratio)
        if self.spec is None:
            # Ratio 1: the entries of a step are its tokens, in the same (request, position) order.
            return plan, self.norm(self.wkv(x.to(self.dtype)))
        if state is None or state.spec != self.spec:
            raise ValueError(f"CompressorV2(layer {self.layer_id}): needs a carry-over state for "
                             f"{self.spec}; got {None if state is None else state.spec}")
        xf = x.float()
        plan, pooled = pool_entries(ctx, state, self.wkv(xf), self.wgate(xf))
        return plan, self.norm(pooled.to(self.dtype))
