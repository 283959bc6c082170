"""Where the host's time goes in an eager prefill step: is a short prefill bound by Python?

    PYTHONPATH=. python bench/host_profile.py --layers 4 --tokens 256 [--top 40]
    PYTHONPATH=. python bench/host_profile.py --tiny --device cpu --tokens 64   # smoke test
    PYTHONPATH=. python bench/host_profile.py --layers 43 --experts 64 --tokens 128 \
        --prefill-graphs 1024        # what stays on the host in a piecewise step

For each prompt length it times one eager prefill step (``bench/flash_bench.py``'s model and
step: V4-Flash widths, random weights, fp8 cache) three ways: the wall time with a sync at the
end, the host's issue time (until ``forward`` returns, no sync), and the GPU's busy time (CUDA
events around the step after the host has queued it behind a long sleep kernel, so the GPU runs
the step back to back).  Then it runs the step under cProfile and prints the functions with the
most own time and the dsv4 functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import flash_bench as fb  # noqa: E402
from dsv4.cache.tensors import HybridCache  # noqa: E402
from dsv4.cache.formats import RECORD_DTYPE  # noqa: E402
from dsv4.engine.prefill_graphs import PrefillGraphs, run_step  # noqa: E402
from dsv4.model.context import StepContext, pages_needed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="256", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts a layer (43 layers fit one GPU with fewer)")
    ap.add_argument("--prefill-graphs", type=int, default=0, metavar="MAX_TOKENS",
                    help="run steps of up to MAX_TOKENS as piecewise CUDA graphs "
                         "(dsv4.engine.prefill_graphs; eager segments on a CPU)")
    ap.add_argument("--no-prework", action="store_true",
                    help="with --prefill-graphs: leave the cache part's token-local inputs to "
                         "the eager cache part (Attention.prework off), for an A/B")
    ap.add_argument("--stats", default=None, help="dump each length's cProfile stats to "
                    "STATS.<tokens> (pstats format)")
    args = ap.parse_args(argv)
    fb.DEV = dev = args.device
    cuda = dev == "cuda"
    model = fb.build_model(args.layers, args.tiny, experts=args.experts)
    lengths = [int(s) for s in args.tokens.split(",") if s]
    cache = HybridCache.allocate(model.cfg, num_pages=pages_needed(max(lengths), fb.PAGE),
                                 num_slots=1, page_size=fb.PAGE, dtype=RECORD_DTYPE, device=dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    pg = None
    if args.prefill_graphs:
        pg = PrefillGraphs(model, args.prefill_graphs, use_graphs=cuda,
                           cache=None if args.no_prework else cache)
        if cuda:
            cap = fb.capture_prefill_graphs(pg)
            print(f"captured {cap['graphs']} prefill graphs of buckets {cap['buckets']} "
                  f"in {cap['capture_s']:.1f} s, {cap['reserved_GB']:.2f} GB more reserved",
                  flush=True)

    forward = run_step(model, pg)
    for S in lengths:
        ids = torch.randint(0, model.cfg.vocab_size, (S,), device=dev)
        pages = list(range(pages_needed(S, fb.PAGE)))

        def step() -> torch.Tensor:
            cache.reset_slots([0])
            ctx = StepContext.build(ids, [S], [0], [0], [pages], device=dev)
            return model.compute_logits(forward(ctx, cache))

        with torch.no_grad():
            step(), step()
            sync()
            wall, issue, busy = [], [], []
            for _ in range(args.reps):
                sync()
                t0 = time.perf_counter()
                step()
                issue.append(time.perf_counter() - t0)
                sync()
                wall.append(time.perf_counter() - t0)
            if cuda:  # the GPU's own time: queue the step behind a sleep so it runs unstarved
                for _ in range(args.reps):
                    sync()
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    torch.cuda._sleep(int(4e9 * max(wall)))  # ~2× the step at ~2 GHz
                    start.record()
                    step()
                    end.record()
                    sync()
                    busy.append(start.elapsed_time(end) / 1e3)
            med = statistics.median
            print(f"\n## prefill {S} tokens, {args.layers} layers"
                  + (", piecewise graphs" if pg is not None and S <= pg.buckets[-1] else "")
                  + (" (no prework)" if pg is not None and pg.formats is None else "")
                  + f": wall {med(wall) * 1e3:.2f} ms, "
                  f"host issue {med(issue) * 1e3:.2f} ms, GPU busy "
                  + (f"{med(busy) * 1e3:.2f} ms" if busy else "n/a"), flush=True)
            prof = cProfile.Profile()
            prof.enable()
            step()
            sync()
            prof.disable()
            if args.stats:
                prof.dump_stats(f"{args.stats}.{S}")
        for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf).sort_stats(key)
            st.print_stats(args.top if key == "tottime" else r"dsv4", args.top)
            lines = buf.getvalue().splitlines()
            start = next((i for i, l in enumerate(lines) if "ncalls" in l), 0)
            print(f"### by {title}")
            print("\n".join(lines[start:start + args.top + 1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
