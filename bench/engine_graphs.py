"""Engine decode with and without CUDA graphs (``dsv4.engine.cuda_graphs``) on one GPU.

    PYTHONPATH=. python bench/engine_graphs.py --out graphs.json

Part 1 (tiny V4 checkpoint, bf16 compute, the engine end to end): the same greedy workload
through ``LLMEngine`` three ways: eager (``enforce_eager=True``: dynamic decode steps), CUDA
graphs (default options, cache sized by ``gpu_memory_utilization``), and the static-shape decode
steps run eagerly (the graphs' exact reference: same kernels, same shapes).  Reports token /
logprob agreement, ``check_idle()``, the memory-sizing numbers against the device's memory, and
the per-step time of decode-only steps.

Part 2 (the V4-Flash-shaped model of ``bench/flash_bench.py``, random weights, ``--layers``
layers): decode steps of B requests at ``--ctx`` positions through the engine's
:class:`ModelRunner`: eager forward + logits vs the graph replay (buffer fill included), per B.

Every part runs in its own try/except; results go to ``--out`` as they come.  ``--device cpu``
is a smoke run of the script (static-shape steps eagerly, no graphs, toy widths).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from dsv4.engine.cuda_graphs import DecodeGraphs
from dsv4.engine.llm_engine import LLMEngine
from dsv4.engine.runner import ModelRunner, StepPlan
from dsv4.engine.sampling_params import SamplingParams


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _timed_execute(eng: LLMEngine, dev: str, record: list[tuple[int, bool, float]]) -> None:
    """Wrap the runner's execute: per step (sequences, decode-only, seconds)."""
    real = eng.runner.execute

    def execute(out: Any) -> Any:
        _sync(dev)
        t0 = time.perf_counter()
        res = real(out)
        _sync(dev)
        decode = all(s.num_new_tokens == 1 and s.sample for s in out.scheduled)
        record.append((len(out.scheduled), decode, time.perf_counter() - t0))
        return res

    eng.runner.execute = execute  # type: ignore[method-assign]


def _workload(eng: LLMEngine, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    for i, (prompt, n) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                        ignore_eos=True, logprobs=1))
    done: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, [c.logprobs[k][t].logprob
                                                      for k, t in enumerate(c.token_ids)])
    eng.check_idle()
    return done


def _step_summary(record: list[tuple[int, bool, float]]) -> dict[str, Any]:
    by_b: dict[int, list[float]] = {}
    for n, decode, s in record:
        if decode:
            by_b.setdefault(n, []).append(s)
    return {str(b): {"steps": len(v), "median_ms": statistics.median(v) * 1e3,
                     "min_ms": min(v) * 1e3} for b, v in sorted(by_b.items())}


def _compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    same = sum(a[k][0] == b[k][0] for k in a)
    first_diff = []
    lp_diff = 0.0
    for k in a:
        ta, tb = a[k][0], b[k][0]
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if n is not None:
            first_diff.append((k, n))
        m = len(ta) if n is None else n
        if m:
            lp_diff = max(lp_diff, max(abs(x - y) for x, y in zip(a[k][1][:m], b[k][1][:m])))
    return {"requests": len(a), "identical_tokens": same, "first_divergence": first_diff[:8],
            "max_logprob_diff_before_divergence": lp_diff,
            "bitwise_equal": all(a[k] == b[k] for k in a)}


