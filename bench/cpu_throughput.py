"""Offline throughput of the engine on the tiny model (CPU).  Not a test.

    python bench/cpu_throughput.py [--num-requests 64] [--prompt-len 16:128] [--output-len 32]

Prints one table row per configuration: requests, prompt / output tokens, wall time, steps,
and tokens per second.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from dsv4.engine.llm_engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def run_once(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    steps = 0
    out_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
        steps += 1
    wall = time.perf_counter() - start
    engine.check_idle()
    in_tokens = sum(len(p) for p in prompts)
    return dict(requests=len(prompts), prompt_tokens=in_tokens, output_tokens=out_tokens,
                wall_s=wall, steps=steps, prompt_tps=in_tokens / wall, output_tps=out_tokens / wall,
                total_tps=(in_tokens + out_tokens) / wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: a fresh tiny V4)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=_range, default=(16, 128), help="N or LO:HI")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = args.model
    if path is None:
        from dsv4.tiny import make_tiny_checkpoint
        path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="dsv4-bench-") + "/tiny", "v4")
    rng = random.Random(args.seed)
    lo, hi = args.prompt_len
    prompts = [[rng.randrange(20, 500) for _ in range(rng.randint(lo, hi))]
               for _ in range(args.num_requests)]

    print(f"model {path}  threads {args.threads}  torch {torch.__version__}")
    header = (f"{'max_seqs':>8} {'requests':>8} {'prompt_tok':>10} {'output_tok':>10} "
              f"{'steps':>6} {'wall_s':>8} {'prompt/s':>9} {'output/s':>9} {'total/s':>9}")
    print(header)
    print("-" * len(header))
    model = None
    for max_seqs in args.max_num_seqs:
        engine = LLMEngine(path, device="cpu", model=model, max_num_seqs=max_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=hi + args.output_len + 1, seed=args.seed)
        model = engine.model  # load once
        run_once(engine, prompts[:2], 2)  # warm-up
        r = run_once(engine, prompts, args.output_len)
        print(f"{max_seqs:>8} {r['requests']:>8} {r['prompt_tokens']:>10} {r['output_tokens']:>10} "
              f"{r['steps']:>6} {r['wall_s']:>8.2f} {r['prompt_tps']:>9.1f} {r['output_tps']:>9.1f} "
              f"{r['total_tps']:>9.1f}")


if __name__ == "__main__":
    main()
