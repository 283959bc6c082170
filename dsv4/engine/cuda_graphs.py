"""CUDA graphs of decode steps: one captured ``model.forward`` + ``compute_logits`` per bucket.

A decode step of R requests runs as the static-shape step of the smallest bucket B >= R
(``dsv4.model.context.decode_buckets``: 1, 2, 4, ... up to ``cuda_graph_max_batch``).  Its
inputs live in persistent device buffers that the graph reads at every replay:

* ``small`` [4, B_max] int64: rows ``input_ids``, ``start_pos`` (= the token positions),
  ``slots``, ``token_types`` (V4.1 image marks, −1 for text);
* ``block_tables`` [B_max, max_pages] int64.

Before a replay the runner writes the step's values (and the padding rows R..B−1: token 0 at
position 0 in the scratch slot and page) into a pinned host staging copy and copies it to the
device buffers in two transfers; everything else the step needs (window indices, compressed
entry rows, visible counts, ...) is derived on the device inside the graph
(``StepContext.static``).  The sampler stays outside: it reads the graph's logits output.

The engine captures every bucket when it starts (:meth:`DecodeGraphs.capture_all`, largest
first, through ``ModelRunner.capture_graphs``; engine option ``cuda_graph_capture="startup"``):
a capture is a warm-up run, the kernels' first compiles and the capture itself, seconds on a
full-size model, which must not stall a request's decode step.  With ``"lazy"`` a bucket is
captured on its first decode step instead (quicker start; only the batch sizes a workload
reaches cost graph memory).  All graphs share one memory pool.

On a CPU (or with graphs off) the same buffers drive an eager static-shape forward, which is
how the CPU tests exercise this path up to the capture itself.

Tensor / expert parallelism (``graphs_under_tp``): every rank holds a ``DecodeGraphs`` of the
same buckets and captures / replays the same bucket at the same step (the driver's plans say
which), so the graphs hold the same NCCL collectives in the same order.  The workers' graphs
stop at the hidden states (``with_logits=False``): only the driver samples.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

from dsv4.model.context import StaticShape, StepContext, bucket_for, decode_buckets

log = logging.getLogger("dsv4")

__all__ = ["DecodeGraphs"]

# Rows of the ``small`` buffer.
_IDS, _POS, _SLOT, _TYPE = range(4)


@dataclass
class _Captured:
    graph: Any          # torch.cuda.CUDAGraph
    logits: Tensor      # [B, vocab] fp32 (hidden [B, D] without logits), rewritten by replays
    ctx: StepContext    # keeps the captured plan tensors (graph-pool memory) referenced


class DecodeGraphs:
    """Persistent buffers and per-bucket CUDA graphs of static-shape decode steps.

    Args:
        model: the Transformer (``forward(ctx, cache)``, ``compute_logits(hidden)``).
        cache: the HybridCache, allocated with the scratch slot and page of ``static``.
        static: the static shape (block table width, scratch slot / page).
        max_batch: the largest bucket (``cuda_graph_max_batch``).
        use_graphs: capture and replay CUDA graphs (CUDA only); False runs the static-shape
            forward eagerly over the same buffers.
        with_token_types: pass the token-type row to the model (V4.1).
        with_logits: end the step with ``compute_logits`` (False: a tensor / expert parallel
            worker, whose step returns the hidden states [R, D]).
    """

    def __init__(self, model: Any, cache: Any, static: StaticShape, max_batch: int, *,
                 device: torch.device, use_graphs: bool, with_token_types: bool = False,
                 with_logits: bool = True) -> None:
        device = torch.device(device)
        if use_graphs and device.type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a CUDA device; got {device}")
        if static.scratch_slot >= cache.num_slots or static.scratch_page >= cache.num_pages:
            raise ValueError(f"DecodeGraphs: the cache ({cache.num_slots} slots, "
                             f"{cache.num_pages} pages) does not hold the scratch slot "
                             f"{static.scratch_slot} / page {static.scratch_page}")
        self.model = model
        self.cache = cache
        self.static = static
        self.device = device
        self.use_graphs = use_graphs
        self.with_token_types = with_token_types
        self.with_logits = with_logits
        self.buckets = decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        B, P = self.max_batch, static.max_pages
        pin = device.type == "cuda"
        self._small_host = torch.zeros(4, B, dtype=torch.int64, pin_memory=pin)
        self._tables_host = torch.full((B, P), -1, dtype=torch.int64, pin_memory=pin)
        self.small = torch.zeros(4, B, dtype=torch.int64, device=device)
        self.block_tables = torch.full((B, P), -1, dtype=torch.int64, device=device)
        self._arange = torch.arange(B + 1, dtype=torch.int64, device=device)
        self._copied: Any = None    # CUDA event of the last host->device copy
        self.graphs: dict[int, _Captured] = {}
        # fill_s / launch_s: host seconds spent filling the buffers and launching replays (the
        # host work of a replayed step besides planning; bench/tp_bench.py reports them).
        self.stats: dict[str, float] = {"replays": 0, "eager_static_steps": 0,
                                        "padded_rows": 0, "capture_s": 0.0,
                                        "capture_reserved_bytes": 0, "fill_s": 0.0,
                                        "launch_s": 0.0}
        self._pool: Any = None

    # ------------------------------------------------------------------ buffers
    def bucket(self, num_requests: int) -> int | None:
        """The bucket of a decode step of ``num_requests`` requests (None: too many)."""
        return bucket_for(num_requests, self.buckets)

    def check_tables(self, block_tables: Sequence[Sequence[int]]) -> None:
        """ValueError when a block table is wider than the static width."""
        P = self.static.max_pages
        for i, row in enumerate(block_tables):
            if len(row) > P:
                raise ValueError(f"DecodeGraphs: block table {i} has {len(row)} pages; the "
                                 f"static width is max_pages={P}")

    def _fill(self, B: int, input_ids: Sequence[int], start_pos: Sequence[int],
              slots: Sequence[int], block_tables: Sequence[Sequence[int]],
              token_types: Sequence[int] | None) -> None:
        """Write one step (rows 0..R−1) and its padding rows (R..B−1) into the buffers."""
        R = len(input_ids)
        if self._copied is not None:
            # The previous transfer must have left the staging copy before it is rewritten.
            self._copied.synchronize()
        small = self._small_host.numpy()
        tables = self._tables_host.numpy()
        small[_IDS, :R] = input_ids
        small[_POS, :R] = start_pos
        small[_SLOT, :R] = slots
        small[_TYPE, :R] = token_types if token_types is not None else -1
        small[_IDS, R:B] = 0
        small[_POS, R:B] = 0
        small[_SLOT, R:B] = self.static.scratch_slot
        small[_TYPE, R:B] = -1
        self.check_tables(block_tables)
        tables[:B] = -1
        for i, row in enumerate(block_tables):
            tables[i, :len(row)] = row
        tables[R:B, 0] = self.static.scratch_page
        nb = self.device.type == "cuda"
        self.small.copy_(self._small_host, non_blocking=nb)
        self.block_tables[:B].copy_(self._tables_host[:B], non_blocking=nb)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _context(self, B: int, host: tuple[list[int], list[int], list[list[int]]] | None = None
                 ) -> StepContext:
        """The static-shape step of bucket B over views of the buffers.

        ``host``: (start_pos, slots, block_tables) host lists of the B rows for the layers'
        validation; None (capture) means all padding rows."""
        kw: dict[str, Any] = {}
        if host is not None:
            kw = {"start_pos_host": host[0], "slots_host": host[1], "block_tables_host": host[2]}
        return StepContext.from_static_tensors(
            input_ids=self.small[_IDS, :B], start_pos=self.small[_POS, :B],
            slots=self.small[_SLOT, :B], block_tables=self.block_tables[:B], static=self.static,
            token_types=self.small[_TYPE, :B] if self.with_token_types else None,
            cu_seqlens=self._arange[:B + 1], logits_indices=self._arange[:B], **kw)

    def _forward(self, ctx: StepContext) -> Tensor:
        with torch.no_grad():
            hidden = self.model.forward(ctx, self.cache)
            return self.model.compute_logits(hidden) if self.with_logits else hidden

    # ------------------------------------------------------------------ capture
    def capture(self, B: int) -> None:
        """Capture the graph of bucket ``B`` (warm-up run first, on padding rows only)."""
        if not self.use_graphs:
            raise RuntimeError("DecodeGraphs.capture: graphs are off (eager static mode)")
        if B not in self.buckets:
            raise ValueError(f"DecodeGraphs.capture: {B} is not a bucket ({self.buckets})")
        if B in self.graphs:
            return
        t0 = time.perf_counter()
        # Cached free blocks released before and after: the difference of the reservations is
        # then what the graph's private pool keeps (the warm-up's blocks are released too).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved(self.device)
        self._fill(B, [], [], [], [], None)
        # Warm-up on a side stream (the recommended way): Triton compiles and autotunes, lazy
        # per-device tables (RoPE frequencies, FP4 lookup) are built before the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(self._context(B))
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        ctx = self._context(B)  # a fresh memo: its index tensors are computed inside the graph
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(ctx)
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize(self.device)
        self.graphs[B] = _Captured(graph, logits, ctx)
        torch.cuda.empty_cache()
        dt = time.perf_counter() - t0
        self.stats["capture_s"] += dt
        self.stats["capture_reserved_bytes"] += torch.cuda.memory_reserved(self.device) - reserved0
        log.info("dsv4 engine: captured the decode graph of batch %d in %.2f s", B, dt)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (its pool then serves the smaller ones)."""
        for B in sorted(self.buckets, reverse=True):
            self.capture(B)

    # ------------------------------------------------------------------ one step
    def run(self, input_ids: Sequence[int], start_pos: Sequence[int], slots: Sequence[int],
            block_tables: Sequence[Sequence[int]], token_types: Sequence[int] | None = None,
            ids_device: Tensor | None = None) -> Tensor:
        """Run one decode step of R requests (one token each); logits [R, vocab] fp32.

        With graphs the result is a view of the graph's output, valid until the next step.
        ``ids_device``: the R input tokens as a device tensor (the previous step's samples, not
        yet on the host), replacing ``input_ids``.  Raises ValueError when R exceeds the
        largest bucket.
        """
        R = len(input_ids)
        B = self._bucket_of(R)
        if not (len(start_pos) == len(slots) == len(block_tables) == R):
            raise ValueError(f"DecodeGraphs.run: input_ids, start_pos, slots and block_tables "
                             f"must have one entry per request; got {R}, {len(start_pos)}, "
                             f"{len(slots)}, {len(block_tables)}")
        if self.use_graphs and B not in self.graphs:
            self.capture(B)
        self.fill(B, input_ids, start_pos, slots, block_tables, token_types)
        if ids_device is not None:
            self.set_input_ids(ids_device)
        host = None
        if not self.use_graphs:
            pad = B - R
            host = (list(start_pos) + [0] * pad, list(slots) + [self.static.scratch_slot] * pad,
                    [list(b) for b in block_tables] + [self.static.pad_table()] * pad)
        return self.launch(B, R, host)

    def _bucket_of(self, R: int) -> int:
        B = self.bucket(R)
        if R == 0 or B is None:
            raise ValueError(f"DecodeGraphs: {R} requests; expected 1..{self.max_batch}")
        return B

    def fill(self, B: int, input_ids: Sequence[int], start_pos: Sequence[int],
             slots: Sequence[int], block_tables: Sequence[Sequence[int]],
             token_types: Sequence[int] | None = None) -> None:
        """Write one step of R <= B requests and its padding rows into the buffers."""
        t0 = time.perf_counter()
        with record_function("dsv4.graph_fill"):
            self._fill(B, input_ids, start_pos, slots, block_tables, token_types)
        self.stats["fill_s"] += time.perf_counter() - t0

    def set_input_ids(self, ids: Tensor) -> None:
        """Overwrite the filled rows' input tokens with ``ids`` [R] (a device copy, in stream
        order: a pipelined step feeds the previous step's samples without a host round trip)."""
        self.small[_IDS, :ids.shape[0]].copy_(ids)

    def share(self, parallel: Any, B: int) -> None:
        """Tensor / expert parallelism: rank 0's filled buffers of bucket B into every rank's
        (tensor broadcasts on the stream, before the replay that reads them)."""
        parallel.broadcast_tensor(self.small)
        parallel.broadcast_tensor(self.block_tables[:B])

    def launch(self, B: int, R: int,
               host: tuple[list[int], list[int], list[list[int]]] | None = None) -> Tensor:
        """The step of bucket B over the filled buffers (R real rows): the graph's replay, or
        (graphs off) the static-shape forward; ``host`` (start_pos, slots, block_tables of the
        B rows) for the eager forward's validation (None: read back from the buffers)."""
        self.stats["padded_rows"] += B - R
        if self.use_graphs:
            captured = self.graphs[B]
            t1 = time.perf_counter()
            with record_function("dsv4.graph_replay"):
                captured.graph.replay()
            self.stats["launch_s"] += time.perf_counter() - t1
            self.stats["replays"] += 1
            return captured.logits[:R]
        if host is None:
            host = (self.small[_POS, :B].tolist(), self.small[_SLOT, :B].tolist(),
                    self.block_tables[:B].tolist())
        self.stats["eager_static_steps"] += 1
        return self._forward(self._context(B, host))[:R]

    def pool_bytes(self) -> int:
        """Device memory the captures added to the allocator's reservations (cached blocks
        released around each capture: the graphs' shared pool), 0 before any capture."""
        return int(self.stats["capture_reserved_bytes"])
