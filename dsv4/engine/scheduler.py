"""Continuous-batching scheduler (pure Python, no tensors).

Each step: decodes first (one token per running sequence), then running sequences whose prompt
is only partly in the cache, then new sequences from the waiting queue, all within
``max_num_batched_tokens`` tokens and ``max_num_seqs`` running sequences.  A prompt longer than
what is left of the token budget is split over several steps (chunked prefill) and shares each
step with the decodes.

Out of pages, the newest running sequence is preempted by recompute: its pages and slot are
freed, it goes back to the FRONT of the waiting queue, and later its prompt plus the tokens it
had generated are prefilled again.  Admission is first-come first-served, and no new sequence is
admitted on a step that had to preempt (that would only thrash).

A step that runs out of device memory (:meth:`Scheduler.on_out_of_memory`) preempts every
sequence it had scheduled, the same way, and halves the token budget of the next steps; the
budget grows back after a run of good steps.

Invariant that makes "newest running" well defined: the running list is ordered by arrival, and
every running sequence arrived before every waiting one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsv4.cache.manager import CacheManager
from dsv4.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's share of a step.

    The step feeds ``seq.token_ids[start_pos : start_pos + num_new_tokens]``.  ``sample`` is set
    when that reaches the last known token, so the step's last row samples the next token.
    ``prompt_logprobs`` asks for the logits of every row of the chunk.  ``reset_slot`` marks a
    sequence (re)admitted this step whose state slot must be cleared before the forward.
    """

    seq: Sequence
    start_pos: int
    num_new_tokens: int
    sample: bool
    prompt_logprobs: bool
    reset_slot: bool
    slot: int
    block_table: list[int]


