"""Pipelined decode (``pipeline_decode``): the next decode step is launched with the samples still
on the device, before the host reads them.  Against the same engine without pipelining (both
in static-shape decode mode, the CUDA-graph path run eagerly on the CPU): the same tokens for
greedy and seeded requests, sequences stopping mid-way (stop tokens, max_tokens, max_model_len),
aborts while a step is in flight, new requests arriving mid-stream, and an idle cache after."""

from __future__ import annotations

import pytest

from dsv4.engine.llm_engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from test_cuda_graphs import make_engine, prompts


def engine(path, model, tok, pipeline: bool, **kw) -> LLMEngine:
    eng = make_engine(path, model, tok, True, pipeline_decode=pipeline, **kw)
    eng.pipeline_decode = pipeline   # (make_engine swaps in the static-decode runner)
    return eng


def drive(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
          late: dict[int, dict[str, tuple[list[int], SamplingParams]]] | None = None,
          abort_at: dict[int, str] | None = None) -> dict[str, list]:
    """Add ``requests``, step to the end (adding ``late[k]`` / aborting ``abort_at[k]`` before
    step k); the token ids of every sequence of every request that finished (with their
    logprobs when asked)."""
    for rid, (p, sp) in requests.items():
        eng.add_request(rid, p, sp)
    done: dict[str, list[list[int]]] = {}
    k = 0
    while eng.has_unfinished_requests() or (late and any(j >= k for j in late)):
        for rid, (p, sp) in (late or {}).get(k, {}).items():
            eng.add_request(rid, p, sp)
        if abort_at and k in abort_at:
            eng.abort_request(abort_at[k])
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [c.token_ids if c.logprobs is None
                                        else (c.token_ids, c.logprobs) for c in out.outputs]
        k += 1
    eng.check_idle()
    eng.scheduler.check_invariants()
    return done


def _tokens(done: dict[str, list]) -> dict[str, list]:
    return {r: [c[0] if isinstance(c, tuple) else c for c in seqs] for r, seqs in done.items()}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_pipelined_equals_plain(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer) -> None:
    args = (tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer)
    ps = prompts(3, [12, 40, 7, 130])
    plain0 = drive(engine(*args, False), {"a": (ps[0], greedy(20))})
    stop = plain0["a"][0][9]   # a token the greedy run emits: a stop token mid-way
    reqs = {
        "a": (ps[0], greedy(20)),
        "b": (ps[1], greedy(25)),
        "c": (ps[2], SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=18,
                                    ignore_eos=True)),
        "d": (ps[0], greedy(30, stop_token_ids=[stop])),
        "e": (ps[3], greedy(3)),
        "g": (ps[2], greedy(12, logprobs=2)),
        "h": (ps[1], SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True,
                                    logprobs=1)),
    }
    late = {6: {"f": (ps[1][:20], greedy(10))}}
    plain_eng = engine(*args, False)
    plain = drive(plain_eng, reqs, late)
    eng = engine(*args, True)
    piped = drive(eng, reqs, late)
    # Tokens equal; logprobs to fp32 rounding (a speculative step may run a larger batch
    # bucket, whose CPU matmuls block differently).
    assert _tokens(piped) == _tokens(plain)
    for rid in ("g", "h"):
        (toks, lps), = piped[rid]
        (_, want), = plain[rid]
        assert len(lps) == len(toks)
        for got_pos, want_pos in zip(lps, want):
            assert got_pos.keys() == want_pos.keys(), rid
            for tok, lp in got_pos.items():
                assert abs(lp.logprob - want_pos[tok].logprob) < 1e-4, rid
                assert lp.rank == want_pos[tok].rank, rid
    assert len(piped["d"][0]) < 30 and piped["d"][0][-1] == stop
    assert eng._totals["steps"] >= plain_eng._totals["steps"] - 1
    assert eng._pipelined_launches > 10 and plain_eng._pipelined_launches == 0


def test_pipelined_to_max_model_len_and_abort(tiny_v4_path, tiny_v4_model,
                                              tiny_v4_tokenizer) -> None:
    args = (tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer)
    ps = prompts(5, [60, 20, 33])
    reqs = {"long": (ps[0], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)),
            "x": (ps[1], greedy(40)), "y": (ps[2], greedy(40))}
    kw = {"max_model_len": 96}
    plain = drive(engine(*args, False, **kw), reqs, abort_at={12: "x"})
    piped = drive(engine(*args, True, **kw), reqs, abort_at={12: "x"})
    assert "x" not in piped and piped == plain
    assert len(piped["long"][0]) == 96 - 60


def test_pipeline_option_is_validated() -> None:
    from dsv4.engine.llm_engine import EngineOptions

    assert EngineOptions().pipeline_decode is None
    with pytest.raises(ValueError, match="pipeline_decode='on' is invalid"):
        EngineOptions(pipeline_decode="on")
