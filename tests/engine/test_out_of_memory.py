"""Out of device memory in a step: the engine preempts that step's sequences, retries them in
smaller steps and loses nothing (results equal the un-batched forward); when no smaller step
exists it fails those requests alone, with the cache clean.

The out-of-memory error is injected after the real step has run, the worst case: every cache
write of the failed step happened, and its results are thrown away."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.engine.llm_engine import LLMEngine
from tests.engine.test_engine_tiny import (assert_matches_reference, engine, greedy, rand_prompt,
                                           run)


def fail_steps_above(eng: LLMEngine, limit: int) -> list[int]:
    """Make every step of more than ``limit`` tokens raise OutOfMemoryError after running;
    returns the list of failed step sizes (filled as it happens)."""
    real = eng.runner.execute
    failed: list[int] = []

    def execute(out):
        result = real(out)
        if out.num_batched_tokens > limit:
            failed.append(out.num_batched_tokens)
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return result

    eng.runner.execute = execute  # type: ignore[method-assign]
    return failed


def test_oom_steps_are_retried_smaller(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer) -> None:
    rng = random.Random(11)
    eng = engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, max_num_batched_tokens=64,
                 max_num_seqs=8)
    failed = fail_steps_above(eng, 10)
    prompts = {f"r{i}": rand_prompt(rng, rng.randrange(3, 40)) for i in range(6)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy(5, logprobs=1))
    outs = run(eng)
    assert failed and failed[0] > 10                      # it did run out, and recovered
    assert eng.scheduler.oom_budget is not None and eng.scheduler.oom_budget <= 10
    assert eng.get_stats()["num_preemptions"] >= len(failed)
    assert sorted(outs) == sorted(prompts)
    for rid, p in prompts.items():
        assert outs[rid].outputs[0].finish_reason == "length"
        assert_matches_reference(tiny_v4_model, p, outs[rid])


def test_oom_on_a_single_token_fails_only_that_request(tiny_v4_path, tiny_v4_model,
                                                       tiny_v4_tokenizer) -> None:
    eng = engine(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer, max_num_batched_tokens=16)
    fail_steps_above(eng, 0)                              # nothing fits
    eng.add_request("r", rand_prompt(random.Random(12), 9), greedy(4))
    with pytest.raises(torch.OutOfMemoryError):
        for _ in range(20):                               # 9 -> 4 -> 2 -> 1 token steps
            eng.step()
    assert not eng.has_unfinished_requests()
    eng.check_idle()


def test_scheduler_oom_preempts_keeps_outputs_and_regrows_the_budget() -> None:
    """Pure scheduler: random steps fail with OOM (their work thrown away); every output still
    equals the sequence generated alone, the invariants hold, the budget halves then regrows."""
    from dsv4.engine.scheduler import Scheduler
    from tests.engine.test_scheduler import Sim, solo

    rng = random.Random(13)
    sim = Sim(num_pages=64, page_size=4, budget=32, max_num_seqs=6, max_model_len=64)
    seqs = [sim.add(f"r{i}", [rng.randrange(3, 90) for _ in range(rng.randrange(1, 40))],
                    max_tokens=rng.randrange(1, 12), ignore_eos=True) for i in range(10)]
    ooms = 0
    for _ in range(3000):
        if not sim.sched.has_unfinished():
            break
        out = sim.sched.schedule()
        if rng.random() < 0.2 and sim.sched.on_out_of_memory(out):   # this step ran out
            ooms += 1
            assert sim.sched.oom_budget == max(1, out.num_batched_tokens // 2)
            for seq in out.preempted:
                sim.cache.pop(seq.key, None)
            assert all(s.seq.num_computed_tokens == 0 for s in out.scheduled)
            sim.sched.check_invariants()
            continue
        sim.apply(out)
        sim.sched.note_step_done()
    sim.run()
    assert ooms > 3
    for seq in seqs:
        assert seq.output_token_ids == solo(seq.token_ids[:seq.num_prompt_tokens], seq.params, 64)
    for _ in range(10 * Scheduler.OOM_RECOVERY_STEPS):
        sim.sched.note_step_done()
    assert sim.sched.oom_budget is None
