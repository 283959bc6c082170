"""Triton kernel of the Lightning indexer's top-k (spec §3.8, §4.5 item 7); same signature and
output as the twin ``dsv4/ops/torch_attn.py::topk_indices``.

The twin sorts every row twice (a stable descending sort of the scores, then an ascending sort of
the picked ids).  Here nothing is sorted:

1. **keys**: each fp32 score becomes a uint32 whose unsigned order is the float order (negative
   values: all bits flipped; others: the sign bit set).  −0.0 is first made +0.0, since the
   twin's sort holds the two equal.
2. **radix select**: the k-th largest key of a row's ``n = min(n_visible, L)`` visible entries
   is found ``RADIX`` (5) bits at a time, high to low: a histogram (``tl.histogram``) of the
   next digit over the keys that match the bits found so far, then the highest bin whose count
   from the top reaches the number still wanted.  5-bit digits: ``tl.histogram`` costs one warp
   vote per bit plus, per 32 bins, one popcount per bit left, so 32 bins resolve a bit ~3×
   cheaper than 256.  When the chosen bin holds at most half the keys still in play, its keys
   are compacted into a per-program scratch buffer and the next passes read only them; once it
   holds at most ``FIN`` (32) keys, the threshold is read off them directly (each key's count of
   larger keys).  (A row held in registers skips the compaction when the launch has few
   programs: each one is a round trip through L2, and latency, not instructions, then sets the
   time.)  The result: the threshold key, and ``rem``, how many entries equal to it are taken
   (1 ≤ rem ≤ its count).
3. **emit**: one pass in entry order takes every entry above the threshold and the first
   ``rem`` entries equal to it (``tl.cumsum`` ranks within a block, running counts across
   blocks) and stores each taken id at its rank: the ids come out ascending, exactly the
   stable sort's first k, re-sorted.

Rows with ``n <= k`` take every visible entry (ids ``0..n−1``) with no selection; slots past
the picks hold −1.  A row of up to ``block`` entries is loaded once and kept in registers.

Longer rows, two ways (chosen by shape, :func:`topk_indices_with_block`):

* **stream** (one launch, one program per row): the passes over the whole row re-read it block
  by block (from L2).  Best when there are rows enough to fill the GPU.
* **split** (two launches, few long rows): the row is cut into chunks of ``block`` entries, one
  program each, and every chunk keeps its own top-k (keys and ids, in id order) in a candidate
  buffer; a second program per row selects the top-k of those candidates, which hold every
  entry of the row's top-k (an entry beaten by k entries of its own chunk is beaten in the
  row).  Chunks are laid out in entry order, so candidate order is id order: ties and the
  ascending output come out as in one pass over the row.

Entries at or past ``n_visible`` are never read: the contract (``indexer_scores``) scores them
−inf, and with that the result is the twin's for every input free of NaN (visible −inf entries
are taken, lowest ids first, when fewer than k entries score higher — as the twin does).  No
value of a tensor decides a shape or a launch: the op is safe inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.specialize import lengths
from dsv4.ops.triton_dense import sm_count, torch_twin_off_gpu

__all__ = ["MAX_REG_BLOCK", "topk_indices", "topk_indices_with_block"]

# Longest row held in registers (8 warps: 16 keys per thread); longer rows stream or split.
MAX_REG_BLOCK = 4096
_RADIX = 5            # bits per pass: 32 bins (see the module docstring)
_CAND_BLOCK = 256     # compacted keys are read in blocks of this many
_FIN = 32             # at most this many keys left in play: finish by direct ranks
# Compaction scratch (two halves of `cap` int32 keys per program) stays within this budget.
_SCRATCH_BYTES = 128 << 20


# ------------------------------------------------------------------------------ jit helpers
@triton.jit
def _order_keys(x):
    """fp32 → uint32 keys with the same order (−0.0 and +0.0 map to one key)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    # Negative: flip every bit (sign mask −1); else flip the sign bit only.
    flip = (bits >> 31) | -2147483648
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _load_keys(key_ptr, id_ptr, offs, lim, id_base, FROM_SCORES: tl.constexpr):
    """(keys, entry ids, valid) of slots ``offs`` of a source of ``lim`` slots: scores (entry id
    = id_base + offset) or a candidate list (int32 keys and ids; id −1 marks an empty slot)."""
    valid = offs < lim
    if FROM_SCORES:
        key = _order_keys(tl.load(key_ptr + offs, mask=valid, other=0.0))
        ids = id_base + offs
    else:
        key = tl.load(key_ptr + offs, mask=valid, other=0).to(tl.uint32, bitcast=True)
        ids = tl.load(id_ptr + offs, mask=valid, other=-1)
        valid = valid & (ids >= 0)
    return key, ids, valid


