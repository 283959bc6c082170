"""Independent work of one step on a second CUDA stream ("side lane").

A decode step at small batch is a chain of latency-bound kernels (a few µs each, most of the GPU
idle): branches that do not depend on each other — the shared expert next to the routed
experts — run concurrently when one of them is issued on a second stream.  Captured in a CUDA
graph, the fork / join become graph edges: a replay runs the two branches side by side.

    with side_lane(x.device, T) as lane:    # forks: the side stream waits for the main one
        shared = shared_expert(x)           # issued on the side stream (if lane is not None)
    routed = experts(x)                     # main stream, concurrently
    join_side_lane(x.device)                # the main stream waits for the side branch

Rules that keep the caching allocator safe without ``record_stream``: the side branch reads
tensors made on the main stream before the fork, and the main stream joins before it frees
them or reads what the branch made (the branch's tensors belong to the side stream's pool:
their blocks are reused only by later side work, which starts after a later fork).

Kernels that keep state across launches in shared buffers (the split-K arrival counters of
``triton_dense.splitk_counters``) key it by :func:`current_lane`, so two launches running
concurrently on the two lanes never share counters.

Two more lanes follow the same rules: :func:`branch_lane` forks a third stream off the side
lane (a V4 attention's compressor next to its indexer's scoring), and the comb lane
(:func:`deferred_comb`, :func:`comb_lane`, :func:`join_comb_lane`) runs each sublayer's mHC
Sinkhorn next to the sublayer, joined by the hc_post ops that read it.

Off CUDA, or with ``DSV4_SIDE_STREAM=0``, everything runs in order on the current stream.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["side_lane", "join_side_lane", "branch_lane", "branch_mark", "join_branch_lane",
           "current_lane",
           "side_stream_enabled",
           "deferred_comb", "comb_lane", "join_comb_lane", "comb_lane_active"]

# Steps of more tokens run in order: their kernels fill the GPU on their own (4 V4-Flash layers
# on the H200, 8K prefill: 86.9 ms with the side lane, 86.8 without; 1K: 28.3 vs 26.4).
SIDE_LANE_MAX_TOKENS = 512

_lane = 0
_streams: dict[torch.device, torch.cuda.Stream] = {}
# Per device: the main stream of the open fork (the join waits on the side stream there).
_forked: dict[torch.device, torch.cuda.Stream] = {}


def side_stream_enabled() -> bool:
    """False when ``DSV4_SIDE_STREAM=0`` (every branch then runs on the current stream)."""
    return os.environ.get("DSV4_SIDE_STREAM", "1") != "0"


def current_lane() -> int:
    """0 on the main stream, 1 inside :func:`side_lane`, 2 inside :func:`branch_lane`: the key
    of per-lane kernel state."""
    return _lane


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device=device)
    return s


@contextlib.contextmanager
def side_lane(device: torch.device, tokens: int = 1) -> Iterator[torch.cuda.Stream | None]:
    """Issue the body on the side stream of ``device`` after it waits for the current stream;
    yields that stream, or None (the body runs in order) off CUDA, when disabled, when already
    on the side lane, or for steps of more than :data:`SIDE_LANE_MAX_TOKENS` ``tokens``.  Pair
    with :func:`join_side_lane` before the main stream uses or frees anything the body
    touches."""
    global _lane
    if (device.type != "cuda" or not side_stream_enabled() or _lane
            or tokens > SIDE_LANE_MAX_TOKENS):
        yield None
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    _forked[device] = main
    _lane = 1
    try:
        with torch.cuda.stream(side):
            yield side
    finally:
        _lane = 0


def join_side_lane(device: torch.device) -> None:
    """Make the main stream of the last :func:`side_lane` fork wait for the side branch (no-op
    when nothing was forked)."""
    main = _forked.pop(device, None)
    if main is not None:
        main.wait_stream(_side_stream(device))


# A branch of the side lane (lane 2): inside it, two independent chains of the side branch run
# concurrently (a V4 attention's compressor next to its indexer's scoring and top-k).  Same
# rules as the side lane; its split-K counters are lane 2's.
_branch_streams: dict[torch.device, torch.cuda.Stream] = {}
_branch_forked: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def branch_lane(device: torch.device, tokens: int = 1) -> Iterator[torch.cuda.Stream | None]:
    """Inside :func:`side_lane` only: issue the body on a third stream after it waits for the
    side stream; yields it, or None (in order) anywhere else, when disabled
    (``DSV4_BRANCH_LANE=0``, or the side lane off) or above :data:`SIDE_LANE_MAX_TOKENS`.
    Pair with :func:`join_branch_lane` before the side branch uses what the body made."""
    global _lane
    if (device.type != "cuda" or _lane != 1 or tokens > SIDE_LANE_MAX_TOKENS
            or os.environ.get("DSV4_BRANCH_LANE", "1") == "0"):
        yield None
        return
    side = torch.cuda.current_stream(device)
    branch = _branch_streams.get(device)
    if branch is None:
        branch = _branch_streams[device] = torch.cuda.Stream(device=device)
    branch.wait_stream(side)
    _branch_forked[device] = side
    _lane = 2
    try:
        with torch.cuda.stream(branch):
            yield branch
    finally:
        _lane = 1


def branch_mark(device: torch.device) -> torch.cuda.Event | None:
    """Inside :func:`branch_lane`: an event after the work the body has issued so far, which
    the side lane may wait for (``wait_event``) before the whole branch is joined — the rest of
    the branch keeps running; None anywhere else (the work then ran in order).  The waiting side
    work may read only what the branch made before the mark and persistent buffers (the cache),
    never the branch's transient tensors."""
    if _lane != 2:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def join_branch_lane(device: torch.device) -> None:
    """Make the side stream wait for the last :func:`branch_lane` body (no-op when none)."""
    side = _branch_forked.pop(device, None)
    if side is not None:
        side.wait_stream(_branch_streams[device])


