"""Offline (no GPU): does Triton's automatic warp specialization (``tl.range(...,
warp_specialize=True)``) partition an FP8 dot loop for sm_90?  The FP8 expert and dense GEMMs
rescale every K step's dot in fp32, and Triton waits on each dot before the rescale; a
warp-specialized loop (loads in producer warps, MMAs and rescales in consumers) would overlap
them.  Compiles one small block-scaled-style loop for ``GPUTarget("cuda", 90, 32)`` with and
without the flag, with pointer loads at 8 warps and with TMA tensor descriptors at 4 warps, and
reports whether the TTGIR holds a ``ttg.warp_specialize`` region and how many
``warp_group_dot_wait`` ops the loop keeps.

    python bench/ws_probe.py        # TRITON_INTERPRET must be unset

Triton 3.6.0: with pointer loads or 8 warps no partition is made (the thirteenth session's
finding).  With descriptors and 4 warps Hopper's pass (``add_hopper_warpspec``) does partition
the loop: a TMA producer and two 4-warp consumer warpgroups (nineteenth session).  But on the
H200 the partitioned expert GEMMs did not work (docs/PERFORMANCE.md, nineteenth session): the
128-row plans hung, the 64-row plan gave wrong values (rel 8.7e-2) at 2.4x the time; and the
same GEMMs through descriptors without the partition were 2-6% slower than pointer loads.  Gluon
(``triton.experimental.gluon``) stays the way to hand-write a warp-specialized Hopper GEMM.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _scaled_loop(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 WS: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, num_stages=3, warp_specialize=WS):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
        acc = acc * 0.5 + tl.dot(a, b)        # a per-step rescale, as the block-scaled GEMMs
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


@triton.jit
def _scaled_loop_tma(a_desc, b_desc, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, WS: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, num_stages=3, warp_specialize=WS):
        a = a_desc.load([pm * BM, k])
        b = b_desc.load([pn * BN, k])
        acc = acc * 0.5 + tl.dot(a, b.T)        # the same per-step rescale
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


def main() -> None:
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*fp32", "K": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "WS": "constexpr"}
    for ws in (False, True):
        src = ASTSource(fn=_scaled_loop, signature=sig,
                        constexprs={"BM": 128, "BN": 128, "BK": 128, "WS": ws})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        ttgir = k.asm["ttgir"]
        print(f"warp_specialize={ws}: ttg.warp_specialize regions "
              f"{ttgir.count('ttg.warp_specialize')}, warp_group_dot_wait "
              f"{ttgir.count('warp_group_dot_wait')}, loop attribute "
              f"{'tt.warp_specialize' in ttgir}")
    sig = {"a_desc": "tensordesc<fp8e4nv[128, 128]>", "b_desc": "tensordesc<fp8e4nv[128, 128]>",
           "c_ptr": "*fp32", "K": "i32", "BM": "constexpr", "BN": "constexpr",
           "BK": "constexpr", "WS": "constexpr"}
    for ws in (False, True):
        src = ASTSource(fn=_scaled_loop_tma, signature=sig,
                        constexprs={"BM": 128, "BN": 128, "BK": 128, "WS": ws})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ttgir = k.asm["ttgir"]
        print(f"TMA descriptors, 4 warps, warp_specialize={ws}: ttg.warp_specialize regions "
              f"{ttgir.count('ttg.warp_specialize(')}, warp_group_dot_wait "
              f"{ttgir.count('warp_group_dot_wait')}, shared {k.metadata.shared}")


if __name__ == "__main__":
    main()
