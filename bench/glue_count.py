"""Count the device kernels one static-shape decode step would launch on a GPU, by source.

    PYTHONPATH=. python bench/glue_count.py                    # Triton op table, B = 1 and 16
    PYTHONPATH=. python bench/glue_count.py --backend torch --batches 1 --json out.json
    PYTHONPATH=. python bench/glue_count.py --batches --prefill 256   # an eager prefill step
    PYTHONPATH=. python bench/glue_count.py --batches --prefill 128 --piecewise   # what stays eager

The model has V4-Flash's layer schedule at toy widths (``bench/flash_bench.py --tiny``: FP8
Linears and MXFP4 experts kept quantized, official numerics, bf16, fp8 cache records) and its
first ``--layers`` layers: L0-1 window only, L2 CSA (ratio 4 + indexer), L3 HCA (ratio 128),
L4 CSA; L0-2 hash-routed MoE, L3-4 learned routing.  A prefill of ``--ctx`` tokens per request
fills the cache (torch twins, uncounted); then one warm-up and one counted decode step run the
static-shape path of CUDA graphs (``DecodeGraphs`` with graphs off: the eager replay of what a
graph captures) at each batch.

What is counted (launch counts do not depend on the widths, so CPU counts are GPU counts):

* torch ops: every aten op that reaches a backend kernel, seen by a ``TorchDispatchMode``
  (composite ops arrive decomposed, as on CUDA); views, ``empty*`` and other metadata-only ops
  are left out (:data:`NO_KERNEL`), host syncs (``_local_scalar_dense``) are listed apart;
* Triton kernels: each launch of a ``@triton.jit`` kernel, by kernel name.  The op wrappers
  send CPU tensors to the torch twins unless the Triton interpreter is on, so with the Triton
  table the script sets ``TRITON_INTERPRET=1`` (before triton is imported) and counts the
  launches of the interpreted kernels (the torch ops the interpreter itself runs are not
  counted).

Each op is attributed to the module it ran in (forward hooks, layer index replaced by the
layer's kind) and to the innermost ``dsv4`` function on the Python stack.  The printed table
lists sources by count per step with their share, then the total per layer kind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

# The interpreter must be chosen before triton is imported (kernels are wrapped at decoration).
if __name__ == "__main__" and (sys.argv[sys.argv.index("--backend") + 1:][:1] if "--backend"
                               in sys.argv else ["triton"]) == ["triton"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Count the step as it runs once the new kernels are checked on a GPU (dsv4.ops).
    os.environ.setdefault("DSV4_UNVERIFIED_KERNELS", "1")

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# aten ops that launch no device kernel: views, allocation, metadata.
NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
    "lift_fresh", "alias", "set_", "resize_", "_reshape_alias", "view", "_unsafe_view",
    "as_strided", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "split", "split_with_sizes", "unbind", "narrow", "view_as_real",
    "view_as_complex", "diagonal", "unfold", "_indices", "_values", "is_nonzero", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride", "is_same_size",
    "record_stream", "_has_compatible_shallow_copy_type",
}
# aten ops that read a device value back to the host (a sync; not allowed in a CUDA graph).
HOST_SYNC = {"_local_scalar_dense", "item", "nonzero", "equal"}
_DSV4 = str(Path(__file__).resolve().parents[1] / "dsv4")


@dataclass
class Tally:
    """Counts of one step: (module, function, op) -> launches; plus host syncs."""

    kernels: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)


class _Attribution:
    """The current module path (forward hooks) and the innermost dsv4 function (stack)."""

    def __init__(self, model: torch.nn.Module, kinds: dict[int, str]) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, mod in model.named_modules():
            label = re.sub(r"^layers\.(\d+)", lambda m: f"layers[{kinds[int(m.group(1))]}]",
                           name) or "model"
            self.handles.append(mod.register_forward_pre_hook(
                lambda _m, _a, label=label: self.stack.append(label)))
            self.handles.append(mod.register_forward_hook(self._pop))

    def _pop(self, _mod: Any, _args: Any, _out: Any) -> None:
        self.stack.pop()  # returns None: a hook's return value would replace the output

    def module(self) -> str:
        return self.stack[-1] if self.stack else "(outside modules)"

    @staticmethod
    def function() -> str:
        f = sys._getframe(2)
        while f is not None:
            path = f.f_code.co_filename
            if path.startswith(_DSV4):
                qual = getattr(f.f_code, "co_qualname", f.f_code.co_name)
                return f"{path[len(_DSV4) + 1:]}:{qual}"
            f = f.f_back
        return "(no dsv4 frame)"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _Counter(TorchDispatchMode):
    """Counts kernel-launching aten ops by source while active."""

    def __init__(self, attr: _Attribution, tally: Tally) -> None:
        super().__init__()
        self.attr = attr
        self.tally = tally
        self.in_triton = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.in_triton:
            return out
        name = func.overloadpacket.__name__
        if name in HOST_SYNC:
            self.tally.syncs[(self.attr.module(), self.attr.function(), name)] += 1
        elif name not in NO_KERNEL and not func.is_view:
            self.tally.kernels[(self.attr.module(), self.attr.function(), f"aten.{name}")] += 1
        return out


def _patch_triton(counter: _Counter) -> Any:
    """Count each interpreted kernel launch; returns a function that undoes the patch."""
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = counter.in_triton == 0
        if outer and not kwargs.get("warmup"):
            key = (counter.attr.module(), counter.attr.function(), f"triton.{self.fn.__name__}")
            counter.tally.kernels[key] += 1
        counter.in_triton += 1
        try:
            return real(self, *args, **kwargs)
        finally:
            counter.in_triton -= 1

    InterpretedFunction.run = run

    def undo() -> None:
        InterpretedFunction.run = real
    return undo


def layer_kinds(cfg: Any) -> dict[int, str]:
    """Layer index -> kind label: attention (window / CSA r4 / HCA r128) + routing."""
    out = {}
    for i in range(cfg.n_layers):
        r = cfg.compressor_ratio(i)
        att = "window" if r == 0 else ("CSA" if r == 4 else "HCA") + f"r{r}"
        out[i] = f"{i}:{att}+{'hash' if cfg.is_hash_layer(i) else 'learned'}"
    return out


def build(layers: int, backend: str, seed: int = 0) -> Any:
    """The toy-width V4-Flash-schedule model on CPU (quantized storage, official numerics)."""
    import bench.flash_bench as fb
    from dsv4.model.layers import quantized_storage
    from dsv4.model.transformer import Transformer

    fb.DEV = "cpu"
    cfg = fb.flash_config(layers, tiny=True)
    with quantized_storage():
        model = Transformer(cfg, numerics="official", backend=backend, dtype=torch.bfloat16)
    fb.fill_random(model, seed)
    return model.eval()


def _ops_modules() -> list[Any]:
    import importlib
    import pkgutil

    import dsv4.ops
    return [importlib.import_module(f"dsv4.ops.{m.name}")
            for m in pkgutil.iter_modules(dsv4.ops.__path__)]


def _twins_only(on: bool) -> None:
    """With the interpreter on, route the op wrappers to the twins (fast prefill) or not."""
    interp = (not on) and os.environ.get("TRITON_INTERPRET") == "1"
    for m in _ops_modules():
        if hasattr(m, "_INTERPRET_HOST"):
            m._INTERPRET_HOST = interp


@contextlib.contextmanager
def _as_on_gpu(model: Any) -> Iterator[None]:
    """Make the step take the GPU's launch decisions on CPU tensors: the ops plan tiles for
    the H200's 132 SMs (split-K choices change the launch count), and quantized ``Linear``s,
    which pick the op table by device, get the model's table."""
    import dsv4.ops
    from dsv4.ops import triton_dense

    real_sm, real_get = triton_dense.sm_count, dsv4.ops.get_ops
    mods = [m for m in _ops_modules() if getattr(m, "sm_count", None) is real_sm]
    for m in mods:
        m.sm_count = lambda device: 132
    dsv4.ops.get_ops = lambda backend="torch": real_get(model.backend)
    try:
        yield
    finally:
        for m in mods:
            m.sm_count = real_sm
        dsv4.ops.get_ops = real_get