@dataclass
class SchedulerOutput:
    """What one step runs, in batch order (decodes first), and who was preempted."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Args:
        manager: the page/slot allocator (``num_slots`` must be >= ``max_num_seqs``).
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most sequences running at once.
        max_model_len: most tokens (prompt + output) of one sequence.
    """

    def __init__(self, manager: CacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Scheduler: {name} must be a positive integer, got {value!r}")
        if manager.num_slots < max_num_seqs:
            raise ValueError(f"Scheduler: max_num_seqs={max_num_seqs} needs as many state slots; "
                             f"the cache has {manager.num_slots}")
        if manager.num_pages < manager.pages_for(max_model_len):
            raise ValueError(
                f"Scheduler: the cache has {manager.num_pages} pages of {manager.page_size} tokens "
                f"but one sequence of max_model_len={max_model_len} needs "
                f"{manager.pages_for(max_model_len)}")
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._next_arrival = 0
        self.num_preemptions = 0
        # Token budget after an out-of-memory step (None: the full max_num_batched_tokens) and
        # the good steps since it was last changed.
        self.oom_budget: int | None = None
        self._good_steps = 0

    # ------------------------------------------------------------------ queue changes
    def next_arrival(self) -> int:
        """A fresh arrival number (the engine stamps the sequences of one request with it)."""
        self._next_arrival += 1
        return self._next_arrival

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        if seq.num_tokens == 0:
            raise ValueError(f"request {seq.request_id!r}: empty prompt")
        if seq.num_tokens > self.max_model_len:
            raise ValueError(f"request {seq.request_id!r}: the prompt has {seq.num_tokens} tokens, "
                             f"more than max_model_len={self.max_model_len}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``seq`` (any state): free its cache and drop it from the queues."""
        if seq.is_finished:
            return
        self.manager.free(seq.key)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of ``request_id`` with reason "abort"; returns them."""
        seqs = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Decide what the next step computes (changes block tables, slots and queues)."""
        out = SchedulerOutput()
        chosen: dict[tuple[str, int], ScheduledSeq] = {}
        budget = self.max_num_batched_tokens if self.oom_budget is None else self.oom_budget

        # Decodes, then running sequences with an unfinished prefill, oldest first.
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.manager.ensure(seq.key, seq.num_computed_tokens + n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    # Cannot happen when num_pages covers max_model_len (checked in __init__)
                    # unless pages leaked; say so instead of looping.
                    raise RuntimeError(
                        f"scheduler: sequence {seq.key} alone needs more pages than are free "
                        f"({self.manager.num_free_pages} of {self.manager.num_pages})")
                budget += self._preempt(victim, chosen, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            chosen[seq.key] = self._make(seq, n, reset_slot=False)
            budget -= n

        # New (or preempted) sequences, strictly in queue order.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = min(seq.num_uncomputed_tokens, budget)
                if not self.manager.ensure(seq.key, seq.num_computed_tokens + n):
                    break
                self.manager.allocate_slot(seq.key)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                chosen[seq.key] = self._make(seq, n, reset_slot=True)
                budget -= n

        out.scheduled = list(chosen.values())
        for s in out.scheduled:
            # Block tables are read after all preemptions of this step are settled.
            s.block_table = self.manager.block_table(s.seq.key)
        return out

    def _make(self, seq: Sequence, n: int, reset_slot: bool) -> ScheduledSeq:
        start = seq.num_computed_tokens
        # Row p of the chunk scores prompt token p + 1; ask only for rows still missing (a
        # recompute after preemption does not redo them).
        want_prompt_lp = (seq.params.prompt_logprobs is not None and seq.index == 0
                          and seq.prompt_logprobs_next < seq.num_prompt_tokens
                          and start + n >= seq.prompt_logprobs_next)
        return ScheduledSeq(seq=seq, start_pos=start, num_new_tokens=n,
                            sample=start + n == seq.num_tokens, prompt_logprobs=want_prompt_lp,
                            reset_slot=reset_slot, slot=self.manager.slot(seq.key), block_table=[])

    def _preempt(self, seq: Sequence, chosen: dict, out: SchedulerOutput) -> int:
        """Preempt ``seq`` by recompute; returns the budget it had taken this step."""
        returned = 0
        taken = chosen.pop(seq.key, None)
        if taken is not None:
            returned = taken.num_new_tokens
        self.manager.free(seq.key)
        self.running.remove(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Front of the queue: it is older than everything waiting (see the module docstring).
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        return returned

    # ------------------------------------------------------------------ out of device memory
    # Good steps at a reduced budget before it doubles again.
    OOM_RECOVERY_STEPS = 32

    def on_out_of_memory(self, out: SchedulerOutput) -> bool:
        """The step ``out`` ran out of device memory before it finished.

        Its sequences may have written part of their cache state, so each is preempted by
        recompute (with every running sequence newer than it, keeping the running list the
        oldest ones); nothing they generated is lost.  The next steps get half the tokens of
        this one.  Returns False, changing nothing, when the step was already a single token:
        no smaller step exists and the caller must fail the request instead.
        """
        n = out.num_batched_tokens
        if n <= 1:
            return False
        self.oom_budget = max(1, n // 2)
        self._good_steps = 0
        keys = {s.seq.key for s in out.scheduled}
        preempted = SchedulerOutput()
        while any(s.key in keys for s in self.running):
            self._preempt(self.running[-1], {}, preempted)
        out.preempted.extend(preempted.preempted)
        return True

    def note_step_done(self) -> None:
        """A step finished: after OOM_RECOVERY_STEPS good steps a reduced budget doubles."""
        if self.oom_budget is None:
            return
        self._good_steps += 1
        if self._good_steps >= self.OOM_RECOVERY_STEPS:
            self._good_steps = 0
            grown = self.oom_budget * 2
            self.oom_budget = None if grown >= self.max_num_batched_tokens else grown

    # ------------------------------------------------------------------ after the step
    def update(self, out: SchedulerOutput, sampled: dict[tuple[str, int], int],
               eos_token_id: int | None) -> list[Sequence]:
        """Account for a finished step: advance the computed counts, append sampled tokens and
        apply the token-level stop conditions (eos, stop_token_ids, max_tokens, max_model_len).

        ``sampled`` maps the key of every scheduled sequence with ``sample`` set to its new
        token.  Returns the sequences that finished (their cache is already freed).
        """
        finished: list[Sequence] = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens = s.start_pos + s.num_new_tokens
            if not s.sample:
                continue
            if seq.key not in sampled:
                raise RuntimeError(f"scheduler: no sampled token for sequence {seq.key}")
            token = sampled[seq.key]
            seq.append_token(token)
            reason = self._stop_reason(seq, token, eos_token_id)
            if reason is not None:
                self.finish(seq, *reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int,
                     eos_token_id: int | None) -> tuple[str, int | None] | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and eos_token_id is not None and token == eos_token_id:
                return ("stop", None)
            if token in p.stop_token_ids:
                return ("stop", token)
        if self._length_stop(seq, 0):
            return ("length", None)
        return None

    def _length_stop(self, seq: Sequence, more: int) -> bool:
        """Whether ``seq`` is at a length limit (max_tokens, max_model_len) once it holds
        ``more`` tokens beyond its current ones."""
        p = seq.params
        if p.max_tokens is not None and seq.num_output_tokens + more >= p.max_tokens:
            return True
        return seq.num_tokens + more >= self.max_model_len

    def next_decode(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after the in-flight decode step ``out`` (pipelined decode: its tokens
        are not sampled yet), assuming each of its sequences goes on; takes the page the next
        position needs.  None when anything waits for admission, another sequence runs, a
        sequence stops at ``out`` whatever its token (length limits), or a page is missing:
        the step after ``out`` is then scheduled the normal way."""
        if self.waiting or len(self.running) != len(out.scheduled):
            return None
        nxt = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING or self._length_stop(seq, 1):
                return None
            nxt.append(ScheduledSeq(seq=seq, start_pos=s.start_pos + 1, num_new_tokens=1,
                                    sample=True, prompt_logprobs=False, reset_slot=False,
                                    slot=s.slot, block_table=[]))
        for n in nxt:
            if not self.manager.ensure(n.seq.key, n.start_pos + 1):
                return None
            n.block_table = self.manager.block_table(n.seq.key)
        return SchedulerOutput(scheduled=nxt)

    def check_invariants(self) -> None:
        """Raise RuntimeError when queues, statuses and cache holdings disagree (for tests)."""
        self.manager.check_consistency()
        arrivals = [(s.arrival, s.index) for s in self.running]
        if arrivals != sorted(arrivals):
            raise RuntimeError(f"scheduler: running list out of arrival order: {arrivals}")
        if self.running and self.waiting and min(
                (s.arrival, s.index) for s in self.waiting) < arrivals[-1]:
            raise RuntimeError("scheduler: a waiting sequence is older than a running one")
        for s in self.running:
            if s.status is not SequenceStatus.RUNNING or not self.manager.has_slot(s.key):
                raise RuntimeError(f"scheduler: running sequence {s.key} has no slot/status")
        for s in self.waiting:
            if self.manager.has_slot(s.key) or self.manager.num_pages_held(s.key):
                raise RuntimeError(f"scheduler: waiting sequence {s.key} holds cache")
        holders = set(self.manager.holders())
        if holders - {s.key for s in self.running}:
            raise RuntimeError(f"scheduler: cache held by non-running {holders}")
