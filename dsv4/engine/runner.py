"""The model runner: every device decision of the engine lives here.

It sizes and owns the device cache (:class:`HybridCache`), turns a :class:`SchedulerOutput` into
one flattened variable-length :class:`StepContext`, runs ``model.forward`` and
``model.compute_logits``, clears the state slots of (re)admitted sequences, and samples.
The scheduler and the cache manager above it never see a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4.cache.formats import RECORD_DTYPE
from dsv4.cache.tensors import HybridCache
from dsv4.config import ModelConfig
from dsv4.dist.parallel import SINGLE, Parallel
from dsv4.engine.sampler import RowLogprobs, Sampler, SamplingRow
from dsv4.engine.scheduler import SchedulerOutput
from dsv4.engine.sequence import SeqKey, Sequence
from dsv4.model.context import StepContext

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
class StepPlan:
    """One forward step in plain Python lists: what rank 0 broadcasts to the tensor / expert
    parallel workers (pickled), and what every rank turns into the same :class:`StepContext`.
    ``reset_slots``: state slots cleared before the step (sequences (re)admitted)."""

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
               profile: Any = None) -> int:
    """Number of pages of the cache.

    Explicit ``num_pages`` wins; else ``kv_cache_memory`` bytes (minus the per-slot state);
    else on CUDA ``gpu_memory_utilization`` of the device after the weights and a profiling pass
    (``profile()`` returns its peak activation bytes); else on CPU enough pages for every
    sequence at max_model_len, within DEFAULT_CPU_CACHE_BYTES.  Raises ValueError when one
    sequence of max_model_len does not fit.
    """
    per_page = HybridCache.bytes_per_page(cfg, page_size, cache_dtype)
    per_slot = HybridCache.bytes_per_slot(cfg, cache_dtype)
    pages_one_seq = -(-max_model_len // page_size)
    per_page_or_one = max(per_page, 1)  # a model with no paged pool still gets page ids
    if num_pages is not None:
        chosen, source = num_pages, f"num_pages={num_pages}"
    elif kv_cache_memory is not None:
        chosen = (kv_cache_memory - per_slot * num_slots) // per_page_or_one
        source = f"kv_cache_memory={kv_cache_memory} bytes"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        peak = int(profile()) if profile is not None else 0
        in_use = total - free
        budget = int(total * gpu_memory_utilization) - in_use - peak - per_slot * num_slots
        chosen = max(0, budget) // per_page_or_one
        source = (f"gpu_memory_utilization={gpu_memory_utilization} of {total} bytes "
                  f"({in_use} in use, {peak} peak activations)")
    else:
        want = pages_one_seq * max_num_seqs
        afford = (DEFAULT_CPU_CACHE_BYTES - per_slot * num_slots) // per_page_or_one
        chosen = max(pages_one_seq, min(want, afford))
        source = f"the CPU default ({DEFAULT_CPU_CACHE_BYTES} bytes at most)"
    if chosen < pages_one_seq:
        raise ValueError(
            f"the KV cache is too small: {source} gives {max(chosen, 0)} pages of {page_size} "
            f"tokens ({per_page} bytes each), but one sequence of max_model_len={max_model_len} "
            f"needs {pages_one_seq} pages; raise the cache size or lower max_model_len")
    return int(chosen)


def profile_peak_bytes(model: Any, cfg: ModelConfig, *, device: torch.device,
                       cache_dtype: torch.dtype, page_size: int, num_tokens: int,
                       num_logits: int) -> int:
    """CUDA: peak activation bytes of one step of ``num_tokens`` tokens (one request) with
    ``num_logits`` logits rows, measured on a throw-away cache.  (First version: the GPU work
    refines it, e.g. with several requests and the sampler's buffers.)"""
    pages = -(-num_tokens // page_size)
    cache = HybridCache.allocate(cfg, num_pages=pages, num_slots=1, page_size=page_size,
                                 dtype=cache_dtype, device=device)
    ids = [0] * num_tokens
    rows = list(range(num_tokens - min(num_logits, num_tokens), num_tokens))
    ctx = StepContext.build(ids, [num_tokens], [0], [0], [list(range(pages))],
                            logits_indices=rows, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        model.compute_logits(model.forward(ctx, cache))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache, ctx
    torch.cuda.empty_cache()
    return int(peak)


class ModelRunner:
    """Owns the model, the device cache and the sampler; runs one scheduled step at a time."""

    def __init__(self, model: Any, cfg: ModelConfig, *, device: torch.device,
                 cache_dtype: torch.dtype, num_pages: int, num_slots: int, page_size: int,
                 seed: int = 0, parallel: Parallel = SINGLE) -> None:
        self.model = model
        self.cfg = cfg
        # Under tensor / expert parallelism the driver (rank 0) broadcasts each StepPlan before
        # running it; the workers run the same plans (dsv4.dist.worker.run_worker).
        self.parallel = parallel
        self.device = device
        self.page_size = page_size
        self.cache = HybridCache.allocate(cfg, num_pages=num_pages, num_slots=num_slots,
                                          page_size=page_size, dtype=cache_dtype, device=device)
        self.sampler = Sampler(device, seed)
        self._generators: dict[SeqKey, torch.Generator] = {}

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

    def plan_step(self, out: SchedulerOutput) -> tuple[StepPlan, list[int], list[list[int]]]:
        """The step's :class:`StepPlan`, plus per scheduled sequence the logits row it samples
        from (−1 when it does not sample) and the chunk positions whose prompt logprobs it
        wants."""
        ids: list[int] = []
        types: list[int] = []
        seqlens, starts, slots, tables = [], [], [], []
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        prompt_positions: list[list[int]] = []
        for s in out.scheduled:
            seq, start, n = s.seq, s.start_pos, s.num_new_tokens
            base = len(ids)
            ids += seq.token_ids[start:start + n]
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
            self.parallel.broadcast_object(plan)
        if plan.reset_slots:
            self.cache.reset_slots(plan.reset_slots)
        return self.model.forward(self.context(plan), self.cache)

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduled step: forward, logits, sampling."""
        result = StepResult()
        if out.is_empty:
            return result
        plan, sample_rows, prompt_positions = self.plan_step(out)
        hidden = self.run_plan(plan)
        if all(r < 0 for r in sample_rows) and not any(prompt_positions):
            return result  # partial prefill chunks only: the cache is filled, no logits needed
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
            sampled = self.sampler.sample(logits[torch.tensor(picks, device=logits.device)], rows)
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
