"""One rank of the static-shape decode tests under tensor / expert parallelism (launched by
``torchrun --nproc-per-node 2``).

Every rank builds an ``LLMEngine`` on the tiny checkpoint with ``tensor_parallel_size=2``;
``--mode static`` runs decode steps as the static-shape steps of the CUDA graphs, eagerly (the
CPU stand-in of the graphs), ``--mode graphs`` as CUDA graphs (``cuda_graphs_under_tp``), and
``--mode eager`` dynamically; ``--mode failcapture`` pretends that rank 1's graph capture
fails; ``pggraphs`` / ``pgeager`` / ``pgfail``: prefill graphs replayed, run eagerly, or
failing to capture on rank 1.  Rank 0 runs a greedy workload and writes ``<tag>-rank0.json``
(tokens, logprobs, decode-path counters); the worker writes ``<tag>-rank1.json`` (its counters)
after rank 0 shut it down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from dsv4.engine.llm_engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams

# Greedy requests: (prompt length, max tokens); 140 crosses a 128-token compression group.
REQUESTS = [(5, 9), (37, 6), (140, 8), (12, 7)]


def force_static_decode(eng: LLMEngine) -> None:
    """Decode steps as eager static-shape steps on this rank (what graphs replay)."""
    from dsv4.engine.cuda_graphs import DecodeGraphs
    from dsv4.model.context import StaticShape, pages_needed

    runner = eng.runner
    static = StaticShape(pages_needed(eng.max_model_len, runner.page_size),
                         eng.manager.num_slots, eng.manager.num_pages)
    runner.decode_graphs = DecodeGraphs(runner.model, runner.cache, static, eng.manager.num_slots,
                                        device=eng.device, use_graphs=False,
                                        with_token_types=eng.config.is_v41,
                                        with_logits=eng.is_driver)


def engine(path: str, device: str, mode: str, ep: bool, world: int) -> LLMEngine:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    graphs_on = mode in ("graphs", "graphspipe", "pggraphs", "pgeager")
    eng = LLMEngine(path, device=device, dtype=dtype, tensor_parallel_size=world,
                    expert_parallel=ep, max_model_len=256, max_num_seqs=4,
                    max_num_batched_tokens=32, num_pages=8,
                    enforce_eager=not graphs_on, cuda_graphs_under_tp=graphs_on,
                    prefill_graphs=mode.startswith("pg"))
    if mode.startswith("pg"):
        # Prefill graphs: "pggraphs" replays them, "pgeager" runs the same segments eagerly
        # (both with decode graphs, unpipelined); "pgfail" pretends rank 1's capture fails.
        from dsv4.engine.prefill_graphs import PrefillGraphs

        eng.pipeline_decode = False
        if mode == "pgeager":
            eng.runner.prefill_graphs = PrefillGraphs(eng.model, 32, use_graphs=False,
                                                      cache=eng.runner.cache)
        if mode == "pgfail":
            pg = eng.runner.prefill_graphs
            pg.use_graphs = True

            def capture_pg(Tb: int) -> None:
                if eng.parallel.rank == 1:
                    raise RuntimeError("prefill capture failure on rank 1 (test)")

            pg.capture = capture_pg
    if mode in ("static", "failcapture", "failstartup", "pipeline"):
        force_static_decode(eng)
    if mode == "pipeline":
        eng.pipeline_decode = True   # pipelined static decode steps (no logprobs asked)
    if mode == "graphs":
        eng.pipeline_decode = False  # graphs against static eager steps of the same batches
    if mode in ("failcapture", "failstartup"):
        # Pretend graphs are on and the capture fails on rank 1 only: every rank must turn
        # graphs off together (no hang) and the steps run eagerly.
        graphs = eng.runner.decode_graphs
        graphs.use_graphs = True

        def capture(B: int) -> None:
            if eng.parallel.rank == 1:
                raise RuntimeError("capture failure on rank 1 (test)")

        graphs.capture = capture
        if mode == "failstartup":
            eng.runner.capture_graphs()  # the engine-start capture (cuda_graph_capture="startup")
    return eng


def workload(eng: LLMEngine, logprobs: bool = True) -> dict[str, list]:
    """Greedy run to completion: tokens and chosen-token logprobs per request (an empty list
    without ``logprobs``)."""
    g = torch.Generator().manual_seed(11)
    for i, (n, m) in enumerate(REQUESTS):
        prompt = torch.randint(3, 500, (n,), generator=g).tolist()
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=m,
                                                        ignore_eos=True,
                                                        logprobs=1 if logprobs else None))
    done: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = [list(c.token_ids),
                                        [c.logprobs[k][t].logprob for k, t in
                                         enumerate(c.token_ids)] if logprobs else []]
    eng.check_idle()
    return done


def stats(eng: LLMEngine) -> dict:
    graphs = eng.runner.decode_graphs
    pg = eng.runner.prefill_graphs
    return {"stats": dict(graphs.stats) if graphs is not None else None,
            "prefill_stats": dict(pg.stats) if pg is not None else None,
            "buckets": sorted(graphs.graphs) if graphs is not None else [],
            "disabled": eng.runner.graphs_disabled_reason,
            "pipelined": getattr(eng, "_pipelined_launches", 0)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--tag", required=True)
    ap.add_argument("modes", nargs="+", help="static, graphs, eager, failcapture, failstartup, "
                    "pipeline or graphspipe (graphs, pipelined: no logprobs asked), pggraphs, "
                    "pgeager, pgfail (prefill graphs) (one engine each)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    for mode in args.modes:
        eng = engine(args.path, args.device, mode, args.ep, world)
        rank = eng.parallel.rank
        result: dict = {}
        if eng.is_driver:
            result["outputs"] = workload(eng, logprobs=mode not in ("pipeline", "graphspipe"))
            result.update(stats(eng))
            eng.shutdown()
        else:
            result["steps"] = eng.run_worker()
            result.update(stats(eng))
        with open(os.path.join(args.out, f"{args.tag}-{mode}-rank{rank}.json"), "w",
                  encoding="utf-8") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