@triton.jit
def _digit_hist(key, valid, himask, prefix, shift, dmask, BINS: tl.constexpr):
    """Histogram of the digit ``(key >> shift) & dmask`` over the valid keys whose decided bits
    (``himask``) equal ``prefix``."""
    sel = valid & ((key & himask) == prefix)
    return tl.histogram(((key >> shift) & dmask).to(tl.int32), BINS, mask=sel)


@triton.jit
def _compact(dst, key, valid, himask, prefix, base):
    """Append the valid keys whose decided bits equal ``prefix`` to ``dst`` from ``base`` on, in
    order; returns the new end."""
    sel = (valid & ((key & himask) == prefix)).to(tl.int32)
    pos = base + tl.cumsum(sel, axis=0) - sel
    tl.store(dst + pos, key.to(tl.int32, bitcast=True), mask=sel != 0)
    return base + tl.sum(sel, axis=0)


@triton.jit
def _pick_digit(hist, prefix, rem, shift, BINS: tl.constexpr):
    """The bin b of the rem-th largest key in this pass's histogram: the highest bin whose count
    of keys in bins >= b reaches rem.  Returns (prefix with b at shift, how many keys of bin b
    are still wanted, how many keys bin b holds)."""
    bins = tl.arange(0, BINS)
    total = tl.sum(hist, axis=0)
    at_or_above = total - tl.cumsum(hist, axis=0) + hist   # non-increasing in b
    b = tl.sum((at_or_above >= rem).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    bucket = tl.sum(tl.where(bins == b, hist, 0), axis=0)
    return prefix | (b.to(tl.uint32) << shift), rem - above, bucket


@triton.jit
def _finish(buf, cnt, rem, FIN: tl.constexpr):
    """The rem-th largest of the cnt <= FIN keys in ``buf``: the key with fewer than rem keys
    above it and at least rem at or above it.  Returns (that key, rem − keys above it)."""
    offs = tl.arange(0, FIN)
    valid = offs < cnt
    kc = tl.load(buf + offs, mask=valid, other=0).to(tl.uint32, bitcast=True)
    other = kc[None, :]
    gt = tl.sum(((other > kc[:, None]) & valid[None, :]).to(tl.int32), axis=1)
    ge = tl.sum(((other >= kc[:, None]) & valid[None, :]).to(tl.int32), axis=1)
    ok = valid & (gt < rem) & (ge >= rem)
    thr = tl.max(tl.where(ok, kc, 0), axis=0)
    return thr, rem - tl.max(tl.where(ok, gt, 0), axis=0)


@triton.jit
def _emit(dst_ids, dst_keys, key, ids, valid, thr, rem, eq_seen, written,
          STORE_KEYS: tl.constexpr):
    """Store the ids (and keys, STORE_KEYS) of the block's taken entries — key > thr, or key ==
    thr among the first rem such of the source — at their ranks; returns the running counts."""
    eq = (valid & (key == thr)).to(tl.int32)
    eq_rank = eq_seen + tl.cumsum(eq, axis=0) - eq
    take = (valid & (key > thr)) | ((eq != 0) & (eq_rank < rem))
    take_i = take.to(tl.int32)
    pos = written + tl.cumsum(take_i, axis=0) - take_i
    tl.store(dst_ids + pos, ids.to(dst_ids.dtype.element_ty), mask=take)
    if STORE_KEYS:
        tl.store(dst_keys + pos, key.to(tl.int32, bitcast=True), mask=take)
    return eq_seen + tl.sum(eq, axis=0), written + tl.sum(take_i, axis=0)


@triton.jit
def _select(key_ptr, id_ptr, lim, id_base, K, dst_ids, dst_keys, work, cap,
            FROM_SCORES: tl.constexpr, STORE_KEYS: tl.constexpr, IN_REGS: tl.constexpr,
            COMPACT: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr, FIN: tl.constexpr,
            RADIX: tl.constexpr):
    """Top-K of a source of lim slots (see :func:`_load_keys`) holding more than K valid entries,
    into ``dst_ids`` (and ``dst_keys``) in slot order.  IN_REGS: lim <= BLOCK, the source is
    loaded once; else it is re-read block by block.  ``work``: 2·cap int32 of scratch, used
    unless the source is in registers and not COMPACT (fewer instructions with it, but each
    compaction is a round trip through L2: a lone row in registers finishes sooner without)."""
    BINS: tl.constexpr = 1 << RADIX
    PASSES: tl.constexpr = (32 + RADIX - 1) // RADIX
    if IN_REGS:
        key_r, ids_r, valid_r = _load_keys(key_ptr, id_ptr, tl.arange(0, BLOCK), lim, id_base,
                                           FROM_SCORES)
    prefix = tl.full((), 0, tl.uint32)    # the threshold's bits found so far
    himask = tl.full((), 0, tl.uint32)    # which bits those are
    hi = tl.full((), 32, tl.int32)        # bits >= hi are decided
    rem = K + tl.full((), 0, tl.int32)
    cnt = tl.full((), -1, tl.int32)       # keys in play in the scratch (−1: the whole source)
    half = tl.full((), 0, tl.int32)       # scratch half holding them
    done = tl.full((), 0, tl.int32)
    for _ in range(PASSES):
        if done == 0:
            shift = tl.maximum(hi - RADIX, 0)
            dmask = ((1 << (hi - shift)) - 1).to(tl.uint32)
            ushift = shift.to(tl.uint32)
            hist = tl.zeros((BINS,), tl.int32)
            if cnt < 0:
                if IN_REGS:
                    hist = _digit_hist(key_r, valid_r, himask, prefix, ushift, dmask, BINS)
                else:
                    for start in range(0, lim, BLOCK):
                        key, ids, valid = _load_keys(key_ptr, id_ptr, start + tl.arange(0, BLOCK),
                                                     lim, id_base, FROM_SCORES)
                        hist += _digit_hist(key, valid, himask, prefix, ushift, dmask, BINS)
            else:
                for start in range(0, cnt, CB):
                    offs = start + tl.arange(0, CB)
                    key = tl.load(work + half * cap + offs, mask=offs < cnt, other=0)
                    hist += _digit_hist(key.to(tl.uint32, bitcast=True), offs < cnt, himask,
                                        prefix, ushift, dmask, BINS)
            prefix, rem, bucket = _pick_digit(hist, prefix, rem, ushift, BINS)
            himask = himask | (dmask << ushift)
            hi = shift
            if shift == 0:
                done = 1
            elif COMPACT or not IN_REGS:
                in_play = tl.where(cnt < 0, lim, cnt)
                if (bucket <= FIN) | ((bucket <= cap) & (2 * bucket <= in_play)):
                    # Keep only the chosen bin's keys (into the other half of the scratch).
                    dst = work + (1 - half) * cap
                    end = tl.full((), 0, tl.int32)
                    if cnt < 0:
                        if IN_REGS:
                            end = _compact(dst, key_r, valid_r, himask, prefix, end)
                        else:
                            for start in range(0, lim, BLOCK):
                                key, ids, valid = _load_keys(key_ptr, id_ptr,
                                                             start + tl.arange(0, BLOCK), lim,
                                                             id_base, FROM_SCORES)
                                end = _compact(dst, key, valid, himask, prefix, end)
                    else:
                        for start in range(0, cnt, CB):
                            offs = start + tl.arange(0, CB)
                            key = tl.load(work + half * cap + offs, mask=offs < cnt, other=0)
                            end = _compact(dst, key.to(tl.uint32, bitcast=True), offs < cnt,
                                           himask, prefix, end)
                    tl.debug_barrier()   # the compacted keys are read by other threads next
                    half = 1 - half
                    cnt = bucket
                    if bucket <= FIN:
                        prefix, rem = _finish(work + half * cap, cnt, rem, FIN)
                        done = 1
    if IN_REGS:
        _emit(dst_ids, dst_keys, key_r, ids_r, valid_r, prefix, rem, 0, 0, STORE_KEYS)
    else:
        eq_seen = tl.full((), 0, tl.int32)
        written = tl.full((), 0, tl.int32)
        for start in range(0, lim, BLOCK):
            key, ids, valid = _load_keys(key_ptr, id_ptr, start + tl.arange(0, BLOCK), lim,
                                         id_base, FROM_SCORES)
            eq_seen, written = _emit(dst_ids, dst_keys, key, ids, valid, prefix, rem, eq_seen,
                                     written, STORE_KEYS)


@triton.jit
def _take_all(out_row, n, K, BLOCK_K: tl.constexpr):
    """A row with n <= K visible entries: ids 0..n−1, then −1 up to K."""
    for start in range(0, K, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        tl.store(out_row + j, tl.where(j < n, j, -1).to(tl.int64), mask=j < K)


# ------------------------------------------------------------------------------ kernels
@triton.jit(**lengths("L", "stride_s"))
def _topk_rows_kernel(scores_ptr, nvis_ptr, out_ptr, work_ptr, L, stride_s, K, cap,
                      BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, STREAM: tl.constexpr,
                      COMPACT: tl.constexpr, CB: tl.constexpr, FIN: tl.constexpr,
                      RADIX: tl.constexpr, PDL: tl.constexpr = False):
    """One program per row.  STREAM: rows may be longer than BLOCK (compiled in if L > BLOCK)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(nvis_ptr + t).to(tl.int32), 0), L)
    row = scores_ptr + t * stride_s
    out_row = out_ptr + t * K
    work = work_ptr + t * 2 * cap
    if n <= K:
        _take_all(out_row, n, K, BLOCK_K)
    elif STREAM and n > BLOCK:
        _select(row, row, n, 0, K, out_row, out_row, work, cap, True, False, False, COMPACT,
                BLOCK, CB, FIN, RADIX)
    else:
        _select(row, row, n, 0, K, out_row, out_row, work, cap, True, False, True, COMPACT,
                BLOCK, CB, FIN, RADIX)


@triton.jit(**lengths("L", "stride_s"))
def _topk_chunks_kernel(scores_ptr, nvis_ptr, out_ptr, cand_key_ptr, cand_id_ptr, work_ptr, L,
                        stride_s, K, KC, stride_c, cap, BLOCK: tl.constexpr,
                        BLOCK_K: tl.constexpr, COMPACT: tl.constexpr, CB: tl.constexpr,
                        FIN: tl.constexpr, RADIX: tl.constexpr, PDL: tl.constexpr = False):
    """Split, first launch: program (t, c) keeps the top-K of entries [c·BLOCK, (c+1)·BLOCK) of
    row t (all of them when fewer) in candidate slots [c·KC, (c+1)·KC), KC = min(K, BLOCK), id
    order, id −1 in unused slots.  A row that needs no merge (n <= BLOCK or n <= K) is finished
    here, into out, by its chunk 0."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(nvis_ptr + t).to(tl.int32), 0), L)
    row = scores_ptr + t * stride_s
    out_row = out_ptr + t * K
    work = work_ptr + (t * tl.num_programs(1) + c) * 2 * cap
    if n <= K:
        if c == 0:
            _take_all(out_row, n, K, BLOCK_K)
    elif n <= BLOCK:
        if c == 0:
            _select(row, row, n, 0, K, out_row, out_row, work, cap, True, False, True, COMPACT,
                    BLOCK, CB, FIN, RADIX)
    else:
        cn = tl.minimum(n - c * BLOCK, BLOCK)
        ck = cand_key_ptr + t * stride_c + c * KC
        ci = cand_id_ptr + t * stride_c + c * KC
        if cn > K:
            _select(row + c * BLOCK, row, cn, c * BLOCK, K, ci, ck, work, cap, True, True, True,
                    COMPACT, BLOCK, CB, FIN, RADIX)
        elif cn > 0:
            for start in range(0, KC, BLOCK_K):
                j = start + tl.arange(0, BLOCK_K)
                key = _order_keys(tl.load(row + c * BLOCK + j, mask=j < cn, other=0.0))
                tl.store(ck + j, key.to(tl.int32, bitcast=True), mask=j < KC)
                tl.store(ci + j, tl.where(j < cn, c * BLOCK + j, -1), mask=j < KC)


@triton.jit(**lengths("L"))
def _topk_merge_kernel(nvis_ptr, out_ptr, cand_key_ptr, cand_id_ptr, work_ptr, L, K, KC,
                       stride_c, cap, BLOCK: tl.constexpr, STREAM: tl.constexpr,
                       COMPACT: tl.constexpr, CB: tl.constexpr, FIN: tl.constexpr,
                       RADIX: tl.constexpr, PDL: tl.constexpr = False):
    """Split, second launch: the top-K of row t's candidates (the chunks that hold visible
    entries) into out; rows finished by the first launch are skipped."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(nvis_ptr + t).to(tl.int32), 0), L)
    if n > K and n > BLOCK:
        lim = tl.cdiv(n, BLOCK) * KC
        ck = cand_key_ptr + t * stride_c
        ci = cand_id_ptr + t * stride_c
        out_row = out_ptr + t * K
        work = work_ptr + t * 2 * cap
        if STREAM and lim > BLOCK:
            _select(ck, ci, lim, 0, K, out_row, out_row, work, cap, False, False, False, COMPACT,
                    BLOCK, CB, FIN, RADIX)
        else:
            _select(ck, ci, lim, 0, K, out_row, out_row, work, cap, False, False, True, COMPACT,
                    BLOCK, CB, FIN, RADIX)


# ------------------------------------------------------------------------------ host side
def _check_args(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or not scores.dtype.is_floating_point:
        raise ValueError(f"topk_indices: scores must be a 2-D float tensor [T, L]; found "
                         f"{scores.dtype} of shape {tuple(scores.shape)}")
    T = scores.shape[0]
    if tuple(n_visible.shape) != (T,) or n_visible.dtype.is_floating_point \
            or n_visible.dtype == torch.bool:
        raise ValueError(f"topk_indices: n_visible must be an integer tensor [{T}]; found "
                         f"{n_visible.dtype} of shape {tuple(n_visible.shape)}")
    if n_visible.device != scores.device:
        raise ValueError(f"topk_indices: scores and n_visible must share a device; found "
                         f"{scores.device} and {n_visible.device}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"topk_indices: k must be an int >= 0; found {k!r}")
    if max(scores.shape[1], k) >= 2 ** 30:
        raise ValueError(f"topk_indices: L ({scores.shape[1]}) and k ({k}) must stay below 2^30")


def _want_split(T: int, L: int, block: int, sms: int) -> bool:
    """Split long rows when one program per row would leave SMs idle.  Measured on the H200
    (k = 512): 16 rows of 16K entries split in 28 µs, stream in 50; 128 such rows stream in
    53 µs, split in 61-71; 256 rows stream in 77, split in 113+.  Rows of 16+ chunks gain
    more from the split (4 rows of 64K: 48 µs against 125)."""
    chunks = -(-L // block)
    return L > block and (2 * T <= sms or (T <= sms and chunks >= 8))


def _scratch_cap(programs: int, longest: int) -> int:
    """Keys one program may compact (a power of two, >= the finish size): up to its longest
    source, within :data:`_SCRATCH_BYTES` for all programs (8 bytes a key: two halves)."""
    fit = max(_CAND_BLOCK, _SCRATCH_BYTES // (8 * max(1, programs)))
    return max(_FIN, min(triton.next_power_of_2(longest), 1 << (fit.bit_length() - 1)))


def topk_indices_with_block(scores: torch.Tensor, n_visible: torch.Tensor, k: int,
                            block: int | None = None, split: bool | None = None,
                            num_warps: int | None = None, compact: bool | None = None
                            ) -> torch.Tensor:
    """:func:`topk_indices` with an explicit plan: ``block`` (a power of two) entries held in
    registers (``None``: :data:`MAX_REG_BLOCK`, or L's next power of two when shorter); longer
    rows ``split`` into chunks (two launches) or stream; whether sources held in registers
    ``compact`` the keys in play (``None`` for each: by shape, for the H200).  The tests pass a
    small block to reach the long-row paths at tiny L."""
    _check_args(scores, n_visible, k)
    T, L = scores.shape
    dev = scores.device
    out = torch.empty(T, k, dtype=torch.int64, device=dev)
    if T == 0 or k == 0:
        return out
    if L == 0:
        return out.fill_(-1)
    if block is None:
        block = min(MAX_REG_BLOCK, max(64, triton.next_power_of_2(L)))
    if block < 16 or block & (block - 1):
        raise ValueError(f"topk_indices: block must be a power of two >= 16; found {block}")
    if scores.dtype != torch.float32:
        scores = scores.float()          # exact, and the order (ties too) is unchanged
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    sms = sm_count(dev)
    if split is None:
        split = _want_split(T, L, block, sms)
    split = split and L > block
    # Few programs: latency counts (8 warps, no compaction round trips in registers); many:
    # throughput (4 warps, two programs an SM; compaction saves instructions).
    warps = num_warps or (8 if block >= 2048 and (split or T <= sms) else 4)
    block_k = min(1024, max(16, triton.next_power_of_2(k)))
    consts = {"CB": _CAND_BLOCK, "FIN": _FIN, "RADIX": _RADIX, "num_warps": warps}
    if not split:
        cap = _scratch_cap(T, L)
        work = torch.empty(T, 2 * cap, dtype=torch.int32, device=dev)
        _topk_rows_kernel[(T,)](scores, n_visible, out, work, L, scores.stride(0), k, cap,
                                BLOCK=block, BLOCK_K=block_k, STREAM=L > block,
                                COMPACT=T > sms if compact is None else compact, **consts,
                                **pdl_args(scores))
        return out
    chunks = triton.cdiv(L, block)
    kc = min(k, block)
    cand_keys = torch.empty(T, chunks * kc, dtype=torch.int32, device=dev)
    cand_ids = torch.empty(T, chunks * kc, dtype=torch.int32, device=dev)
    # The chunk programs' scratch; the merge of row t uses its chunks' share (cap·chunks keys).
    cap = _scratch_cap(T * chunks, block)
    work = torch.empty(T * chunks, 2 * cap, dtype=torch.int32, device=dev)
    _topk_chunks_kernel[(T, chunks)](scores, n_visible, out, cand_keys, cand_ids, work, L,
                                     scores.stride(0), k, kc, cand_keys.stride(0), cap,
                                     BLOCK=block,
                                     BLOCK_K=min(block_k, triton.next_power_of_2(kc)),
                                     COMPACT=T * chunks > sms if compact is None else compact,
                                     **consts, **pdl_args(scores))
    _topk_merge_kernel[(T,)](n_visible, out, cand_keys, cand_ids, work, L, k, kc,
                             cand_keys.stride(0), cap * chunks, BLOCK=block,
                             STREAM=chunks * kc > block,
                             COMPACT=T > sms if compact is None else compact, **consts,
                             **pdl_args(n_visible))
    return out


@torch_twin_off_gpu("dsv4.ops.torch_attn")
def topk_indices(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> torch.Tensor:
    """The ``min(k, n_visible[t])`` best entries of each row, as entry ids in ascending order.

    scores [T, L] fp32 (−inf at and past ``n_visible``, as ``indexer_scores`` writes them);
    n_visible [T] integer.  Ties go to the lowest entry id.  Returns [T, k] int64: the picks
    first (ascending entry id), −1 after them; bit-identical to the torch twin.
    """
    return topk_indices_with_block(scores, n_visible, k)