@torch.no_grad()
def count_step(model: Any, batch: int, ctx_len: int, seed: int = 0) -> Tally:
    """Prefill ``batch`` requests of ``ctx_len`` tokens, then count one static decode step."""
    from dsv4.cache.formats import RECORD_DTYPE
    from dsv4.cache.tensors import HybridCache
    from dsv4.engine.cuda_graphs import DecodeGraphs
    from dsv4.model.context import StaticShape, StepContext, pages_needed

    cfg = model.cfg
    page = 256
    ppr = pages_needed(ctx_len + 4, page)
    cache = HybridCache.allocate(cfg, num_pages=batch * ppr + 1, num_slots=batch + 1,
                                 page_size=page, dtype=RECORD_DTYPE, device="cpu")
    tables = [list(range(r * ppr, (r + 1) * ppr)) for r in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch * ctx_len,), generator=gen)
    _twins_only(True)
    try:
        model.forward(StepContext.build(ids, [ctx_len] * batch, [0] * batch, list(range(batch)),
                                        tables), cache)
    finally:
        _twins_only(False)
    static = StaticShape(max_pages=ppr, scratch_slot=batch, scratch_page=batch * ppr)
    graphs = DecodeGraphs(model, cache, static, batch, device=torch.device("cpu"),
                          use_graphs=False)

    tokens = torch.randint(0, cfg.vocab_size, (2, batch), generator=gen).tolist()

    def step(pos: int) -> None:
        graphs.run(tokens[pos - ctx_len], [pos] * batch, list(range(batch)), tables)

    # warm-up: lazy tables, as the warm-up before a capture
    return _count(model, lambda: step(ctx_len), lambda: step(ctx_len + 1))