def tiny_part(dev: str, log: Callable[[str], None], res: dict[str, Any],
              kv_cache_dtype: str = "auto") -> None:
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint
    from dsv4.tokenizer import load_tokenizer

    path = make_tiny_checkpoint(tempfile.mkdtemp() + "/v4", variant="v4", seed=0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = load_model(path, device=dev, dtype=dtype, numerics="bf16",
                       backend="triton" if dev == "cuda" else "torch")
    tok = load_tokenizer(path)
    rng = random.Random(0)
    reqs = [([rng.randrange(20, 500) for _ in range(rng.randrange(5, 300))], 40)
            for _ in range(12)]
    reqs += [([rng.randrange(20, 500) for _ in range(rng.randrange(5, 40))], rng.randrange(8, 60))
             for _ in range(12)]
    common = dict(model=model, tokenizer=tok, device=dev, dtype=dtype, max_model_len=1024,
                  max_num_seqs=32, max_num_batched_tokens=1024, kv_cache_dtype=kv_cache_dtype)
    out: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype}
    res["tiny" if kv_cache_dtype == "auto" else f"tiny_{kv_cache_dtype}"] = out

    # Eager first: it compiles every Triton kernel, so the timed runs below do not.
    eng = LLMEngine(path, enforce_eager=True, num_pages=400, **common)
    rec_e: list = []
    _timed_execute(eng, dev, rec_e)
    t0 = time.perf_counter()
    eager = _workload(eng, reqs)
    out["eager_s"] = time.perf_counter() - t0
    out["eager_decode_steps"] = _step_summary(rec_e)
    log(f"tiny eager: {out['eager_s']:.1f} s")

    # Static-shape steps without graphs (the graphs' reference).
    g = eng.runner
    g.decode_graphs = DecodeGraphs(model, g.cache, _static_of(eng), 32, device=torch.device(dev),
                                   use_graphs=False)
    static = _workload(eng, reqs)
    out["static_eager_stats"] = dict(g.decode_graphs.stats)
    del eng, g
    gc.collect()

    # Graphs, with the cache sized by gpu_memory_utilization (default 0.9) on CUDA.
    kw = {} if dev == "cuda" else {"num_pages": 400}
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    logging.getLogger("dsv4").setLevel(logging.INFO)
    t0 = time.perf_counter()
    eng = LLMEngine(path, **kw, **common)
    out["engine_init_s"] = time.perf_counter() - t0
    out["num_pages"] = eng.manager.num_pages
    if dev == "cuda":
        free, total = torch.cuda.mem_get_info()
        out["after_init"] = {"total_GiB": total / 2**30, "used_GiB": (total - free) / 2**30,
                             "used_fraction": (total - free) / total,
                             "cache_GiB": eng.runner.cache.memory_bytes() / 2**30}
    rec_g: list = []
    _timed_execute(eng, dev, rec_g)
    t0 = time.perf_counter()
    graphs = _workload(eng, reqs)
    out["graph_s"] = time.perf_counter() - t0
    dg = eng.runner.decode_graphs
    out["graph_stats"] = dict(dg.stats) if dg is not None else "graphs off"
    out["graphs_disabled_reason"] = eng.runner.graphs_disabled_reason
    if dg is not None:
        out["graph_pool_bytes"] = dg.pool_bytes()
    out["graph_buckets_captured"] = sorted(dg.graphs) if dg is not None else []
    out["graph_decode_steps"] = _step_summary(rec_g)
    if dev == "cuda":
        free, total = torch.cuda.mem_get_info()
        out["after_run"] = {"used_fraction": (total - free) / total,
                            "max_reserved_fraction":
                                torch.cuda.max_memory_reserved() / total}
    out["check_idle"] = "ok"   # _workload calls check_idle() on every engine
    out["graph_vs_static_eager"] = _compare(graphs, static)
    out["graph_vs_eager"] = _compare(graphs, eager)
    out["static_eager_vs_eager"] = _compare(static, eager)
    log(f"tiny graphs: {out['graph_s']:.1f} s; vs static eager "
        f"{out['graph_vs_static_eager']}; vs eager {out['graph_vs_eager']}")
    del eng
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def _static_of(eng: LLMEngine):
    from dsv4.model.context import StaticShape, pages_needed

    return StaticShape(max_pages=pages_needed(eng.max_model_len, eng.manager.page_size),
                       scratch_slot=eng.manager.num_slots, scratch_page=eng.manager.num_pages)


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    ts = list(cache.window.values()) + list(cache.compressed.values())
    ts += list(cache.index_keys.values())
    return ts + [t for s in cache.states.values() for t in (s.kv, s.score)]


