"""Where the MoE gate launch's time goes at decode (V4-Flash: 256 experts, K 4096, top-6).

The B=1 timeline (docs/PERFORMANCE.md, thirty-first session) has ``_gate_route_kernel`` end
~11 µs after the collapse that feeds it, for ~2 MB of weight (~0.5 µs of bytes).  This times,
in CUDA-graph replays (weights rotated past L2, PDL as in a decode step):

* ``gemv``: the gate GEMM alone (``linear_fp32`` on the bf16 weight, the same plan);
* ``route``: the routing alone (``moe_route`` on fp32 logits);
* ``gate``: the one launch of both (``moe_gate``);
* ``gate+plan``: that launch with the experts' decode plan (``moe_gate_plan``, 256
  K-chunk-major MXFP4 experts) — what the model runs.

    PYTHONPATH=. python bench/gate_parts.py [--tokens 1,2,4]
    PYTHONPATH=. python bench/gate_parts.py --sass    # offline, no GPU: the routing's SASS

``--sass`` compiles the one-token V4-Flash gate launch (``_gate_route_kernel`` as the sm_90
recorder of ``tests/kernels/sm90_cases.py`` sees it, scenario ``moe_gate_plan/v4_flash``) and
counts its instructions, barriers and shuffles (TRITON_INTERPRET must be unset).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

from bench.kernels import copies_for, time_graph
from dsv4.ops import torch_dense
from dsv4.ops import triton_linear32 as l32
from dsv4.ops import triton_route as tr

E, D, INTER, TOP_K, SCALE = 256, 4096, 2048, 6, 1.5


def experts_fp4(gen: torch.Generator) -> torch_dense.ExpertWeights:
    """Random V4-Flash MXFP4 expert stacks, K-chunk-major as the GPU model holds them."""
    def fp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (E, n, k // 2), generator=gen, device="cuda", dtype=torch.uint8)
        sc = torch.randint(118, 124, (E, n, k // 32), generator=gen, device="cuda")
        return w.view(torch.int8), sc.to(torch.uint8).view(torch.float8_e8m0fnu)
    (w1, s1), (w3, s3), (w2, s2) = fp4(INTER, D), fp4(INTER, D), fp4(D, INTER)
    ex = torch_dense.ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2)
    return torch_dense.kchunk_experts(ex, 128)


def sass_counts() -> str:
    """Instructions, barriers and shuffles of the one-token gate launch, compiled for sm_90."""
    import sm90_cases as cases
    from bench.compress_sass import _sass, sass_opcodes
    cases.RECORDER.launches.clear()
    with cases.RECORDER.active():
        cases.SCENARIOS["moe_gate_plan/v4_flash"]()
    launch = next(x for x in cases.RECORDER.launches if x.kernel_name == "_gate_route_kernel")
    body, ops = sass_opcodes(_sass(cases.compile_launch(launch).asm["cubin"])[0])
    return f"_gate_route_kernel: {len(body)} instructions, BAR {ops['BAR']}, SHFL {ops['SHFL']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--sass", action="store_true", help="offline SASS counts (no GPU)")
    args = ap.parse_args()
    if args.sass:
        print(sass_counts())
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = copies_for(E * D * 2)
    weights = [(torch.randn(E, D, generator=gen, device="cuda") * 0.02).bfloat16()
               for _ in range(n)]
    bias = torch.randn(E, generator=gen, device="cuda") * 0.1
    ex = experts_fp4(gen)
    print(f"PDL {os.environ.get('DSV4_PDL', '1')}, {n} weight copies rotated")
    print("| tokens | gemv | route | gate | gate+plan | plan applies |")
    print("|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, generator=gen, device="cuda").bfloat16()
        logits = torch.randn(T, E, generator=gen, device="cuda")
        gemv = [lambda w=w: l32.linear_fp32(x, w) for w in weights]
        route = [lambda: tr.moe_route(logits, bias, None, None, TOP_K, SCALE)]
        gate = [lambda w=w: tr.moe_gate(x, w, bias, None, None, TOP_K, SCALE) for w in weights]
        plan = [lambda w=w: tr.moe_gate_plan(x, w, bias, None, None, TOP_K, SCALE, ex)
                for w in weights]
        applies = tr.moe_gate_plan(x, weights[0], bias, None, None, TOP_K, SCALE, ex)[2] is not None
        times = [time_graph(c) for c in (gemv, route, gate, plan)]
        print(f"| {T} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {applies} |")


if __name__ == "__main__":
    main()