def _count(model: Any, warm_up: Callable[[], None], counted: Callable[[], None],
           graphed: Any = None) -> Tally:
    """Run ``warm_up`` uncounted, then count the kernels (and host syncs) of ``counted``, both
    taking the GPU's launch decisions (:func:`_as_on_gpu`).  ``graphed``: a ``PrefillGraphs``
    whose segments are not counted (a graph replay launches them, not the host)."""
    tally = Tally()
    attr = _Attribution(model, layer_kinds(model.cfg))
    counter = _Counter(attr, tally)
    undo = _patch_triton(counter) if os.environ.get("TRITON_INTERPRET") == "1" else None
    if graphed is not None:
        segment = graphed._segment

        def uncounted(*args: Any) -> None:
            counter.in_triton += 1      # the counter's "not counted" depth
            try:
                segment(*args)
            finally:
                counter.in_triton -= 1
        graphed._segment = uncounted
    try:
        with _as_on_gpu(model):
            warm_up()
            tally.kernels.clear()
            tally.syncs.clear()
            with counter:
                counted()
    finally:
        attr.remove()
        if undo:
            undo()
    return tally


@torch.no_grad()
def count_prefill(model: Any, tokens: int, seed: int = 0, piecewise: bool = False) -> Tally:
    """Count one eager prefill step of one request of ``tokens`` tokens from position 0 (what
    the engine runs for a prompt chunk without prefill graphs), after a warm-up prefill of the
    same size in another slot (lazy tables).  ``piecewise``: the step as the engine's
    ``prefill_graphs`` runs it, counting only what stays eager (the attention's cache part,
    the step's plans and the head), not the graph segments."""
    from dsv4.cache.formats import RECORD_DTYPE
    from dsv4.cache.tensors import HybridCache
    from dsv4.model.context import StepContext, pages_needed

    cfg = model.cfg
    page = 256
    ppr = pages_needed(tokens + 4, page)
    cache = HybridCache.allocate(cfg, num_pages=2 * ppr, num_slots=2, page_size=page,
                                 dtype=RECORD_DTYPE, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)

    graphs = None
    forward = model.forward
    if piecewise:
        from dsv4.engine.prefill_graphs import PREFILL_BUCKETS, PrefillGraphs
        graphs = PrefillGraphs(model, next(b for b in PREFILL_BUCKETS if b >= tokens),
                               use_graphs=False, cache=cache)
        forward = graphs.forward

    def step(slot: int) -> None:
        table = list(range(slot * ppr, (slot + 1) * ppr))
        model.compute_logits(forward(StepContext.build(ids, [tokens], [0], [slot], [table]),
                                     cache))

    return _count(model, lambda: step(1), lambda: step(0), graphs)


