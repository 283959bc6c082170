"""The routing plan of the routed-expert kernels (dsv4.ops.triton_moe): the (token, pick) pairs
sorted by expert into row blocks of BM rows, each block owned by one expert.

:func:`moe_plan` runs on the GPU without a host sync, so a step with it can be captured in a
CUDA graph: up to :data:`SMALL_PLAN_MAX_PAIRS` pairs one one-program launch (decode), beyond
one program per expert, or (:data:`MOE_PLAN_CHUNKED`) three launches over chunks of
:data:`PLAN_CHUNK` pairs (count, prefix over the chunks, scatter).  :func:`moe_plan_torch` is
its torch twin (about ten torch ops with a stable sort), identical bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.triton_dense import _INTERPRET_HOST

__all__ = ["SMALL_PLAN_MAX_PAIRS", "flat_ids", "moe_plan", "moe_plan_torch", "small_plan_rows",
           "small_plan_store"]


@triton.jit
def _moe_plan_kernel(ids_ptr, pairs_ptr, bexp_ptr, P, E, NB, BM: tl.constexpr,
                     NBINS: tl.constexpr, BP: tl.constexpr, BF: tl.constexpr,
                     PDL: tl.constexpr = False):
    """The routing plan of :func:`moe_plan_torch`, one program per expert e (program E fills
    the unused tail): every program histograms all P ids (cheap: P ≤ a few 10^4 int loads from
    L2) to find its first block, then writes its own pairs in pair order (a running cumsum:
    stable, so the layout equals the twin's bit for bit), the padding of its last block and
    the expert of its blocks.  Each output element is written by exactly one program."""
    grid_dependency_sync(PDL)
    e = tl.program_id(0)
    bins = tl.arange(0, NBINS)
    counts = tl.zeros((NBINS,), dtype=tl.int32)
    for p0 in range(0, P, BP):
        rp = p0 + tl.arange(0, BP)
        ids = tl.load(ids_ptr + rp, mask=rp < P, other=-1)
        # Ids of other shards (and the masked tail) count in bin E, which is ignored.
        key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
        counts += tl.histogram(key, NBINS)
    blocks = tl.where(bins < E, (counts + BM - 1) // BM, 0)
    first_blk = tl.sum(tl.where(bins < e, blocks, 0))
    if e < E:
        my_count = tl.sum(tl.where(bins == e, counts, 0))
        if my_count > 0:
            my_blocks = (my_count + BM - 1) // BM
            first_row = first_blk * BM
            run = my_count * 0
            for p0 in range(0, P, BP):
                rp = p0 + tl.arange(0, BP)
                ids = tl.load(ids_ptr + rp, mask=rp < P, other=-1)
                hit = (ids == e) & (rp < P)
                hit_i = hit.to(tl.int32)
                dest = first_row + run + tl.cumsum(hit_i, 0) - 1
                tl.store(pairs_ptr + dest, rp, mask=hit)
                run += tl.sum(hit_i)
            pad = first_row + my_count + tl.arange(0, BM)
            tl.store(pairs_ptr + pad, tl.zeros((BM,), dtype=tl.int32) + P,
                     mask=pad < (first_blk + my_blocks) * BM)
            for b0 in range(0, my_blocks, BF):
                rb = first_blk + b0 + tl.arange(0, BF)
                tl.store(bexp_ptr + rb, tl.zeros((BF,), dtype=tl.int32) + e,
                         mask=rb < first_blk + my_blocks)
    else:
        # first_blk is the number of used blocks here: everything after it is unused.
        for r0 in range(first_blk * BM, NB * BM, BF):
            rr = r0 + tl.arange(0, BF)
            tl.store(pairs_ptr + rr, tl.zeros((BF,), dtype=tl.int32) + P, mask=rr < NB * BM)
        for b0 in range(first_blk, NB, BF):
            rb = b0 + tl.arange(0, BF)
            tl.store(bexp_ptr + rb, tl.zeros((BF,), dtype=tl.int32) + E, mask=rb < NB)


@triton.jit
def _plan_count_kernel(ids_ptr, hist_ptr, pairs_ptr, P, E, ROWS, rows_per_chunk,
                       NBINS: tl.constexpr, BP: tl.constexpr, BF: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Chunk c of BP pairs: its histogram of ids ``hist[c, e]`` (ids of other shards and the
    tail past P in bin E, ignored); and the padding value P in its share of the plan's rows
    (the scatter writes the real pairs over it later in the stream)."""
    grid_dependency_sync(PDL)
    c = tl.program_id(0)
    rp = c * BP + tl.arange(0, BP)
    ids = tl.load(ids_ptr + rp, mask=rp < P, other=-1)
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    tl.store(hist_ptr + c * NBINS + tl.arange(0, NBINS), tl.histogram(key, NBINS))
    r0 = c * rows_per_chunk
    for r in range(r0, r0 + rows_per_chunk, BF):
        rr = r + tl.arange(0, BF)
        tl.store(pairs_ptr + rr, tl.zeros((BF,), dtype=tl.int32) + P,
                 mask=(rr < ROWS) & (rr < r0 + rows_per_chunk))


@triton.jit
def _plan_prefix_kernel(hist_ptr, before_ptr, counts_ptr, C, NBINS: tl.constexpr,
                        BB: tl.constexpr, CB: tl.constexpr, PDL: tl.constexpr = False):
    """Bins [g·BB, (g+1)·BB) of every chunk: ``before[c, e]`` = Σ_{c' < c} hist[c', e] (id e's
    pairs in the chunks before c) and ``counts[e]`` = Σ_c hist[c, e]."""
    grid_dependency_sync(PDL)
    bins = tl.program_id(0) * BB + tl.arange(0, BB)
    run = tl.zeros((BB,), dtype=tl.int32)
    for c0 in range(0, C, CB):
        rc = c0 + tl.arange(0, CB)
        offs = rc[:, None] * NBINS + bins[None, :]
        h = tl.load(hist_ptr + offs, mask=(rc < C)[:, None], other=0)
        tl.store(before_ptr + offs, run[None, :] + tl.cumsum(h, 0) - h, mask=(rc < C)[:, None])
        run += tl.sum(h, 0)
    tl.store(counts_ptr + bins, run)


@triton.jit
def _plan_scatter_kernel(ids_ptr, before_ptr, counts_ptr, first_ptr, pairs_ptr, bexp_ptr, P, E,
                         NB, blocks_per_chunk, BM: tl.constexpr, NBINS: tl.constexpr,
                         BP: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr = False):
    """Chunk c: pair p (id e) goes to row first_row(e) + before[c, e] + #{q < p in the chunk
    with id e} ([BP, BP] comparisons), first_row(e) = BM · Σ_{e' < e} ceil(count(e') / BM):
    ascending pair index within an expert, as the twin's stable sort.  Then the expert of the
    chunk's share of the blocks (E past the used ones)."""
    grid_dependency_sync(PDL)
    c = tl.program_id(0)
    bins = tl.arange(0, NBINS)
    counts = tl.load(counts_ptr + bins)
    blocks = tl.where(bins < E, (counts + BM - 1) // BM, 0)
    blk_end = tl.cumsum(blocks, 0)
    # first_row by id through this program's own scratch row (a gather by the pairs' ids).
    tl.store(first_ptr + c * NBINS + bins, (blk_end - blocks) * BM)
    tl.debug_barrier()
    lane = tl.arange(0, BP)
    rp = c * BP + lane
    ids = tl.load(ids_ptr + rp, mask=rp < P, other=-1)
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    valid = (key < E) & (rp < P)
    same = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    row = c * NBINS + tl.where(valid, key, 0)
    dest = (tl.load(first_ptr + row, mask=valid, other=0)
            + tl.load(before_ptr + row, mask=valid, other=0) + rank)
    tl.store(pairs_ptr + dest, rp, mask=valid)
    # Block b belongs to the first expert whose blocks end after b (E: none, unused).
    for b0 in range(c * blocks_per_chunk, (c + 1) * blocks_per_chunk, BS):
        rb = b0 + tl.arange(0, BS)
        owner = tl.sum(((blk_end[None, :] <= rb[:, None]) & (bins[None, :] < E)).to(tl.int32), 1)
        tl.store(bexp_ptr + rb, owner, mask=(rb < NB) & (rb < (c + 1) * blocks_per_chunk))


@triton.jit
def small_plan_rows(ids_ptr, P, E, BM: tl.constexpr, PP: tl.constexpr):
    """The plan of P <= PP pairs from [PP, PP] comparisons in registers: per pair p (lane p),
    its plan row ``first_block(e)·BM + #{q < p with the same id}`` where first_block(e) = Σ over
    the valid ids e' < e of ceil(count(e') / BM); whether its id is valid (0..E-1); and per
    lane the id key, whether it is its id's first pair, and that id's block count / first
    block (for the block map).  Returns (lanes, key, valid, dest, first, nblk, first_blk)."""
    rp = tl.arange(0, PP)
    ids = tl.load(ids_ptr + rp, mask=rp < P, other=-1)
    # Skipped ids (other shards) sort as E, the lanes past P as E + 1: neither is placed.
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    key = tl.where(rp < P, key, E + 1)
    kp = key[:, None]                       # row: pair p
    kq = key[None, :]                       # column: pair q
    same = kq == kp
    count = tl.sum(same.to(tl.int32), axis=1)                                  # [PP]
    rank_in = tl.sum((same & (rp[None, :] < rp[:, None])).to(tl.int32), axis=1)
    valid = key < E
    first = valid & (rank_in == 0)           # the first pair of each valid id
    nblk = tl.where(first, (count + BM - 1) // BM, 0)                          # [PP]
    # Σ of the block counts of the smaller ids, for pair p: over columns q.
    first_blk = tl.sum(tl.where(kq < kp, nblk[None, :], 0), axis=1)           # [PP]
    return rp, key, valid, first_blk * BM + rank_in, first, nblk, first_blk


@triton.jit
def small_plan_store(pairs_ptr, bexp_ptr, P, E, NB, rp, key, valid, dest, first, nblk,
                     first_blk, BM: tl.constexpr, NBP: tl.constexpr, RB: tl.constexpr):
    """Write the plan of :func:`small_plan_rows`: every row P (padding rows, unused blocks),
    then after a block-wide barrier the pairs over them; block b -> the id whose block range
    [first_blk, first_blk + nblk) holds b, else E."""
    for r0 in range(0, NB * BM, RB):
        rr = r0 + tl.arange(0, RB)
        tl.store(pairs_ptr + rr, tl.zeros((RB,), dtype=tl.int32) + P, mask=rr < NB * BM)
    tl.debug_barrier()
    tl.store(pairs_ptr + dest, rp, mask=valid)
    rb = tl.arange(0, NBP)
    hit = (first[None, :] & (first_blk[None, :] <= rb[:, None])
           & (rb[:, None] < first_blk[None, :] + nblk[None, :]))                # [NBP, PP]
    owner = tl.sum(tl.where(hit, key[None, :], 0), axis=1)
    owned = tl.sum(hit.to(tl.int32), axis=1) > 0
    tl.store(bexp_ptr + rb, tl.where(owned, owner, E), mask=rb < NB)


@triton.jit
def _moe_plan_small_kernel(ids_ptr, pairs_ptr, bexp_ptr, P, E, NB, BM: tl.constexpr,
                           PP: tl.constexpr, NBP: tl.constexpr, RB: tl.constexpr,
                           PDL: tl.constexpr = False):
    """:func:`_moe_plan_kernel` for P <= PP pairs (decode) in one program
    (:func:`small_plan_rows`, :func:`small_plan_store`), instead of E + 1 programs each
    histogramming the ids (the decode plan took ~6 µs on the H200 critical path)."""
    grid_dependency_sync(PDL)
    rp, key, valid, dest, first, nblk, first_blk = small_plan_rows(ids_ptr, P, E, BM, PP)
    small_plan_store(pairs_ptr, bexp_ptr, P, E, NB, rp, key, valid, dest, first, nblk,
                     first_blk, BM, NBP, RB)


# Up to this many (token, pick) pairs moe_plan takes the one-program kernel (at most 10 tokens
# of top-6 routing; [64, 64] comparisons and a [NB ≤ 128, 64] block map in registers).
SMALL_PLAN_MAX_PAIRS = 64
# Beyond, one program per expert (each histograms and scans every pair: ~43 / 197 / 803 µs at
# 2K / 8K / 32K tokens of V4-Flash on an H100), or with DSV4_MOE_PLAN_CHUNKED=1 the chunked
# kernels: pairs in chunks of PLAN_CHUNK, one program each (ranks from [PLAN_CHUNK, PLAN_CHUNK]
# comparisons).  Opt-in until a GPU run times it (written in the fortieth session; a first form
# sorting chunks of 1,024 pairs took 82 / 156 / 151 µs).
MOE_PLAN_CHUNKED = os.environ.get("DSV4_MOE_PLAN_CHUNKED", "0") == "1"
PLAN_CHUNK = 128


def flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """The (token, pick) ids as the plan kernels read them: flat, contiguous, int32 / int64."""
    flat = topk_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int64)
    return flat.contiguous()


def moe_plan(topk_ids: torch.Tensor, num_experts: int, BM: int, chunked: bool | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, pick) pairs by expert into row blocks of BM: Triton launches on CUDA
    (and in the interpreter), no host sync, CUDA-graph capturable; the torch twin
    :func:`moe_plan_torch` elsewhere.  Same outputs, bit for bit:

    ``pairs`` [nb·BM] int32 (pair index t·k + j, ascending within an expert, or P = T·k for
    padding) and ``block_expert`` [nb] int32 (the block's expert, or E past the used blocks),
    with nb = ceil(P / BM) + min(E, P), an upper bound of Σ_e ceil(count_e / BM).
    Pairs whose id is outside 0..E-1 (other expert-parallel shards) are left out.
    ``chunked`` (None: :data:`MOE_PLAN_CHUNKED`) picks the chunked kernels past decode sizes.
    """
    if topk_ids.device.type != "cuda" and not _INTERPRET_HOST:
        return moe_plan_torch(topk_ids, num_experts, BM)
    if num_experts < 1 or BM < 1 or BM & (BM - 1):
        raise ValueError(f"moe_plan: expected num_experts >= 1 and BM a power of two; found "
                         f"num_experts={num_experts}, BM={BM}")
    flat = flat_ids(topk_ids)
    P = flat.numel()
    E = num_experts
    nb = triton.cdiv(P, BM) + min(E, P)
    pairs = torch.empty(nb * BM, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=flat.device)
    if P == 0:
        return pairs, block_expert
    if P <= SMALL_PLAN_MAX_PAIRS:
        pp = max(16, triton.next_power_of_2(P))
        _moe_plan_small_kernel[(1,)](flat, pairs, block_expert, P, E, nb, BM=BM, PP=pp,
                                     NBP=max(16, triton.next_power_of_2(nb)), RB=256,
                                     num_warps=4, **pdl_args(flat))
        return pairs, block_expert
    if MOE_PLAN_CHUNKED if chunked is None else chunked:
        _plan_chunked(flat, pairs, block_expert, E, BM, nb)
        return pairs, block_expert
    # Histogram bins: E real ones + bin E for skipped ids; >= 32 for the GPU lowering.
    nbins = max(32, triton.next_power_of_2(E + 1))
    bp = min(1024, max(64, triton.next_power_of_2(P)))
    _moe_plan_kernel[(E + 1,)](flat, pairs, block_expert, P, E, nb, BM=BM, NBINS=nbins, BP=bp,
                               BF=256, num_warps=4, **pdl_args(flat))
    return pairs, block_expert


def _plan_chunked(flat: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor, E: int,
                  BM: int, nb: int) -> None:
    """:func:`moe_plan` past decode sizes in three launches over chunks of pairs."""
    # Chunks of PLAN_CHUNK pairs: count (histogram, padding rows), prefix over chunks (BB bins
    # a program), scatter (ranks within the chunk, the block map).  Bins: E real ones + bin E for
    # skipped ids; >= 32 for the GPU lowering.
    P, dev = flat.numel(), flat.device
    nbins = max(32, triton.next_power_of_2(E + 1))
    bp = PLAN_CHUNK
    chunks = triton.cdiv(P, bp)
    hist = torch.empty(chunks, nbins, dtype=torch.int32, device=dev)
    before = torch.empty_like(hist)
    first = torch.empty_like(hist)
    counts = torch.empty(nbins, dtype=torch.int32, device=dev)
    rows = nb * BM
    _plan_count_kernel[(chunks,)](flat, hist, pairs, P, E, rows, triton.cdiv(rows, chunks),
                                  NBINS=nbins, BP=bp, BF=256, num_warps=4, **pdl_args(flat))
    bb = 32
    _plan_prefix_kernel[(nbins // bb,)](hist, before, counts, chunks, NBINS=nbins, BB=bb, CB=64,
                                        num_warps=4, **pdl_args(flat))
    _plan_scatter_kernel[(chunks,)](flat, before, counts, first, pairs, block_expert, P, E, nb,
                                    triton.cdiv(nb, chunks), BM=BM, NBINS=nbins, BP=bp, BS=16,
                                    num_warps=4, **pdl_args(flat))


def moe_plan_torch(topk_ids: torch.Tensor, num_experts: int, BM: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of :func:`moe_plan` (about ten torch ops incl. a stable sort; no host
    sync)."""
    dev = topk_ids.device
    E = num_experts
    flat = topk_ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    nb = triton.cdiv(P, BM) + min(E, P)
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, key, torch.ones_like(key))
    blocks = (counts[:E] + BM - 1) // BM
    blk_end = torch.cumsum(blocks, 0)
    first_row = (blk_end - blocks) * BM                                     # [E]
    first_pair = torch.cumsum(counts, 0) - counts                           # [E+1]
    rank = torch.arange(P, device=dev) - first_pair[sorted_key]
    valid = sorted_key < E
    dest = torch.where(valid, first_row[sorted_key.clamp(max=E - 1)] + rank, nb * BM)
    pairs = torch.full((nb * BM + 1,), P, dtype=torch.int32, device=dev)
    pairs.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(blk_end, torch.arange(nb, device=dev), right=True)
    return pairs[:-1], block_expert.to(torch.int32)