# ------------------------------------------------------------------------------ the comb lane
# The mHC Sinkhorn of a sublayer (hc_pre's ``comb``, spec §3.4) is ~6 µs of serial scalar code
# in one program per token, and nothing reads comb before the sublayer's hc_post: inside a model
# step (:func:`deferred_comb`) the collapse kernel leaves it to a stream of its own, which runs
# it next to the sublayer.  The consumer joins first (:func:`join_comb_lane`: the hc_post ops), and
# the step's end joins whatever is left, so no comb escapes a step unfinished.
_comb_defer: dict[torch.device, bool] = {}
_comb_streams: dict[torch.device, torch.cuda.Stream] = {}
# Per device: tensors the lane's kernels read (made on the main stream), kept alive until the
# join so the caching allocator cannot hand their blocks to later main-stream work.
_comb_pending: dict[torch.device, list[torch.Tensor]] = {}


def _comb_lane_enabled() -> bool:
    return side_stream_enabled() and os.environ.get("DSV4_COMB_LANE", "1") != "0"


@contextlib.contextmanager
def deferred_comb(device: torch.device, tokens: int) -> Iterator[None]:
    """Around a model step of ``tokens`` tokens: lets the hc ops compute comb on the comb lane
    (CUDA, at most :data:`SIDE_LANE_MAX_TOKENS` tokens, unless ``DSV4_COMB_LANE=0`` or
    ``DSV4_SIDE_STREAM=0``); joins it on exit."""
    on = (device.type == "cuda" and tokens <= SIDE_LANE_MAX_TOKENS and _comb_lane_enabled()
          and not _comb_defer.get(device, False))
    if not on:
        yield
        return
    _comb_defer[device] = True
    try:
        yield
    finally:
        _comb_defer[device] = False
        join_comb_lane(device)


def comb_lane_active(device: torch.device) -> bool:
    """Whether hc ops on ``device`` may leave comb to the comb lane now (inside
    :func:`deferred_comb`, on the main lane)."""
    return _comb_defer.get(device, False) and not _lane


@contextlib.contextmanager
def comb_lane(device: torch.device, keep: tuple[torch.Tensor, ...]
              ) -> Iterator[torch.cuda.Stream]:
    """Issue the body on the comb lane after it waits for the current stream; ``keep``: the
    main-stream tensors the body reads or writes, held until :func:`join_comb_lane`."""
    main = torch.cuda.current_stream(device)
    lane = _comb_streams.get(device)
    if lane is None:
        lane = _comb_streams[device] = torch.cuda.Stream(device=device)
    lane.wait_stream(main)
    _comb_pending.setdefault(device, []).extend(keep)
    with torch.cuda.stream(lane):
        yield lane


def join_comb_lane(device: torch.device) -> None:
    """Make the current stream wait for the comb lane's pending work (no-op when none)."""
    pending = _comb_pending.pop(device, None)
    if pending:
        torch.cuda.current_stream(device).wait_stream(_comb_streams[device])
