"""Where an eager prefill's device time goes, by op and by module: the V4-Flash-shaped model of
``bench/flash_bench.py`` (``--layers``, ``--experts``), one prefill of ``--tokens`` tokens under
torch.profiler with every entry of the model's op table and every module's forward wrapped in
a ``record_function`` range.

    PYTHONPATH=. python bench/prefill_attrib.py --layers 4 --tokens 8192

Printed: device time (ms) and calls per op-table entry ("op:NAME"), per module class and
position ("mod:layers.N.attn" collapsed to "mod:attn"), and the aten ops grouped by input shape
(the torch glue outside the Triton kernels), each table largest first.  A range's device time
includes the kernels launched inside it (nested ranges count in each).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench import flash_bench as fb
from dsv4.cache.formats import RECORD_DTYPE
from dsv4.cache.tensors import HybridCache
from dsv4.model.context import StepContext, pages_needed


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)
    return inner


@contextlib.contextmanager
def instrument(model: torch.nn.Module) -> Iterator[None]:
    """Every callable of the model's op table and every module's forward in a named range,
    restored on exit (the op table is the process's shared one: dsv4.ops.get_ops)."""
    ops = model.ops
    saved = dict(vars(ops))
    for name, fn in saved.items():
        if callable(fn) and not isinstance(fn, type):
            setattr(ops, name, _wrap(f"op:{name}", fn))
    wrapped = []
    for mname, module in model.named_modules():
        if not mname:
            continue
        label = "mod:" + re.sub(r"(^|\.)\d+(\.|$)", r"\1#\2", mname)
        wrapped.append((module, module.__dict__.get("forward")))
        module.forward = _wrap(label, module.forward)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
        for module, own in wrapped:
            if own is None:
                del module.forward      # back to the class's method
            else:
                module.forward = own


def device_ms(evt: Any) -> float:
    """A range's device time in ms (CPU time on a CPU run)."""
    if fb.DEV != "cuda":
        return evt.cpu_time_total / 1e3
    return evt.device_time_total / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=30, help="rows a table")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (use --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (smoke runs)")
    args = ap.parse_args(argv)
    fb.DEV = args.device
    model = fb.build_model(args.layers, args.tiny, args.experts)
    S = args.tokens
    cache = HybridCache.allocate(model.cfg, num_pages=pages_needed(S, fb.PAGE), num_slots=1,
                                 page_size=fb.PAGE, dtype=RECORD_DTYPE, device=fb.DEV)
    gen = torch.Generator(device=fb.DEV).manual_seed(S)
    ids = torch.randint(0, model.cfg.vocab_size, (S,), generator=gen, device=fb.DEV)
    pages = list(range(pages_needed(S, fb.PAGE)))

    def step() -> None:
        cache.reset_slots([0])
        ctx = StepContext.build(ids, [S], [0], [0], [pages], device=fb.DEV)
        model.compute_logits(model.forward(ctx, cache))

    step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if fb.DEV == "cuda" else [])
    with instrument(model):
        step()
        fb._sync()
        with profile(activities=acts, record_shapes=True) as prof:
            step()
            fb._sync()
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"prefill {S} tokens, {args.layers} layers: {total:.2f} ms of kernels")
    ka = prof.key_averages()
    for prefix in ("op:", "mod:"):
        # (On CUDA a range can be listed twice, its CPU side and its span on the GPU timeline;
        # rows without device time are left out.)
        rows = sorted((e for e in ka if e.key.startswith(prefix) and device_ms(e) > 0),
                      key=device_ms, reverse=True)
        print(f"\n| {prefix[:-1]} | device ms | calls | ms a call |\n|---|---|---|---|")
        for e in rows[:args.rows]:
            print(f"| {e.key} | {device_ms(e):.3f} | {e.count} | "
                  f"{device_ms(e) / max(e.count, 1):.3f} |")
    shaped = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                     if e.key.startswith("aten::") and e.self_device_time_total > 0),
                    key=lambda e: e.self_device_time_total, reverse=True)
    print("\n| aten op | input shapes | self device ms | calls |\n|---|---|---|---|")
    for e in shaped[:args.rows]:
        shapes = str(e.input_shapes)[:110]
        print(f"| {e.key} | {shapes} | {e.self_device_time_total / 1e3:.3f} | {e.count} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
