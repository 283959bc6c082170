"""The decode experts on FP8 wgmma (``dsv4.ops.gluon_moe_decode``) inside a model, on the GPU:
every expert call the path serves during a schedule of steps is compared with the torch twin
and with Triton's grouped kernels on the same inputs, and the steps' logits with the path on
against off (eager forwards, official numerics, random weights in checkpoint formats).

    PYTHONPATH=. python bench/wgmma_model_check.py [--layers 5] [--tiny]

``--tiny``: V4-Flash's layer kinds at toy widths (bench/flash_bench.py --tiny, D 256, I 128,
whole K in one split); without it V4-Flash's widths.  A call at ~1e-3 from the twin is the
path's own FP8 class; a logits gap well above the calls' errors is the model amplifying them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.cache.formats import RECORD_DTYPE  # noqa: E402
from dsv4.cache.tensors import HybridCache  # noqa: E402
from dsv4.model.context import StepContext  # noqa: E402
from dsv4.ops import gluon_moe_decode as gm  # noqa: E402
from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tm  # noqa: E402

# (request slot, tokens) per step: prefills, a mixed step, 2- and 1-token decode steps.
SCHEDULE = [[(0, 40)], [(1, 9)], [(0, 64), (1, 1)], [(0, 1), (1, 1)], [(1, 1)], [(0, 1)],
            [(0, 1), (1, 1)]]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run(model, calls: list | None) -> list[torch.Tensor]:
    """The schedule's logits; with ``calls``, each wgmma expert call's errors appended."""
    cache = HybridCache.allocate(model.cfg, num_pages=8, num_slots=3, page_size=256,
                                 dtype=RECORD_DTYPE, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    pos = {0: 0, 1: 0, 2: 0}
    out = []
    inner = gm.moe_experts_wgmma

    def checked(x, ids, w, ex, limit, pairs=None, block_expert=None, shared=None,
                wait_shared=None):
        got = inner(x, ids, w, ex, limit, pairs, block_expert, shared, wait_shared)
        routed = inner(x, ids, w, ex, limit)
        T, k = ids.shape
        cfg = tm.pick_moe_config(T * k, ex.num_experts, x.shape[1], ex.inter_dim, gm.CHUNK)
        grouped = tm.moe_experts_with_config(x, ids, w, ex, limit, cfg)
        twin = ref.moe_experts(x, ids, w, ex, limit)
        calls.append((T, rel(routed, twin), rel(grouped, twin),
                      None if shared is None else rel(got, (twin + shared.float()))))
        return got

    if calls is not None:
        gm.moe_experts_wgmma = checked
    try:
        for step in SCHEDULE:
            seqlens = [n for _, n in step]
            ids = torch.randint(0, model.cfg.vocab_size, (sum(seqlens),), generator=gen,
                                device="cuda")
            ctx = StepContext.build(ids, seqlens, [pos[s] for s, _ in step],
                                    [s for s, _ in step], [[2 * s, 2 * s + 1] for s, _ in step],
                                    device="cuda")
            out.append(model.compute_logits(model.forward(ctx, cache)).float())
            for s, n in step:
                pos[s] += n
    finally:
        gm.moe_experts_wgmma = inner
    return out


def main() -> None:
    from bench.flash_bench import build_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--experts", type=int, default=None)
    args = ap.parse_args()
    model = build_model(args.layers, tiny=args.tiny, experts=args.experts)
    gm.WGMMA_DECODE = False
    off = run(model, None)
    gm.WGMMA_DECODE = True
    calls: list = []
    on = run(model, calls)
    print(f"# {torch.cuda.get_device_name()}: {args.layers} layers{' (tiny)' if args.tiny else ''}")
    print("| call | tokens | wgmma vs twin | grouped vs twin | with shared vs twin + shared |")
    print("|---|---|---|---|---|")
    for i, (T, a, b, c) in enumerate(calls):
        print(f"| {i} | {T} | {a:.2e} | {b:.2e} | {'-' if c is None else f'{c:.2e}'} |")
    print("| step | tokens | logits on vs off |")
    print("|---|---|---|")
    for i, (step, a, b) in enumerate(zip(SCHEDULE, on, off)):
        print(f"| {i} | {sum(n for _, n in step)} | {rel(a, b):.2e} |")


if __name__ == "__main__":
    main()
