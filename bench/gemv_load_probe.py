"""What bounds the one-token expert GEMM's weight stream (``dsv4.ops.gluon_moe_decode``): its
w1 + w3 GEMM streams six MXFP4 experts at ~2.1 TB/s on an H100 (docs/PERFORMANCE.md,
twenty-ninth session) with 4-byte loads a lane (the wgmma A fragment's bytes) and two
128-column chunks in flight a thread.  This probe streams the same bytes with the same grid
(64-row tiles × 6 experts × K splits of 8 chunks, two matrices, 4 warps) and no math: each
lane loads ``W`` contiguous bytes a load (4: the kernel's pattern; 8; 16) and XORs them into
one word it stores; also 4 and 16 chunks a split.  If 16-byte loads stream much faster than
4-byte ones, the request count is the bound (and staging the weights through shared memory,
cp.async or TMA, is the fix); if the probe's 4-byte stream is much faster than the GEMM,
the GEMM's own schedule (its MMA waits, the fill) is; if neither, the grid is.

    PYTHONPATH=. python bench/gemv_load_probe.py            # GPU (sm_90): the table
    PYTHONPATH=. python bench/gemv_load_probe.py --sass     # CPU: LDG widths per variant
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

E, D, INTER, TOPK = 256, 4096, 2048, 6
CHUNK_BYTES = 64            # one row's 128-column chunk of MXFP4 codes
BN = 64                     # rows a program (the kernel's 64-row tiles)


@gluon.jit
def _xor(a, b):
    return a ^ b


@gluon.jit
def _probe_kernel(w1_ptr, w3_ptr, ids_ptr, out_ptr, N: gl.constexpr, C: gl.constexpr,
                  CPS: gl.constexpr, W: gl.constexpr, WARPS: gl.constexpr):
    """Program (tile, pick, split): rows tile·64.. of expert ids[pick], chunks split·CPS..,
    w1 and w3, each lane W contiguous bytes a load, XORed into one word.  (The compiler
    schedules the loads: a barrier between chunks does not keep it from hoisting them.)"""
    # int32 words: a row's chunk is 16 words; W bytes = W / 4 words a load.
    L: gl.constexpr = gl.BlockedLayout([1, W // 4], [2 * W // 4, 16 // (W // 4)], [WARPS, 1],
                                       [1, 0])
    tile = gl.program_id(0)
    e = gl.load(ids_ptr + gl.program_id(1)).to(gl.int64)
    c0 = gl.program_id(2) * CPS
    r = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    b = gl.arange(0, 16, layout=gl.SliceLayout(0, L))
    # Chunk c of expert e: [N, 64] bytes at e·C·N·64 + c·N·64 (K-chunk-major).
    off = e * (C * N * 16) + r[:, None] * 16 + b[None, :]
    w1 = w1_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    w3 = w3_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    acc = gl.zeros([64, 16], gl.int32, L)
    for ci in gl.static_range(CPS):
        acc = acc ^ gl.load(w1 + off + (c0 + ci) * (N * 16))
        acc = acc ^ gl.load(w3 + off + (c0 + ci) * (N * 16))
    total = gl.reduce(gl.reshape(acc, [64 * 16]), 0, _xor)
    gl.store(out_ptr + (gl.program_id(2) * gl.num_programs(1) + gl.program_id(1))
             * gl.num_programs(0) + tile, total)


def launch(w1: torch.Tensor, w3: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
           W: int, cps: int = 8) -> None:
    C = D // 128
    _probe_kernel[(INTER // BN, ids.numel(), C // cps)](
        w1, w3, ids, out, N=INTER, C=C, CPS=cps, W=W, WARPS=4, num_warps=4)


# (W, chunks a split): the GEMM's own pattern is (4, 8).
VARIANTS = [(4, 8), (8, 8), (16, 8), (4, 16), (16, 16), (4, 4), (16, 4)]


def sass() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.gluon_fp4_gemv import _cuobjdump
    fn = _probe_kernel
    for W, cps in VARIANTS:
        consts = dict(N=INTER, C=D // 128, CPS=cps, W=W, WARPS=4)
        sig = {n: ("constexpr" if n in consts else "*i32" if n in ("ids_ptr", "out_ptr")
                   else "*u8") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n.endswith("_ptr")}
        src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                             constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        ldg = re.findall(r"LDG\.E(\.\w+)*", _cuobjdump(k, "--dump-sass"))
        regs = re.search(r"REG:(\d+)", _cuobjdump(k, "--dump-resource-usage"))
        print(f"W={W} CPS={cps}: {len(ldg)} LDG ({sorted(set(ldg))}), regs "
              f"{regs.group(1) if regs else '?'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    if args.sass:
        sass()
        return
    from bench.flash_bench import graph_time
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    C = D // 128
    w1 = torch.randint(0, 256, (E, C, INTER, 64), generator=gen, device=dev, dtype=torch.uint8)
    w3 = torch.randint(0, 256, (E, C, INTER, 64), generator=gen, device=dev, dtype=torch.uint8)
    rotations = [torch.randperm(E, generator=gen, device=dev)[:TOPK].to(torch.int32)
                 for _ in range(8)]
    out = torch.empty(8 * INTER // BN * TOPK, dtype=torch.int32, device=dev)
    nbytes = TOPK * 2 * INTER * D // 2
    print(f"# {torch.cuda.get_device_name()}: {TOPK} experts' w1 + w3 codes "
          f"({nbytes / 1e6:.1f} MB a call), 8 routings rotated")
    print("| bytes a load (W) | chunks a split | µs | TB/s |")
    print("|---|---|---|---|")
    for W, cps in VARIANTS:
        def run(W: int = W, cps: int = cps) -> None:
            for ids in rotations:
                launch(w1, w3, ids, out, W, cps)
        run()
        us = graph_time(run, args.replays) / len(rotations) * 1e6
        print(f"| {W} | {cps} | {us:.1f} | {nbytes / us / 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    main()