def report(tally: Tally, top: int) -> dict[str, Any]:
    """Print the tables; return them as JSON-able data."""
    total = sum(tally.kernels.values())
    by_source = Counter()
    for (mod, fn, op), n in tally.kernels.items():
        by_source[(re.sub(r"^layers\[[^\]]*\]", "layers[*]", mod), fn, op)] += n
    print(f"  total device kernels per step: {total}"
          f" (triton {sum(n for k, n in tally.kernels.items() if k[2].startswith('triton.'))},"
          f" torch {sum(n for k, n in tally.kernels.items() if k[2].startswith('aten.'))})")
    print(f"  {'count':>6} {'share':>6}  module / dsv4 function / op")
    rows = []
    for (mod, fn, op), n in by_source.most_common():
        rows.append({"module": mod, "function": fn, "op": op, "count": n})
    for r in rows[:top]:
        print(f"  {r['count']:6d} {r['count'] / total:6.1%}  {r['module']} | {r['function']} | "
              f"{r['op']}")
    by_fn = Counter()
    for (mod, fn, op), n in tally.kernels.items():
        by_fn[(re.sub(r"^layers\[[^\]]*\]", "layers[*]", mod), fn)] += n
    print(f"\n  by module / function (top {top}):")
    fn_rows = [{"module": m, "function": f, "count": n} for (m, f), n in by_fn.most_common()]
    for r in fn_rows[:top]:
        print(f"  {r['count']:6d} {r['count'] / total:6.1%}  {r['module']} | {r['function']}")
    per_layer = Counter()
    for (mod, _fn, _op), n in tally.kernels.items():
        m = re.match(r"^layers\[([^\]]*)\]", mod)
        per_layer[m.group(1) if m else "outside layers (embed, head, logits)"] += n
    print("\n  per layer kind:")
    for k in sorted(per_layer, key=lambda s: (not s[0].isdigit(), int(s.split(':')[0])
                                              if s[0].isdigit() else 0)):
        print(f"  {per_layer[k]:6d}  {k}")
    if tally.syncs:
        print(f"\n  host syncs: {dict(tally.syncs)}")
    return {"total": total, "sources": rows, "functions": fn_rows,
            "per_layer": dict(per_layer),
            "syncs": [{"module": m, "function": f, "op": o, "count": n}
                      for (m, f, o), n in tally.syncs.items()]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("triton", "torch"), default="triton")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="also count one eager prefill step of each of these token counts")
    ap.add_argument("--piecewise", action="store_true",
                    help="count the prefill steps as prefill graphs run them: only the "
                    "launches that stay eager (dsv4.engine.prefill_graphs)")
    args = ap.parse_args(argv)
    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("glue_count: --backend triton needs TRITON_INTERPRET=1 set before "
                         "triton is imported (run the script directly)")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = build(args.layers, args.backend)
    out: dict[str, Any] = {"backend": args.backend, "layers": args.layers, "ctx": args.ctx,
                           "kinds": layer_kinds(model.cfg), "batches": {}}
    for b in args.batches:
        print(f"\n=== decode step, B={b}, ctx={args.ctx}, backend={args.backend}, "
              f"{args.layers} layers")
        out["batches"][b] = report(count_step(model, b, args.ctx), args.top)
    out["prefill"] = {}
    for n in args.prefill:
        what = "piecewise (eager launches only)" if args.piecewise else "eager"
        print(f"\n=== {what} prefill step, {n} tokens, backend={args.backend}, "
              f"{args.layers} layers")
        out["prefill"][n] = report(count_prefill(model, n, piecewise=args.piecewise),
                                   args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