def _profile_tables(fn: Callable[[], Any], dev: str, reps: int = 3) -> str:
    """torch.profiler table (device time per kernel, host ops) of ``reps`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        _sync(dev)
    key = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)


def flash_part(dev: str, layers: int, batches: list[int], ctx: int, steps: int,
               log: Callable[[str], None], res: dict[str, Any],
               save: Callable[[], None] = lambda: None, kv_cache_dtype: str = "auto",
               profile_path: str | None = None, extra_pages: int = 0) -> None:
    """Per B: the eager (dynamic) decode step against the static-shape graph step of the
    4-layer V4-Flash-shaped model.  ``profile_path``: append profiler tables of both (the
    static step's kernels included); ``extra_pages``: unused cache pages added to the pools (a
    served engine's pools are tens of thousands of pages)."""
    import bench.flash_bench as fb
    from dsv4.engine.runner import resolve_cache_dtype

    fb.DEV = dev
    tiny = dev != "cuda"
    model = fb.build_model(layers, tiny)
    cfg = model.cfg
    page = 256
    ppr = -(-(ctx + steps + 30) // page)
    Bmax = max(batches)
    out: dict[str, Any] = {"layers": layers, "ctx": ctx, "extra_pages": extra_pages, "per_B": {}}
    res["flash" if kv_cache_dtype == "auto" else f"flash_{kv_cache_dtype}"] = out
    cache_dtype = resolve_cache_dtype(kv_cache_dtype, torch.bfloat16, torch.device(dev))
    out["cache_dtype"] = str(cache_dtype)
    runner = ModelRunner(model, cfg, device=torch.device(dev), cache_dtype=cache_dtype,
                         num_pages=Bmax * ppr + extra_pages, num_slots=Bmax, page_size=page,
                         max_model_len=ppr * page, cuda_graph_max_batch=Bmax,
                         static_decode=True)
    if dev == "cuda":
        out["model_GB"] = torch.cuda.memory_allocated() / 1e9
    log(f"flash model: {layers} layers; cache {cache_dtype}")
    for B in batches:
        r: dict[str, Any] = {}
        out["per_B"][str(B)] = r
        try:
            tables = [list(range(i * ppr, (i + 1) * ppr)) for i in range(B)]

            def plan(k: int) -> StepPlan:
                return StepPlan([7 + i for i in range(B)], [1] * B, [ctx + k] * B,
                                list(range(B)), tables, list(range(B)))

            def eager(k: int) -> torch.Tensor:
                return model.compute_logits(runner.run_plan(plan(k)))

            def graph(k: int) -> torch.Tensor:
                return runner._run_static(plan(k))

            eager(0)
            _sync(dev)
            times = []
            for k in range(steps):
                _sync(dev)
                t0 = time.perf_counter()
                eager(k)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            r["eager_ms"] = statistics.median(times) * 1e3
            t0 = time.perf_counter()
            graph(0)
            _sync(dev)
            r["first_graph_step_s"] = time.perf_counter() - t0   # capture included
            times = []
            for k in range(20):
                _sync(dev)
                t0 = time.perf_counter()
                graph(k)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            r["graph_ms"] = statistics.median(times) * 1e3
            r["speedup"] = r["eager_ms"] / r["graph_ms"]
            # The same step from the same cache state both ways.
            saved = [t.clone() for t in _cache_tensors(runner.cache)]
            a = eager(steps).float()
            for t, v in zip(_cache_tensors(runner.cache), saved):
                t.copy_(v)
            b = graph(steps).float()
            r["graph_vs_eager_max_abs_logit_diff"] = float((a - b).abs().max())
            r["logits_finite"] = bool(torch.isfinite(b).all())
            if profile_path:
                with open(profile_path, "a", encoding="utf-8") as f:
                    for name, fn in (("static graph step", lambda: graph(steps)),
                                     ("eager step", lambda: eager(steps))):
                        f.write(f"===== B={B} ctx={ctx} extra_pages={extra_pages}: {name} x3\n"
                                f"{_profile_tables(fn, dev)}\n\n")
            log(f"flash B={B}: eager {r['eager_ms']:.2f} ms, graph {r['graph_ms']:.2f} ms "
                f"(x{r['speedup']:.1f}); first graph step {r['first_graph_step_s']:.2f} s")
        except Exception as e:  # noqa: BLE001 - report and go on
            r["error"] = f"{type(e).__name__}: {e}"[:600]
            r["traceback"] = traceback.format_exc()[-3000:]
            log(f"flash B={B} failed: {r['error']}")
        save()
    out["graphs_disabled_reason"] = runner.graphs_disabled_reason
    if runner.decode_graphs is not None:
        out["graph_pool_bytes"] = runner.decode_graphs.pool_bytes()
        out["graph_stats"] = dict(runner.decode_graphs.stats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=330.0,
                    help="seconds; the flash part is skipped when part 1 ends later than "
                         "budget − 150")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--skip-flash", action="store_true")
    ap.add_argument("--profile", default=None, help="append profiler tables of the flash "
                    "part's eager and static graph steps to this file")
    ap.add_argument("--extra-pages", type=int, default=0, help="unused cache pages added to "
                    "the flash part's pools (a served engine holds tens of thousands)")
    args = ap.parse_args(argv)
    t_start = time.time()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(message)s")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda"
                           else "cpu", "torch": torch.__version__, "errors": []}

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)

    parts = []
    if not args.skip_tiny:
        parts.append(("tiny", lambda: tiny_part(args.device, log, res)))
    if not args.skip_flash:
        parts.append(("flash", lambda: flash_part(
            args.device, args.layers, [int(b) for b in args.batches.split(",")], args.ctx,
            args.steps, log, res, save, profile_path=args.profile,
            extra_pages=args.extra_pages)))
    for name, fn in parts:
        if name == "flash" and time.time() - t_start > args.budget - 150:
            res["errors"].append("flash part skipped: budget")
            log("flash part skipped: budget")
            continue
        try:
            fn()
            failed = name == "flash" and all("error" in r for r in res["flash"]["per_B"].values())
        except Exception as e:  # noqa: BLE001 - report and go on
            res["errors"].append({"part": name, "error": f"{type(e).__name__}: {e}"[:800],
                                  "traceback": traceback.format_exc()[-4000:]})
            log(f"{name} failed: {type(e).__name__}: {e}")
            failed = True
        if failed and args.device == "cuda" and time.time() - t_start < args.budget - 120:
            # The default (FP8 record) cache failed: once more with bf16 rows.
            log(f"{name}: retrying with kv_cache_dtype='bf16'")
            gc.collect()
            torch.cuda.empty_cache()
            try:
                if name == "tiny":
                    tiny_part(args.device, log, res, "bf16")
                else:
                    flash_part(args.device, args.layers, [int(b) for b in args.batches.split(",")],
                               args.ctx, args.steps, log, res, save, "bf16")
            except Exception as e:  # noqa: BLE001
                res["errors"].append({"part": name + "_bf16",
                                      "error": f"{type(e).__name__}: {e}"[:800],
                                      "traceback": traceback.format_exc()[-4000:]})
        save()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    log(json.dumps(res, indent=1, default=str)[:6000])
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
