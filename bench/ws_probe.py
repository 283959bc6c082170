"""Offline (no GPU): does Triton's automatic warp specialization (``tl.range(...,
warp_specialize=True)``) partition an FP8 dot loop for sm_90?  The FP8 expert and dense GEMMs
rescale every K step's dot in fp32, and Triton waits on each dot before the rescale; a
warp-specialized loop (loads in producer warps, MMAs and rescales in consumers) would overlap
them.  Compiles one small block-scaled-style loop for ``GPUTarget("cuda", 90, 32)`` with and
without the flag and reports whether the TTGIR holds a ``ttg.warp_specialize`` region and how
many ``warp_group_dot_wait`` ops the loop keeps.

    python bench/ws_probe.py        # TRITON_INTERPRET must be unset

Thirteenth session, triton 3.6.0: the flag is accepted and kept as a loop attribute, but no
partition is made on sm_90 (Triton's automatic warp specialization targets Blackwell); Gluon
(``triton.experimental.gluon``: ``warp_specialize``, Hopper ``warpgroup_mma`` / ``mbarrier`` /
``tma``) is the way to hand-write it.
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


if __name__ == "__main__":
    main()
