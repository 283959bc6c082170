"""The model runner: every device decision of the engine lives here.

It sizes and owns the device cache (:class:`HybridCache`), turns a :class:`SchedulerOutput` into
one flattened variable-length :class:`StepContext`, runs ``model.forward`` and
``model.compute_logits``, clears the state slots of (re)admitted sequences, and samples.
The scheduler and the cache manager above it never see a tensor.

Decode steps (every scheduled sequence brings one token and samples) of at most
``cuda_graph_max_batch`` sequences run as static-shape steps replayed from CUDA graphs
(``dsv4.engine.cuda_graphs``); prefill and mixed steps, larger batches, CPU runs and
``enforce_eager`` run eagerly — with ``prefill_graphs``, prefill and mixed
steps of up to 1,024 tokens run as piecewise CUDA graphs (``dsv4.engine.prefill_graphs``: the
token-local ops replayed, the caches' part eager).  Under tensor / expert parallelism graphs need
``graphs_under_tp``: the driver announces a static step on the step channel
(``Parallel.send_static``), its filled input buffers are broadcast into the workers', and every
rank captures / replays the same bucket's graph, so the NCCL collectives inside the graphs
meet; the announcement and the buffer broadcasts stay outside the graphs.  Pipelined decode
(:meth:`ModelRunner.launch` / :meth:`ModelRunner.collect`) enqueues a static step and its
sampling without waiting, the next one taking the samples as input tokens on the device.
The cache holds one slot and one page more than the cache manager hands out: the scratch slot
and page of the padding rows of those steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.profiler import record_function

from dsv4.cache.formats import RECORD_DTYPE
from dsv4.cache.tensors import HybridCache
from dsv4.config import ModelConfig
from dsv4.dist.parallel import SINGLE, Parallel
from dsv4.engine.cuda_graphs import DecodeGraphs
from dsv4.engine.prefill_graphs import ENGINE_MAX_TOKENS, PREFILL_BUCKETS, PrefillGraphs
from dsv4.engine.sampler import (RowLogprobs, Sampler, SamplingRow, logprob_rows,
                                 logprob_tensors)
from dsv4.engine.scheduler import SchedulerOutput
from dsv4.engine.sequence import SeqKey, Sequence, SequenceStatus
from dsv4.model.context import StaticShape, StepContext, decode_buckets, pages_needed

log = logging.getLogger("dsv4")

# CPU cache budget when neither num_pages nor kv_cache_memory is given.
DEFAULT_CPU_CACHE_BYTES = 4 << 30


@dataclass
class StepResult:
    """What one step produced, keyed by sequence."""

    sampled: dict[SeqKey, int] = field(default_factory=dict)
    logprobs: dict[SeqKey, RowLogprobs] = field(default_factory=dict)
    # (prompt position, logprob info of the prompt token at that position)
    prompt_logprobs: dict[SeqKey, list[tuple[int, RowLogprobs]]] = field(default_factory=dict)


@dataclass
class InFlight:
    """A pipelined decode step whose samples are still on the device: ``tokens`` [R] in the
    order of ``out.scheduled``, and for the rows ``logprob_rows`` that asked for logprobs their
    device tensors (``sampler.logprob_tensors``) and top-N (read by :meth:`ModelRunner.collect`)."""

    out: SchedulerOutput
    tokens: torch.Tensor
    logprob_rows: list[int] = field(default_factory=list)
    logprobs: Any = None
    num_top: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    """One forward step in plain Python lists: what rank 0 broadcasts to the tensor / expert
    parallel workers (pickled), and what every rank turns into the same :class:`StepContext`.
    ``reset_slots``: state slots cleared before the step (sequences (re)admitted).  (Static
    decode steps go to the workers as a step-channel header and tensors instead.)"""

    input_ids: list[int]
    seqlens: list[int]
    start_pos: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    token_types: list[int] | None = None
    reset_slots: list[int] = field(default_factory=list)


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                        device: torch.device) -> torch.dtype:
    """Storage dtype of the cache for the user's ``kv_cache_dtype`` choice.

    "fp8": the official record formats (``RECORD_DTYPE``, dsv4.cache.formats); "auto": fp8
    records on CUDA, the model dtype elsewhere (the CPU path stays plain rows); "bf16": bf16 rows
    (a bf16 model only)."""
    if kv_cache_dtype == "auto":
        return RECORD_DTYPE if device.type == "cuda" else model_dtype
    if kv_cache_dtype == "bf16":
        if model_dtype != torch.bfloat16:
            # The model computes attention in its own dtype; a cache of another dtype would
            # need casts in every layer, which the model does not do.
            raise ValueError(f"kv_cache_dtype='bf16' needs dtype=bfloat16; the model runs in "
                             f"{model_dtype} (use kv_cache_dtype='auto' or 'fp8')")
        return torch.bfloat16
    if kv_cache_dtype == "fp8":
        return RECORD_DTYPE
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid; allowed: 'auto', 'bf16', 'fp8'")


def size_cache(cfg: ModelConfig, *, device: torch.device, cache_dtype: torch.dtype, page_size: int,
               num_slots: int, max_model_len: int, max_num_seqs: int, num_pages: int | None,
               kv_cache_memory: int | None, gpu_memory_utilization: float,
               profile: Callable[[], int] | None = None,
               graph_pool: Callable[[], int] | None = None) -> int:
    """Number of pages the cache manager hands out (the runner adds the scratch page and slot).

    Explicit ``num_pages`` wins; else ``kv_cache_memory`` bytes (minus the per-slot state);
    else on CUDA: ``total · gpu_memory_utilization − in use (weights, workspaces, other
    processes) − peak activations of a profiling step (``profile()``) − the CUDA graphs' pool
    (``graph_pool()``, an estimate) − per-slot state``, divided by the bytes of a page; else on
    CPU enough pages for every sequence at max_model_len, within DEFAULT_CPU_CACHE_BYTES.
    Raises ValueError when one sequence of max_model_len does not fit.
    """
    per_page = HybridCache.bytes_per_page(cfg, page_size, cache_dtype)
    per_slot = HybridCache.bytes_per_slot(cfg, cache_dtype)
    pages_one_seq = -(-max_model_len // page_size)
    per_page_or_one = max(per_page, 1)  # a model with no paged pool still gets page ids
    state_bytes = per_slot * (num_slots + 1)     # + the scratch slot
    if num_pages is not None:
        chosen, source = num_pages, f"num_pages={num_pages}"
    elif kv_cache_memory is not None:
        chosen = (kv_cache_memory - state_bytes) // per_page_or_one - 1
        source = f"kv_cache_memory={kv_cache_memory} bytes"
    elif device.type == "cuda":
        # Profile first: what it leaves cached (workspaces, Triton modules) is then "in use".
        peak = int(profile()) if profile is not None else 0
        graphs = int(graph_pool()) if graph_pool is not None else 0
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = int(total * gpu_memory_utilization) - in_use - peak - graphs - state_bytes
        chosen = max(0, budget) // per_page_or_one - 1
        source = (f"gpu_memory_utilization={gpu_memory_utilization} of {total} bytes "
                  f"({in_use} in use, {peak} peak activations, {graphs} CUDA-graph pool)")
        log.info("dsv4 memory: total %.2f GiB x %.2f - in use %.2f GiB - peak activations "
                 "%.2f GiB - graph pool %.2f GiB - state %.3f GiB (%d slots) = %.2f GiB for "
                 "pages of %d bytes -> %d pages", total / 2**30, gpu_memory_utilization,
                 in_use / 2**30, peak / 2**30, graphs / 2**30, state_bytes / 2**30,
                 num_slots + 1, max(0, budget) / 2**30, per_page, chosen)
    else:
        want = pages_one_seq * max_num_seqs
        afford = (DEFAULT_CPU_CACHE_BYTES - state_bytes) // per_page_or_one - 1
        chosen = max(pages_one_seq, min(want, afford))
        source = f"the CPU default ({DEFAULT_CPU_CACHE_BYTES} bytes at most)"
    if chosen < pages_one_seq:
        raise ValueError(
            f"the KV cache is too small: {source} gives {max(chosen, 0)} pages of {page_size} "
            f"tokens ({per_page} bytes each), but one sequence of max_model_len={max_model_len} "
            f"needs {pages_one_seq} pages; raise the cache size or lower max_model_len")
    return int(chosen)


def _measure_peak(device: torch.device, step: Callable[[], Any], transient: bool = False) -> int:
    """Peak bytes allocated by ``step()`` above what was allocated before it; ``transient``:
    above what is still allocated after it instead (buffers a step makes once and keeps, e.g.
    the experts' ahead scratch, are then counted as in use, not as activations too)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        step()
    torch.cuda.synchronize(device)
    base = max(before, torch.cuda.memory_allocated(device)) if transient else before
    return int(torch.cuda.max_memory_allocated(device) - base)


def profile_peak_bytes(model: Any, cfg: ModelConfig, *, device: torch.device,
                       cache_dtype: torch.dtype, page_size: int, num_tokens: int,
                       num_logits: int) -> int:
    """CUDA: peak activation bytes of one eager step of ``num_tokens`` tokens (one request,
    e.g. max_num_batched_tokens) with ``num_logits`` logits rows, on a throw-away cache."""
    pages = -(-num_tokens // page_size)
    cache = HybridCache.allocate(cfg, num_pages=pages, num_slots=1, page_size=page_size,
                                 dtype=cache_dtype, device=device)
    ids = [0] * num_tokens
    rows = list(range(num_tokens - min(num_logits, num_tokens), num_tokens))
    ctx = StepContext.build(ids, [num_tokens], [0], [0], [list(range(pages))],
                            logits_indices=rows, device=device)
    peak = _measure_peak(device, lambda: model.compute_logits(model.forward(ctx, cache)),
                         transient=True)
    del cache, ctx
    torch.cuda.empty_cache()
    return peak


def profile_decode_graph_bytes(model: Any, cfg: ModelConfig, *, device: torch.device,
                               cache_dtype: torch.dtype, page_size: int, max_model_len: int,
                               max_batch: int) -> int:
    """CUDA: an estimate of the CUDA graphs' shared pool: the peak bytes of one eager
    static-shape decode step at the largest bucket (padding rows only, on a throw-away cache
    of one page and one slot: a graph keeps what its step allocates), plus the logits outputs
    every bucket's graph keeps.  (The engine calls it only when graphs are on.)"""
    static = StaticShape(max_pages=pages_needed(max_model_len, page_size), scratch_slot=0,
                         scratch_page=0)
    cache = HybridCache.allocate(cfg, num_pages=1, num_slots=1, page_size=page_size,
                                 dtype=cache_dtype, device=device)
    buckets = decode_buckets(max_batch)
    B = buckets[-1]
    ctx = StepContext.static_decode([0], [0], [0], [static.pad_table()], B, static,
                                    token_types=[-1] if cfg.is_v41 else None, device=device)
    peak = _measure_peak(device, lambda: model.compute_logits(model.forward(ctx, cache)))
    del cache, ctx
    torch.cuda.empty_cache()
    return peak + sum(buckets) * cfg.vocab_size * 4


class ModelRunner:
    """Owns the model, the device cache and the sampler; runs one scheduled step at a time.

    ``num_pages`` / ``num_slots`` are the ids the cache manager hands out; the cache holds one
    more of each (the scratch page and slot of static-shape steps).  Decode steps:
    ``static_decode`` None (default) runs them as CUDA graphs on CUDA unless ``enforce_eager``
    (or under tensor / expert parallelism without ``graphs_under_tp``); True forces the
    static-shape steps (eagerly on a CPU: what the tests use to check them against the dynamic
    path, also under parallelism); False never uses them.
    ``cuda_graph_max_batch`` (default ``num_slots``) is the largest bucket; graphs are captured
    by :meth:`capture_graphs` (the engine calls it at start), else lazily, on the first decode
    step of each bucket (on every rank at the same step).
    ``prefill_graphs``: non-decode steps of up to ``prefill_max_tokens``
    tokens (at most :data:`ENGINE_MAX_TOKENS`) run piecewise (:class:`PrefillGraphs`; CUDA
    graphs unless ``enforce_eager`` or on a CPU, where the same segments run eagerly), captured
    by :meth:`capture_graphs` or lazily; a failed capture leaves them eager.
    Every rank of a parallel launch must be built with the same options.
    """

    def __init__(self, model: Any, cfg: ModelConfig, *, device: torch.device,
                 cache_dtype: torch.dtype, num_pages: int, num_slots: int, page_size: int,
                 seed: int = 0, parallel: Parallel = SINGLE, max_model_len: int | None = None,
                 enforce_eager: bool = False, cuda_graph_max_batch: int | None = None,
                 static_decode: bool | None = None, graphs_under_tp: bool = False,
                 prefill_graphs: bool = False, prefill_max_tokens: int = 2048) -> None:
        self.model = model
        self.cfg = cfg
        # Under tensor / expert parallelism the driver (rank 0) broadcasts each StepPlan before
        # running it; the workers run the same plans (dsv4.dist.worker.run_worker).
        self.parallel = parallel
        self.device = device
        self.page_size = page_size
        self.cache = HybridCache.allocate(cfg, num_pages=num_pages + 1, num_slots=num_slots + 1,
                                          page_size=page_size, dtype=cache_dtype, device=device)
        self.sampler = Sampler(device, seed)
        self._generators: dict[SeqKey, torch.Generator] = {}
        max_batch = num_slots if cuda_graph_max_batch is None else cuda_graph_max_batch
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch <= 0:
            raise ValueError(f"cuda_graph_max_batch={cuda_graph_max_batch!r} is invalid; allowed:"
                             f" an integer > 0 or None")
        use_graphs = device.type == "cuda" and not enforce_eager and (
            not parallel.enabled or graphs_under_tp)
        if static_decode is None:
            static_decode = use_graphs
        if static_decode and max_model_len is None:
            raise ValueError("ModelRunner: static_decode needs max_model_len (the block table "
                             "width of static-shape steps)")
        self.decode_graphs: DecodeGraphs | None = None
        # Host seconds of the step phases before a replay: planning and (driver of a parallel
        # launch) the step-channel announcement and the input buffers' broadcast; the replays'
        # fill / launch are in decode_graphs.stats (bench/tp_bench.py reports both per step).
        self.host_s: dict[str, float] = {"plan": 0.0, "broadcast": 0.0}
        self.graphs_disabled_reason: str | None = None   # set when a capture failed
        if static_decode:
            static = StaticShape(max_pages=pages_needed(max_model_len, page_size),
                                 scratch_slot=num_slots, scratch_page=num_pages)
            # Workers sample nothing: their graphs end at the hidden states (the head is
            # replicated and has no collective, so the graphs' collectives still match).
            self.decode_graphs = DecodeGraphs(
                model, self.cache, static, max_batch, device=device, use_graphs=use_graphs,
                with_token_types=cfg.is_v41, with_logits=parallel.is_driver)
        self.prefill_graphs: PrefillGraphs | None = None
        if prefill_graphs:
            prefill_max_tokens = min(prefill_max_tokens, ENGINE_MAX_TOKENS)
            # On a CPU the segments run eagerly (what the tests check); on a GPU without graphs
            # (enforce_eager, or parallel without graphs_under_tp) they would gain nothing.
            if prefill_max_tokens >= PREFILL_BUCKETS[0] and (device.type != "cuda" or use_graphs):
                self.prefill_graphs = PrefillGraphs(model, prefill_max_tokens,
                                                    use_graphs=use_graphs, cache=self.cache)

    # ------------------------------------------------------------------ per-sequence state
    def generator_for(self, seq: Sequence) -> torch.Generator | None:
        """The sequence's own generator when its request has a seed (``seed + index``)."""
        if seq.params.seed is None or seq.params.greedy:
            return None
        gen = self._generators.get(seq.key)
        if gen is None:
            gen = self.sampler.make_generator(seq.params.seed + seq.index)
            self._generators[seq.key] = gen
        return gen

    def release(self, key: SeqKey) -> None:
        """Forget a finished or aborted sequence (its generator)."""
        self._generators.pop(key, None)

    # ------------------------------------------------------------------ one step
    def build_context(self, out: SchedulerOutput) -> tuple[StepContext, list[int], list[list[int]]]:
        """The step's StepContext, plus per scheduled sequence the logits row it samples from
        (−1 when it does not sample) and the chunk positions whose prompt logprobs it wants."""
        plan, sample_rows, prompt_positions = self.plan_step(out)
        return self.context(plan), sample_rows, prompt_positions

    def context(self, plan: StepPlan) -> StepContext:
        """The StepContext of ``plan`` on this runner's device."""
        return StepContext.build(plan.input_ids, plan.seqlens, plan.start_pos, plan.slots,
                                 plan.block_tables, logits_indices=plan.logits_indices,
                                 token_types=plan.token_types, device=self.device)

    def plan_step(self, out: SchedulerOutput, pending: bool = False
                  ) -> tuple[StepPlan, list[int], list[list[int]]]:
        """The step's :class:`StepPlan`, plus per scheduled sequence the logits row it samples
        from (−1 when it does not sample) and the chunk positions whose prompt logprobs it
        wants.  ``pending``: a pipelined step whose input tokens are still on the device (the
        plan holds 0 in their place)."""
        ids: list[int] = []
        types: list[int] = []
        seqlens, starts, slots, tables = [], [], [], []
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        prompt_positions: list[list[int]] = []
        for s in out.scheduled:
            seq, start, n = s.seq, s.start_pos, s.num_new_tokens
            base = len(ids)
            chunk = seq.token_ids[start:start + n]
            if len(chunk) < n:
                if not pending:
                    raise RuntimeError(f"plan_step: sequence {seq.key} has no token at "
                                       f"positions {start}..{start + n - 1}")
                chunk = chunk + [0] * (n - len(chunk))
            ids += chunk
            if self.cfg.is_v41:
                types += seq.token_types_at(start, start + n)
            seqlens.append(n)
            starts.append(start)
            slots.append(s.slot)
            tables.append(s.block_table)
            positions: list[int] = []
            if s.prompt_logprobs:
                # Row p scores prompt token p + 1; only positions still missing.
                lo = max(start, seq.prompt_logprobs_next - 1)
                hi = min(start + n, seq.num_prompt_tokens - 1)
                positions = list(range(lo, hi))
            prompt_positions.append(positions)
            rows = [base + p - start for p in positions]
            if s.sample:
                # The last row of the chunk is past the prompt's second-to-last token, so it is
                # never one of the prompt rows.
                rows.append(base + n - 1)
                sample_rows.append(len(logits_rows) + len(rows) - 1)
            else:
                sample_rows.append(-1)
            logits_rows += rows
        if not logits_rows:
            # Only partial prefill chunks: the step fills the cache and needs no logits; ask
            # for one row anyway so the model never sees an empty selection.
            logits_rows = [len(ids) - 1]
        plan = StepPlan(ids, seqlens, starts, slots, [list(t) for t in tables], logits_rows,
                        types if self.cfg.is_v41 else None,
                        [s.slot for s in out.scheduled if s.reset_slot])
        return plan, sample_rows, prompt_positions

    @torch.no_grad()
    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """Reset the plan's slots and run the model forward: hidden [N, D] of its logits rows.
        The driver of a parallel launch first broadcasts the plan to the workers."""
        if self.parallel.enabled and self.parallel.is_driver:
            self.parallel.send(plan)
        if plan.reset_slots:
            self.cache.reset_slots(plan.reset_slots)
        ctx = self.context(plan)
        graphs = self.prefill_graphs
        if graphs is not None and graphs.serves(ctx):
            # A missing bucket is captured first, before the step touches the cache (every rank
            # runs this plan: they capture at the same step); a failure runs it eagerly.
            if (not graphs.use_graphs or graphs.captured(ctx.num_tokens)
                    or self._capture_prefill(graphs.bucket(ctx.num_tokens))):
                return graphs.forward(ctx, self.cache)
        return self.model.forward(ctx, self.cache)

    def _capture_prefill(self, bucket: int | None = None) -> bool:
        """Capture one prefill bucket (None: every bucket) on this rank; under parallelism
        the ranks agree over the control group.  False (prefill graphs turned off on every
        rank) when any capture failed."""
        graphs = self.prefill_graphs
        assert graphs is not None
        t0 = time.perf_counter()
        error = self._agreed_capture(
            graphs.capture_all if bucket is None else lambda: graphs.capture(bucket),
            "the prefill CUDA-graph capture")
        if error is not None:
            self._prefill_graphs_off(error)
            return False
        if bucket is None:
            log.info("dsv4 engine: captured the prefill graphs of %s tokens in %.1f s",
                     graphs.buckets, time.perf_counter() - t0)
        return True

    @torch.no_grad()
    def run_worker_step(self, plan: StepPlan) -> None:
        """A worker (rank > 0) runs the driver's dynamic ``plan``."""
        self.run_plan(plan)

    @torch.no_grad()
    def run_worker_static(self, header: list[int]) -> None:
        """A worker runs the driver's static decode step announced by ``header`` (bucket,
        rows, reset slots; the inputs arrive as tensors): graph capture / replay, or eagerly
        when graphs are off.  A capture that failed on some rank leaves the step to the
        driver's dynamic rerun, which follows."""
        graphs = self.decode_graphs
        if graphs is None or graphs.bucket(header[1]) != header[0]:
            raise ValueError(f"rank {self.parallel.rank}: the driver ran a static decode step "
                             f"of {header[1]} sequences (bucket {header[0]}) but this rank has "
                             f"no such bucket; every rank needs the same engine options")
        self._run_static(None, header)

    def static_bucket(self, plan: StepPlan, sample_rows: list[int],
                      prompt_positions: list[list[int]]) -> int | None:
        """The bucket of a step that runs as a static-shape decode step, else None: every
        sequence brings one token and samples from it, no prompt logprobs, at most the largest
        bucket of sequences."""
        graphs = self.decode_graphs
        if graphs is None:
            return None
        R = len(plan.seqlens)
        if any(n != 1 for n in plan.seqlens) or any(prompt_positions):
            return None
        if sample_rows != list(range(R)) or plan.logits_indices != list(range(R)):
            return None
        return graphs.bucket(R)

    def _run_static(self, plan: StepPlan | None, header: list[int] | None = None,
                    ids_device: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [R, vocab] of a static-shape decode step (graph replay on CUDA; hidden
        states on a worker); None when its graph could not be captured (graphs are then off
        for good: eager from here).  The driver passes its ``plan``, a worker the step-channel
        ``header`` [bucket, rows, number of reset slots, the slots...].

        Under parallelism the driver announces the step on the step channel, every rank
        captures the bucket's graph if it has none yet (then a vote over the control group:
        if any rank failed, every rank turns graphs off and the step is rerun dynamically),
        the driver fills its buffers and they are broadcast into the workers' (NCCL on GPUs:
        no pickling, no host round trip on the workers)."""
        graphs = self.decode_graphs
        assert graphs is not None
        par = self.parallel
        if plan is not None:
            R, resets = len(plan.seqlens), plan.reset_slots
            B = graphs.bucket(R)
            assert B is not None
        else:
            assert header is not None
            B, R = header[0], header[1]
            resets = header[3:3 + header[2]]
        if not par.enabled:
            assert plan is not None
            capturing = graphs.use_graphs and B not in graphs.graphs
            if resets:
                self.cache.reset_slots(resets)
            try:
                return graphs.run(plan.input_ids, plan.start_pos, plan.slots,
                                  plan.block_tables, plan.token_types, ids_device)
            except Exception as e:  # noqa: BLE001 - a failed capture must not stop serving
                if not capturing:
                    raise
                self._graphs_off(e)
                return None
        if plan is not None:
            # A bad plan raises here, before the workers hear of the step.
            graphs.check_tables(plan.block_tables)
            t0 = time.perf_counter()
            par.send_static([B, R, len(resets), *resets], 3 + graphs.max_batch)
            self.host_s["broadcast"] += time.perf_counter() - t0
        if graphs.use_graphs and B not in graphs.graphs:
            # Capture first (padding rows only: nothing of the step is touched), agree, then
            # run the step: a failed capture on any rank leaves the step to the dynamic rerun.
            error = self._agreed_capture(lambda: graphs.capture(B), "the CUDA-graph capture")
            if error is not None:
                self._graphs_off(error)
                return None
        if resets:
            self.cache.reset_slots(resets)
        if plan is not None:
            graphs.fill(B, plan.input_ids, plan.start_pos, plan.slots, plan.block_tables,
                        plan.token_types)
            if ids_device is not None:
                graphs.set_input_ids(ids_device)
        t0 = time.perf_counter()
        graphs.share(par, B)
        self.host_s["broadcast"] += time.perf_counter() - t0
        return graphs.launch(B, R)

    def capture_graphs(self) -> None:
        """Capture every decode bucket now (engine start; on every rank, in the same order).

        A failure on any rank (agreed over the control group) turns graphs off on all of them:
        decode then runs eagerly, as after a failed lazy capture."""
        pg = self.prefill_graphs
        if pg is not None and pg.use_graphs:
            self._capture_prefill()
        graphs = self.decode_graphs
        if graphs is None or not graphs.use_graphs:
            return
        t0 = time.perf_counter()
        error = self._agreed_capture(graphs.capture_all, "the CUDA-graph capture")
        if error is not None:
            self._graphs_off(error)
            return
        log.info("dsv4 engine: captured %d decode graphs (batch %s) in %.1f s",
                 len(graphs.buckets), graphs.buckets, time.perf_counter() - t0)

    def _agreed_capture(self, capture: Callable[[], None], what: str) -> Exception | None:
        """Run ``capture`` on this rank; under parallelism every rank's outcome is agreed over
        the control group.  None when it succeeded everywhere, else this rank's error (or
        "``what`` failed on another rank")."""
        error: Exception | None = None
        try:
            capture()
        except Exception as e:  # noqa: BLE001 - reported to the caller, on every rank
            error = e
        ok = 0 if error is not None else 1
        if self.parallel.enabled:
            ok = self.parallel.min_int(ok)
        if ok:
            return None
        return error or RuntimeError(f"{what} failed on another rank")

    def _prefill_graphs_off(self, e: BaseException) -> None:
        log.error("dsv4 engine: prefill CUDA-graph capture failed (%s: %s); prefill steps run "
                  "eagerly from now", type(e).__name__, e, exc_info=e)
        self.graphs_disabled_reason = f"prefill: {type(e).__name__}: {e}"
        self.prefill_graphs = None
        if self.device.type == "cuda":   # let a broken capture's queued work finish first
            torch.cuda.synchronize(self.device)

    def _graphs_off(self, e: BaseException) -> None:
        log.error("dsv4 engine: CUDA-graph capture failed (%s: %s); decode runs eagerly from "
                  "now", type(e).__name__, e, exc_info=e)
        self.graphs_disabled_reason = f"{type(e).__name__}: {e}"
        self.decode_graphs = None

    # ------------------------------------------------------------------ pipelined decode
    def pipelinable(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` can run as a pipelined decode step: a static-shape decode step of a
        bucket whose graph exists (or eager static steps), every row sampling without
        penalties (they need the output tokens on the host, the step before's included)."""
        graphs = self.decode_graphs
        if graphs is None or out.is_empty:
            return False
        R = len(out.scheduled)
        B = graphs.bucket(R)
        if B is None or (graphs.use_graphs and B not in graphs.graphs):
            return False
        for s in out.scheduled:
            p = s.seq.params
            if (s.num_new_tokens != 1 or not s.sample or s.prompt_logprobs
                    or p.has_penalties):
                return False
        return True

    @torch.no_grad()
    def launch(self, out: SchedulerOutput, after: InFlight | None = None) -> InFlight:
        """Enqueue a pipelinable decode step (:meth:`pipelinable`) and its sampling, without
        waiting for the device.  ``after``: the in-flight step whose samples are this step's
        input tokens (same sequences, same order), fed on the device."""
        t0 = time.perf_counter()
        plan, _, _ = self.plan_step(out, pending=after is not None)
        self.host_s["plan"] += time.perf_counter() - t0
        ids = None
        if after is not None:
            if [s.seq.key for s in after.out.scheduled] != [s.seq.key for s in out.scheduled]:
                raise ValueError("ModelRunner.launch: a pipelined step must follow a step of the "
                                 "same sequences")
            ids = after.tokens
        with record_function("dsv4.static_step"):
            logits = self._run_static(plan, ids_device=ids)
        assert logits is not None   # the bucket's graph exists (pipelinable): no capture here
        rows = [SamplingRow(params=s.seq.params, generator=self.generator_for(s.seq))
                for s in out.scheduled]
        with record_function("dsv4.sample"):
            tokens = self.sampler.sample_tokens(logits, rows)
            step = InFlight(out, tokens)
            want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
            if want:
                # Enqueued now: the next step's replay rewrites the logits buffer.
                idx = torch.tensor(want, device=logits.device)
                step.logprob_rows = want
                step.num_top = [rows[i].params.logprobs for i in want]
                step.logprobs = logprob_tensors(logits[idx], tokens[idx], max(step.num_top))
        return step

    def collect(self, step: InFlight) -> StepResult:
        """Wait for an in-flight step's samples: the result of its sequences that still run
        (one that finished or was aborted after the launch is left out)."""
        result = StepResult()
        with record_function("dsv4.collect"):
            tokens = step.tokens.tolist()
        for s, tok in zip(step.out.scheduled, tokens):
            if s.seq.status is SequenceStatus.RUNNING:
                result.sampled[s.seq.key] = tok
        if step.logprob_rows:
            got = logprob_rows([tokens[i] for i in step.logprob_rows], step.logprobs,
                               step.num_top)
            for i, lp in zip(step.logprob_rows, got):
                key = step.out.scheduled[i].seq.key
                if key in result.sampled:
                    result.logprobs[key] = lp
        return result

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduled step: forward, logits, sampling."""
        result = StepResult()
        if out.is_empty:
            return result
        # Labelled ranges: a torch.profiler trace splits the host's step time by them.
        t0 = time.perf_counter()
        with record_function("dsv4.plan_step"):
            plan, sample_rows, prompt_positions = self.plan_step(out)
        self.host_s["plan"] += time.perf_counter() - t0
        logits = None
        if self.static_bucket(plan, sample_rows, prompt_positions) is not None:
            with record_function("dsv4.static_step"):
                logits = self._run_static(plan)
        if logits is None:
            with record_function("dsv4.forward"):
                hidden = self.run_plan(plan)
            if all(r < 0 for r in sample_rows) and not any(prompt_positions):
                return result  # partial prefill chunks only: the cache is filled, no logits
            # The head is replicated: only the driver computes logits (the workers skip it).
            logits = self.model.compute_logits(hidden)

        rows: list[SamplingRow] = []
        keys: list[SeqKey] = []
        picks: list[int] = []
        for s, row in zip(out.scheduled, sample_rows):
            if row < 0:
                continue
            seq = s.seq
            p = seq.params
            rows.append(SamplingRow(
                params=p, generator=self.generator_for(seq),
                prompt_token_ids=seq.prompt_token_ids if p.repetition_penalty != 1.0 else None,
                output_token_ids=seq.output_token_ids if p.has_penalties else None))
            keys.append(seq.key)
            picks.append(row)
        if rows:
            with record_function("dsv4.sample"):
                sampled = self.sampler.sample(logits[torch.tensor(picks, device=logits.device)],
                                              rows)
            for key, tok, lp in zip(keys, sampled.token_ids, sampled.logprobs):
                result.sampled[key] = tok
                if lp is not None:
                    result.logprobs[key] = lp

        row0 = 0
        for s, positions in zip(out.scheduled, prompt_positions):
            if positions:
                seq = s.seq
                targets = [seq.token_ids[p + 1] for p in positions]
                got = self.sampler.prompt_logprobs(
                    logits[row0:row0 + len(positions)], targets, seq.params.prompt_logprobs)
                result.prompt_logprobs[seq.key] = [(p + 1, g) for p, g in zip(positions, got)]
            row0 += len(positions) + (1 if s.sample else 0)
        return result
