"""Host time of one launch: bare Triton kernels, dsv4's op wrappers, small torch ops.

    PYTHONPATH=. python bench/launch_cost.py [--calls 300]

Each row issues ``--calls`` launches back to back (no sync inside; the GPU work of each is a
few µs, so the queue never fills) and prints the host µs per call, median of 5 rounds.  It
separates what an eager step's ~70 launches a layer cost on the host: Triton's launcher
(``JITFunction.run``: argument binding and specialization, cache key, launch) against a direct
launch of the compiled kernel, dsv4's wrappers (checks, plan picks, lanes), torch's dispatch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _k4(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def _k16(x_ptr, y_ptr, a_ptr, b_ptr, c_ptr, d_ptr, n, s0, s1, s2, s3, s4, s5,
         BLOCK: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n)
    if F1:
        v += s0 + s1 + s2 + s3 + s4 + s5
    tl.store(y_ptr + i, v, mask=i < n)


def per_call(fn: Callable[[], Any], calls: int) -> float:
    """Median host µs per call of ``fn`` over 5 rounds of ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    n, dev = 1024, "cuda"
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    rows: list[tuple[str, float]] = []

    def row(name: str, fn: Callable[[], Any]) -> None:
        try:
            rows.append((name, per_call(fn, args.calls)))
        except Exception as e:  # one broken row must not lose the others
            print(f"{name}: {e!r}", flush=True)
            return
        print(f"{rows[-1][1]:8.2f} us  {name}", flush=True)

    row("triton, 3 args + 1 constexpr: kernel[grid](...)", lambda: _k4[(1,)](x, y, n, BLOCK=1024))
    a16 = (x, y, x, y, x, y, n, 1, 2, 3, 4, 5, 6)
    row("triton, 13 args + 3 constexpr: kernel[grid](...)",
        lambda: _k16[(1,)](*a16, BLOCK=1024, F1=True, F2=False))
    c4 = _k4.warmup(x, y, n, BLOCK=1024, grid=(1,))
    c16 = _k16.warmup(*a16, BLOCK=1024, F1=True, F2=False, grid=(1,))
    c4._init_handles()
    c16._init_handles()
    from triton.runtime import driver
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    row("triton, 3 args: compiled.run (no binder)",
        lambda: c4.run(1, 1, 1, stream, c4.function, c4.packed_metadata, None, None, None,
                       x, y, n, 1024))
    row("triton, 13 args: compiled.run (no binder)",
        lambda: c16.run(1, 1, 1, stream, c16.function, c16.packed_metadata, None, None, None,
                        *a16, 1024, True, False))
    row("torch: x.add_(1)", lambda: x.add_(1))
    row("torch: torch.empty(1024)", lambda: torch.empty(n, device=dev))
    row("torch: x[idx] gather (index)", (lambda idx=torch.arange(64, device=dev): x[idx]))
    row("torch.cuda.current_stream()", torch.cuda.current_stream)
    ev = torch.cuda.Event()
    row("torch.cuda.Event().record()", lambda: torch.cuda.Event().record())
    row("event.record() (reused)", ev.record)
    side = torch.cuda.Stream()
    row("side.wait_stream(current)", lambda: side.wait_stream(torch.cuda.current_stream()))

    # dsv4's op wrappers at a 256-token prefill's shapes.
    from dsv4.ops import get_ops
    ops = get_ops("triton")
    h = torch.randn(256, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.ones(4096, device=dev)
    row("dsv4 ops.rms_norm [256, 4096] bf16", lambda: ops.rms_norm(h, w, 1e-6))
    from dsv4.ops import triton_dense
    row("dsv4 triton_dense.act_quant [256, 4096]", lambda: triton_dense.act_quant(h, 128))
    from bench.flash_bench import build_model
    try:
        model = build_model(1)
        lin = model.layers[0].attn.wq_b
        xq = torch.randn(256, lin.in_features, device=dev, dtype=torch.bfloat16)
        row("dsv4 Linear wq_b (fp8) forward, 256 rows", lambda: lin(xq))
    except Exception as e:  # the bench's model needs the full widths on the GPU
        print(f"model rows skipped: {e!r}")
    print("\n| host µs per call | what |\n|---|---|")
    for name, us in rows:
        print(f"| {us:.2f} | {name} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
