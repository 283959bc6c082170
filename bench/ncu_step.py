"""One eager decode step of the V4-Flash-shaped model (``bench/flash_bench.py``'s), inside an NVTX
range ``step``, for Nsight Compute: every kernel of a batch-B step in isolation (duration, DRAM
bytes, occupancy, stall reasons).  Warm-up steps run outside the range.

    ncu --nvtx --nvtx-include "step/" --csv --page raw --metrics <list> \
        python bench/ncu_step.py --layers 4 --batch 1 --ctx 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import flash_bench as fb  # noqa: E402
from dsv4.cache.formats import RECORD_DTYPE  # noqa: E402
from dsv4.cache.tensors import HybridCache  # noqa: E402
from dsv4.model.context import StepContext, pages_needed  # noqa: E402


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args(argv)
    model = fb.build_model(args.layers)
    cfg, B = model.cfg, args.batch
    ppr = pages_needed(args.ctx + 8, fb.PAGE)
    cache = HybridCache.allocate(cfg, num_pages=B * ppr, num_slots=B, page_size=fb.PAGE,
                                 dtype=RECORD_DTYPE, device="cuda")
    tables = [fb.request_pages(r, ppr) for r in range(B)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.ctx,), generator=gen, device="cuda")
    model.forward(StepContext.build(ids, [args.ctx], [0], [0], [tables[0]], device="cuda"), cache)
    fb.clone_request(cache, 0, tables[0], list(range(1, B)), tables[1:])

    def step(pos: int) -> None:
        tok = torch.randint(0, cfg.vocab_size, (B,), generator=gen, device="cuda")
        c = StepContext.build(tok, [1] * B, [pos] * B, list(range(B)), tables, device="cuda")
        model.compute_logits(model.forward(c, cache))

    for i in range(2):                      # compiles, lazy tables, the wo_a FP8 copy
        step(args.ctx + i)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("step")
    step(args.ctx + 2)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
