"""Scheduler without a model: a fake step checks every batch and samples a token that depends
on the whole token history, so any mix-up between sequences changes the outputs."""

from __future__ import annotations

import random

import pytest

from dsv4.cache.manager import CacheManager
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import Scheduler, SchedulerOutput
from dsv4.engine.sequence import Sequence, SequenceStatus

EOS = 1


def next_token(tokens: list[int]) -> int:
    """Deterministic stand-in for a model: depends on every token and its position."""
    return 3 + sum((i + 1) * t for i, t in enumerate(tokens)) % 50


def solo(prompt: list[int], params: SamplingParams, max_model_len: int,
         token_fn=next_token) -> list[int]:
    """The output of one sequence generated alone, token by token."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = token_fn(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and ((t == EOS and not params.ignore_eos)
                                               or t in params.stop_token_ids):
            return out
        if (params.max_tokens is not None and len(out) >= params.max_tokens) \
                or len(tokens) >= max_model_len:
            return out


class Sim:
    """Runs the scheduler with a fake model and checks each step."""

    def __init__(self, num_pages: int = 64, page_size: int = 4, budget: int = 16,
                 max_num_seqs: int = 8, max_model_len: int = 64, token_fn=next_token) -> None:
        self.manager = CacheManager(num_pages, page_size, max_num_seqs)
        self.sched = Scheduler(self.manager, budget, max_num_seqs, max_model_len)
        self.cache: dict[tuple[str, int], list[int]] = {}
        self.token_fn = token_fn
        self.seqs: dict[str, Sequence] = {}
        self.outputs: list[SchedulerOutput] = []

    def add(self, rid: str, prompt: list[int], **kw) -> Sequence:
        seq = Sequence(rid, 0, prompt, SamplingParams(**kw), self.sched.next_arrival())
        self.sched.add(seq)
        self.seqs[rid] = seq
        return seq

    def step(self) -> SchedulerOutput:
        return self.apply(self.sched.schedule())

    def apply(self, out: SchedulerOutput) -> SchedulerOutput:
        """Run the fake model on a scheduled step, check it and update the scheduler."""
        self.outputs.append(out)
        for seq in out.preempted:
            self.cache.pop(seq.key, None)
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_seqs
        pages_in_step: set[int] = set()
        slots_in_step: set[int] = set()
        for s in out.scheduled:
            key = s.seq.key
            if s.reset_slot:
                assert s.start_pos == 0
                self.cache[key] = []
            assert s.start_pos == len(self.cache[key]) == s.seq.num_computed_tokens
            assert len(s.block_table) * self.manager.page_size >= s.start_pos + s.num_new_tokens
            assert not pages_in_step & set(s.block_table), "two sequences share a page"
            assert s.slot not in slots_in_step
            pages_in_step |= set(s.block_table)
            slots_in_step.add(s.slot)
            self.cache[key] += s.seq.token_ids[s.start_pos:s.start_pos + s.num_new_tokens]
            assert s.sample == (len(self.cache[key]) == s.seq.num_tokens)
        sampled = {s.seq.key: self.token_fn(s.seq.token_ids) for s in out.scheduled if s.sample}
        for seq in self.sched.update(out, sampled, EOS):
            self.cache.pop(seq.key)
        self.sched.check_invariants()
        return out

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        self.manager.check_idle()


def test_long_prompt_is_chunked_to_the_budget() -> None:
    sim = Sim(budget=16)
    seq = sim.add("a", list(range(3, 53)), max_tokens=3)
    sizes = [sim.step().scheduled[0].num_new_tokens for _ in range(4)]
    assert sizes == [16, 16, 16, 2]
    assert seq.num_output_tokens == 1  # sampled at the end of the last chunk only
    sim.run()
    assert seq.output_token_ids == solo(list(range(3, 53)), seq.params, 64)


def test_decodes_first_then_prefill_chunks_share_the_step() -> None:
    sim = Sim(budget=8)
    a = sim.add("a", [5, 6], max_tokens=20)
    sim.step()
    b = sim.add("b", list(range(10, 40)), max_tokens=2)
    out = sim.step()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    out = sim.step()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    sim.run()
    assert a.output_token_ids == solo([5, 6], a.params, 64)
    assert b.output_token_ids == solo(list(range(10, 40)), b.params, 64)


def test_max_num_seqs_limits_running() -> None:
    sim = Sim(max_num_seqs=2, budget=64)
    for i in range(5):
        sim.add(f"r{i}", [3 + i, 4], max_tokens=4)
    out = sim.step()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sim.sched.num_running == 2 and sim.sched.num_waiting == 3
    sim.run()
    for i in range(5):
        assert sim.seqs[f"r{i}"].output_token_ids == solo([3 + i, 4], sim.seqs["r0"].params, 64)


def test_fcfs_head_of_queue_is_not_overtaken() -> None:
    # 6 pages of 4 tokens.  "a" holds 3 pages; "big" (12 tokens, 3 pages) fits only after "a"
    # grows no more; "small" behind it must wait even though it would fit.
    sim = Sim(num_pages=6, page_size=4, budget=64, max_model_len=24)
    sim.add("a", list(range(3, 13)), max_tokens=2)  # 10 tokens -> 3 pages
    sim.step()
    sim.add("big", list(range(3, 17)), max_tokens=1)  # 14 tokens -> 4 pages: does not fit
    sim.add("small", [3], max_tokens=1)
    out = sim.step()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    sim.run()
    firsts = {}
    for k, out in enumerate(sim.outputs):
        for s in out.scheduled:
            firsts.setdefault(s.seq.request_id, k)
    assert firsts["big"] <= firsts["small"]


def test_preemption_recomputes_and_preserves_every_output() -> None:
    # 8 pages of 4 tokens = 32 positions for 4 sequences that each grow to 24 tokens.
    sim = Sim(num_pages=8, page_size=4, budget=32, max_num_seqs=4, max_model_len=32)
    prompts = {f"r{i}": [3 + i, 7, 9 + i, 11] for i in range(4)}
    for rid, p in prompts.items():
        sim.add(rid, p, max_tokens=20, ignore_eos=True)
    sim.run()
    assert sim.sched.num_preemptions > 0
    for rid, p in prompts.items():
        assert sim.seqs[rid].output_token_ids == solo(p, sim.seqs[rid].params, 32), rid
    # The victim of every preemption was the newest running sequence at that time.
    for out in sim.outputs:
        for victim in out.preempted:
            assert all(s.seq.arrival < victim.arrival for s in out.scheduled)


def test_preempted_sequence_goes_back_to_the_front() -> None:
    sim = Sim(num_pages=4, page_size=4, budget=32, max_num_seqs=4, max_model_len=16)
    a = sim.add("a", [3, 4, 5, 6, 7, 8, 9], max_tokens=9, ignore_eos=True)   # grows to 16
    b = sim.add("b", [3, 4, 5, 6, 7, 8, 10], max_tokens=9, ignore_eos=True)  # grows to 16
    while not b.num_preemptions:
        sim.step()
    assert b.status is SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    c = sim.add("c", [3], max_tokens=1)
    assert list(sim.sched.waiting)[:2] == [b, c]
    sim.run()
    assert a.output_token_ids == solo(a.prompt_token_ids, a.params, 16)
    assert b.output_token_ids == solo(b.prompt_token_ids, b.params, 16)
    first_b = min(k for k, o in enumerate(sim.outputs) for s in o.scheduled
                  if s.seq is b and s.reset_slot and s.seq.num_preemptions)
    first_c = min(k for k, o in enumerate(sim.outputs) for s in o.scheduled if s.seq is c)
    assert first_b <= first_c


def test_abort_waiting_and_running_frees_everything() -> None:
    sim = Sim(max_num_seqs=2, budget=64)
    a = sim.add("a", [3, 4, 5], max_tokens=30, ignore_eos=True)
    b = sim.add("b", [6, 7], max_tokens=30, ignore_eos=True)
    c = sim.add("c", [8], max_tokens=5)
    sim.step()
    sim.step()
    assert [s.request_id for s in sim.sched.abort("a")] == ["a"]
    assert [s.request_id for s in sim.sched.abort("c")] == ["c"]  # still waiting
    assert sim.sched.abort("nope") == []
    assert a.finish_reason == "abort" and c.finish_reason == "abort"
    sim.cache.pop(a.key)
    sim.sched.check_invariants()
    sim.run()
    assert b.output_token_ids == solo([6, 7], b.params, 64)


def test_abort_during_a_step_is_ignored_by_update() -> None:
    sim = Sim()
    a = sim.add("a", [3, 4], max_tokens=5)
    out = sim.sched.schedule()
    sim.sched.abort("a")
    assert sim.sched.update(out, {a.key: 9}, EOS) == []
    assert a.output_token_ids == [] and a.finish_reason == "abort"
    sim.manager.check_idle()


@pytest.mark.parametrize("kw, reason, stop_reason", [
    (dict(max_tokens=3), "length", None),
    (dict(max_tokens=50, stop_token_ids=[17]), "stop", 17),
    (dict(max_tokens=50), "length", None),  # reaches max_model_len
])
def test_token_stop_conditions(kw: dict, reason: str, stop_reason) -> None:
    script = [5, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17]
    fn = lambda toks: script[len(toks) - 2]  # noqa: E731
    sim = Sim(max_model_len=8, token_fn=fn)
    seq = sim.add("a", [3, 4], **kw)
    sim.run()
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    expect = {"length": min(kw["max_tokens"], 6)}.get(reason, 2)
    assert seq.num_output_tokens == expect


def test_eos_ignore_eos_and_min_tokens() -> None:
    eos_fn = lambda toks: EOS  # noqa: E731
    sim = Sim(token_fn=eos_fn)
    a = sim.add("a", [3], max_tokens=5)
    b = sim.add("b", [3], max_tokens=5, ignore_eos=True)
    c = sim.add("c", [3], max_tokens=5, min_tokens=3)
    sim.run()
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([EOS], "stop", None)
    assert (b.output_token_ids, b.finish_reason) == ([EOS] * 5, "length")
    assert (c.output_token_ids, c.finish_reason) == ([EOS] * 3, "stop")


def test_bad_configuration_and_prompts_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"3 pages .* max_model_len=16 needs 4"):
        Scheduler(CacheManager(3, 4, 2), 16, 2, 16)
    with pytest.raises(ValueError, match="max_num_seqs=4 needs as many state slots"):
        Scheduler(CacheManager(8, 4, 2), 16, 4, 16)
    sched = Scheduler(CacheManager(8, 4, 2), 16, 2, 16)
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(Sequence("x", 0, [], SamplingParams(), 1))
    with pytest.raises(ValueError, match="prompt has 17 tokens, more than max_model_len=16"):
        sched.add(Sequence("x", 0, [3] * 17, SamplingParams(), 1))


def test_prompt_of_max_model_len_generates_one_token() -> None:
    sim = Sim(max_model_len=8, num_pages=2, page_size=4)
    seq = sim.add("a", list(range(3, 11)), max_tokens=5)
    sim.run()
    assert seq.num_output_tokens == 1 and seq.finish_reason == "length"


def test_random_traffic_with_tiny_cache_matches_solo_runs() -> None:
    rng = random.Random(0)
    sim = Sim(num_pages=10, page_size=4, budget=12, max_num_seqs=5, max_model_len=40)
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    n = 0
    for step in range(400):
        if n < 40 and rng.random() < 0.4:
            prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 25))]
            params = dict(max_tokens=rng.randrange(1, 15), ignore_eos=True)
            seq = sim.add(f"r{n}", prompt, **params)
            expected[seq.request_id] = solo(prompt, seq.params, 40)
            n += 1
        if rng.random() < 0.05 and sim.sched.running:
            victim = rng.choice(sim.sched.running)
            sim.sched.abort(victim.request_id)
            sim.cache.pop(victim.key, None)
            aborted.add(victim.request_id)
        if sim.sched.has_unfinished():
            sim.step()
    sim.run()
    assert sim.sched.num_preemptions > 0
    for rid, seq in sim.seqs.items():
        if rid not in aborted:
            assert seq.output_token_ids == expected[rid], rid
