"""Full-size V4-Flash served by the engine over several GPUs (tensor / expert parallel), random
weights made on each GPU: time per output token and output tokens/s against the decode floor.

    torchrun --nproc-per-node 2 bench/tp_bench.py --layers 43 --ep --graphs --out tp.json
    torchrun --nproc-per-node 2 bench/tp_bench.py --tiny --out tiny.json    # CPU, gloo, seconds
    torchrun --nproc-per-node 1 bench/tp_bench.py --layers 43 --experts 64 --graphs \
        --concurrency 1,16 --prompt-len 256 --output-len 32 [--no-prefill-graphs]   # one GPU: TTFT

Every rank builds its shard of V4-Flash (``bench/flash_bench.py``'s config: real widths, the
first ``--layers`` of the 43 layers, FP8 weights, MXFP4 experts, no MTP stage) with random
weights in the checkpoint formats, made directly on its GPU and cut by the loader's shard plan
(``dsv4.dist.random_weights``), and hands it to ``LLMEngine`` through ``model_factory``.
Rank 0 then runs the workloads through the engine (scheduler, chunked prefill, sampler; FP8 KV
cache records by default): for each ``--concurrency`` c, c requests of ``--prompt-len`` random
tokens and ``--output-len`` output tokens (greedy, ``ignore_eos``) submitted at once.  The other
ranks run the engine's worker loop.  Before the timed workloads a short warm-up at each
concurrency compiles the kernels and (``--graphs``) captures the decode graphs.

Reported per concurrency: TTFT, TPOT (per request: (last token − first token) / (n − 1),
median), the mean decode-only step time, output tokens/s over the whole workload (prefill
included) and over the decode-only steps, each with the decode floor:

    floor step(B) = max over ranks of (bytes that rank reads in one decode step of B requests)
                    / 4.29 TB/s (the H200 copy bandwidth measured, shared/GPU.md)

with the bytes, in checkpoint formats: the rank's dense weights (its attention heads / groups,
its slice of the shared expert, the replicated latents, norms, mHC, compressor, indexer, gate),
its routed experts that B random tokens touch (E_rank · (1 − (1 − k/E)^B) per layer, k = 6 of
E = 256: uniform routing, which random weights give), the head on rank 0 (only it samples), B
embedding rows, and the KV cache the step reads (replicated: every rank reads the whole window,
the selected compressed entries and the scored indexer keys, in the cache's record format) at
the context ``prompt + output/2``.  Collectives are not in the floor.  TPOT ratio = TPOT / floor
step(c); throughput ratio = (c / floor step(c)) / measured tokens/s.

``--budget`` seconds stops early (the running workload is aborted and reported as partial);
results go to ``--out`` after every workload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flash_bench import BW, flash_config_dict  # noqa: E402  (bench/ sibling)

from dsv4.cache.tensors import HybridCache  # noqa: E402
from dsv4.checkpoint import TensorShard, expected_tensors  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.dist.parallel import Parallel  # noqa: E402
from dsv4.dist.sharding import shard_plan  # noqa: E402

ANCHOR_SGLANG_TPOT_S = 3.37e-3   # SGLang, V4-Flash FP4 on 4×H200 (TP4), concurrency 1 (issue #7)


class RandomIdTokenizer:
    """Stands in for the tokenizer of a random-weight model: prompts are token ids, and output
    text is not looked at (every id decodes to an empty string)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kw: Any) -> str:
        return ""


# ------------------------------------------------------------------------------ floors
def _stored_bytes(spec: Any) -> int:
    n = 1
    for s in spec.stored_shape:
        n *= s
    out = n * torch.empty((), dtype=spec.dtype).element_size()
    if spec.scale_shape is not None:
        m = 1
        for s in spec.scale_shape:
            m *= s
        out += m * torch.empty((), dtype=spec.scale_dtype).element_size()
    return out


def _fraction(spec: Any, piece: TensorShard | None) -> float:
    if piece is None:
        return 1.0
    return (piece.stop - piece.start) / spec.shape[piece.dim]


def rank_weight_bytes(cfg: ModelConfig, rank: int, world: int, ep: bool) -> dict[str, float]:
    """Checkpoint-format bytes one rank holds, by role: ``dense`` (read every step),
    ``head``, ``embed_row`` (bytes of one embedding row), ``expert`` (one routed expert's
    slice on this rank) and ``local_experts`` (routed experts per layer on this rank)."""
    plan = shard_plan(cfg, Parallel(rank, world, rank, expert_parallel=ep)) if world > 1 else {}
    out = {"dense": 0.0, "head": 0.0, "embed_row": 0.0, "expert": 0.0, "local_experts": 0.0}
    per_expert: dict[str, float] = {}   # layer 0's routed experts on this rank -> bytes
    for name, spec in expected_tensors(cfg).items():
        if name.startswith("mtp."):
            continue  # MTP stages are not run
        if name in plan and plan[name] is None:
            continue  # another rank's expert / shared expert
        size = _stored_bytes(spec) * _fraction(spec, plan.get(name))
        parts = name.split(".")
        if parts[2:4] == ["ffn", "experts"]:
            if parts[1] == "0":  # every layer has the same experts
                per_expert[parts[4]] = per_expert.get(parts[4], 0.0) + size
        elif name == "head.weight":
            out["head"] = size
        elif name == "embed.weight":
            out["embed_row"] = size / spec.shape[0]
        elif not name.endswith("tid2eid"):  # a hash table row is a few bytes per token
            out["dense"] += size
    if per_expert:
        out["local_experts"] = float(len(per_expert))
        out["expert"] = sum(per_expert.values()) / len(per_expert)
    return out


def kv_read_bytes(cfg: ModelConfig, ctx_len: int, cache_dtype: torch.dtype) -> float:
    """Cache bytes one decode step of one request at ``ctx_len`` reads, over the layers: window
    rows, compressed entries attended (top-k of the CSA layers, all of the HCA layers) and the
    index keys scored (CSA)."""
    window_row, entry, key = HybridCache._row_bytes(cfg, cache_dtype)
    total = 0.0
    for layer in range(cfg.n_layers):
        r = cfg.ratio(layer)
        total += min(cfg.window_size, ctx_len) * window_row
        if r == 4:
            n = ctx_len // 4
            total += min(cfg.index_topk, n) * entry + n * key
        elif r > 0:
            total += (ctx_len // r) * entry
    return total


def decode_floor(cfg: ModelConfig, world: int, ep: bool, batch: int, ctx_len: int,
                 cache_dtype: torch.dtype) -> dict[str, Any]:
    """The floor of one decode step of ``batch`` requests (see the module docstring)."""
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    touched = 1 - (1 - k / E) ** batch
    moe_layers = cfg.n_layers
    kv = kv_read_bytes(cfg, ctx_len, cache_dtype) * batch
    ranks = []
    for r in range(world):
        w = rank_weight_bytes(cfg, r, world, ep)
        experts = w["expert"] * w["local_experts"] * touched * moe_layers
        total = (w["dense"] + experts + batch * w["embed_row"]
                 + (w["head"] if r == 0 else 0.0) + kv)
        ranks.append({"dense": w["dense"], "experts": experts, "head": w["head"] if r == 0
                      else 0.0, "kv": kv, "total": total,
                      "held_weight_bytes": w["dense"] + w["head"] + w["embed_row"] * cfg.vocab_size
                      + w["expert"] * w["local_experts"] * moe_layers})
    worst = max(x["total"] for x in ranks)
    return {"batch": batch, "ctx": ctx_len, "floor_step_s": worst / BW,
            "floor_tokens_per_s": batch * BW / worst, "per_rank": ranks}


# ------------------------------------------------------------------------------ engine
def bench_config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """config.json of the benchmark model: V4-Flash's (``flash_bench.flash_config_dict``)."""
    d = flash_config_dict(args.layers, args.tiny, args.experts)
    d["num_hash_layers"] = min(d["num_hash_layers"], args.layers)
    if args.tiny:
        # Each rank's expert slice must hold whole 128-wide activation-quantization blocks
        # (official numerics), as V4-Flash's 2048 / 2 does.
        d["moe_intermediate_size"] = 128 * args.world
    return d


def build_engine(args: argparse.Namespace, cfg_dir: str) -> Any:
    """LLMEngine around this rank's random-weight model (``model_factory``)."""
    from dsv4.dist.random_weights import build_random_model, model_bytes
    from dsv4.engine.llm_engine import LLMEngine

    def factory(cfg: ModelConfig, par: Parallel, device: torch.device, dtype: torch.dtype) -> Any:
        t0 = time.perf_counter()
        model = build_random_model(cfg, parallel=par, device=device, dtype=dtype,
                                   numerics=args.numerics, seed=args.seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        held = model_bytes(model)
        gpu = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        print(f"[rank {par.rank}] model built in {time.perf_counter() - t0:.1f} s: "
              f"{held['total'] / 1e9:.2f} GB held ({held['routed_experts'] / 1e9:.2f} GB routed "
              f"experts, {held['other'] / 1e9:.2f} GB other); device allocated "
              f"{gpu / 1e9:.2f} GB", flush=True)
        build_info.update(seconds=time.perf_counter() - t0, bytes=held, device_allocated=gpu)
        return model

    build_info: dict[str, Any] = {}
    max_c = max(args.concurrency)
    max_len = args.prompt_len + args.output_len + 8
    opts: dict[str, Any] = dict(
        model_factory=factory, tokenizer=RandomIdTokenizer(), device=args.device,
        tensor_parallel_size=args.world, expert_parallel=args.ep, numerics=args.numerics,
        max_num_seqs=max_c, cuda_graph_max_batch=max_c, max_model_len=max_len,
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
        enforce_eager=not args.graphs, cuda_graphs_under_tp=args.graphs,
        prefill_graphs=args.prefill_graphs, warmup=args.engine_warmup,
        precompile=args.engine_precompile)
    if args.device == "cuda":
        opts.update(dtype="bfloat16", kv_cache_dtype=args.kv_cache_dtype,
                    gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        opts.update(dtype=args.cpu_dtype, kv_cache_dtype=args.kv_cache_dtype)
    engine = LLMEngine(cfg_dir, **opts)
    engine.bench_build_info = build_info  # type: ignore[attr-defined]
    if args.graphs and args.device != "cuda":
        _static_decode_on_cpu(engine)
    return engine


def _static_decode_on_cpu(engine: Any) -> None:
    """CPU stand-in for ``--graphs``: every rank runs decode steps as the static-shape steps the
    graphs replay (eagerly), through the same driver / worker protocol."""
    from dsv4.engine.cuda_graphs import DecodeGraphs
    from dsv4.model.context import StaticShape, pages_needed

    runner = engine.runner
    static = StaticShape(pages_needed(engine.max_model_len, runner.page_size),
                         engine.manager.num_slots, engine.manager.num_pages)
    runner.decode_graphs = DecodeGraphs(
        runner.model, runner.cache, static, engine.options.cuda_graph_max_batch,
        device=engine.device, use_graphs=False, with_token_types=engine.config.is_v41,
        with_logits=engine.is_driver)


def _gather(par: Parallel, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (host side, the control group)."""
    if not par.enabled:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * par.world_size
    dist.all_gather_object(out, obj, group=par.control_group)
    return out


# ------------------------------------------------------------------------------ workloads
def _start_profile() -> Any:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def _host_profiled_step(engine: Any, path: str, title: str) -> list[Any]:
    """One ``engine.step()`` under cProfile (host time by function; the device sync at its end
    shows how long the host waited for the GPU), its tables appended to ``path``."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    outs = engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pr.disable()
    dt = time.perf_counter() - t0
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    buf.write(f"===== {title}: {dt * 1e3:.1f} ms under the profiler\n")
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    with open(path, "a", encoding="utf-8") as f:
        f.write(buf.getvalue() + "\n")
    print(f"{title}: {dt * 1e3:.1f} ms under cProfile (tables in {path})", flush=True)
    return outs


def _stop_profile(prof: Any, path: str, title: str) -> None:
    prof.__exit__(None, None, None)
    ka = prof.key_averages()
    tabs = [f"===== {title}"]
    for key in ("self_cuda_time_total", "cpu_time_total"):
        try:
            tabs.append(f"--- by {key}\n" + ka.table(sort_by=key, row_limit=40,
                                                    max_name_column_width=70))
        except Exception as e:  # noqa: BLE001 - a profiler without CUDA columns
            tabs.append(f"--- by {key}: {e}")
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(tabs) + "\n\n")


def _host_counters(runner: Any) -> dict[str, float]:
    """Cumulative host seconds of the step phases around replays (ModelRunner.host_s,
    DecodeGraphs.stats) and the replay count."""
    g = runner.decode_graphs.stats if runner.decode_graphs is not None else {}
    return {**runner.host_s, "fill": g.get("fill_s", 0.0), "launch": g.get("launch_s", 0.0),
            "replays": g.get("replays", 0)}


def _host_ms(before: dict[str, float], after: dict[str, float], steps: int
             ) -> dict[str, float] | None:
    """Host ms per step of planning, and per replayed step of the plan broadcast, buffer fill
    and graph launch (the host work the GPU may wait for between two replays)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    n = d.pop("replays")
    if not n or not steps:
        return None
    return {"plan_per_step": d.pop("plan") * 1e3 / steps,
            **{f"{k}_per_replay": v * 1e3 / n for k, v in d.items()}}


def run_workload(engine: Any, concurrency: int, prompt_len: int, output_len: int, seed: int,
                 deadline: float, profile_path: str | None = None, trace: bool = False,
                 host_profile: str | None = None) -> dict[str, Any]:
    """c requests at once; per-request TTFT / TPOT and per-step times.  Past ``deadline`` the
    rest is aborted and the result is marked partial.  ``profile_path``: torch.profiler tables
    (driver's host ops and its GPU's kernels, NCCL included) of decode-only steps 9..12;
    ``trace``: print every step's time; ``host_profile``: append cProfile tables of the first
    step (the prefill that gives TTFT, with a device sync at its end) to this file."""
    from dsv4.engine.sampling_params import SamplingParams

    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    from dsv4.engine.warmup import kernels_loaded, kernels_loaded_since

    host0 = _host_counters(engine.runner)
    kernels0 = kernels_loaded()
    t0 = time.perf_counter()
    ids = []
    for i in range(concurrency):
        rid = f"c{concurrency}-{seed}-{i}"
        prompt = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    steps: list[dict[str, Any]] = []
    partial = False
    prof: Any = None
    n_decode = 0
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            engine.abort_request(list(ids))
            partial = True
            break
        # A decode-only step: nothing waits, and every running sequence returns its next
        # token (one still prefilling returns nothing; one finishing its prefill, its first).
        sched = engine.scheduler
        idle_queue, running = sched.num_waiting == 0, sched.num_running
        if profile_path and prof is None and n_decode == 8:
            prof = _start_profile()
        s0 = time.perf_counter()
        if host_profile and not steps:   # the first step (the prefill) under cProfile
            outs = _host_profiled_step(engine, host_profile,
                                       f"concurrency {concurrency}, first step")
        else:
            # No device sync here: a pipelined engine returns step N's tokens while step N+1
            # runs (a sync would serialize them); each call still waits for its step's samples.
            outs = engine.step()
        now = time.perf_counter()
        decode_only = (idle_queue and len(outs) == running > 0
                       and all(len(o.outputs[0].token_ids) > 1 for o in outs))
        n_decode += decode_only
        if prof is not None and n_decode == 12:
            _stop_profile(prof, profile_path, f"concurrency {concurrency}, 4 decode-only steps")
            prof = False
        steps.append({"s": now - s0, "tokens": len(outs), "decode_only": decode_only})
        if trace:
            print(f"c={concurrency} step {len(steps)}: {(now - s0) * 1e3:.1f} ms, {len(outs)} "
                  f"outputs, {running} running, decode-only {decode_only}", flush=True)
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            last[o.request_id] = now
            counts[o.request_id] = n
    wall = time.perf_counter() - t0
    host = _host_ms(host0, _host_counters(engine.runner), len(steps))
    if host is not None:
        print(f"c={concurrency} host ms: " + ", ".join(f"{k} {v:.3f}" for k, v in host.items())
              + f"; pipelined launches so far {getattr(engine, '_pipelined_launches', 0)}",
              flush=True)
    out_tokens = sum(counts.values())
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    ttfts = [first[r] - t0 for r in first]
    dec = [s for s in steps if s["decode_only"]]
    dec_s = sum(s["s"] for s in dec)
    dec_tok = sum(s["tokens"] for s in dec)
    return {"concurrency": concurrency, "prompt_len": prompt_len, "output_len": output_len,
            "partial": partial, "kernels_loaded": kernels_loaded() - kernels0,
            "kernels_loaded_names": kernels_loaded_since(kernels0),
            "wall_s": wall, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "tpot_median_s": statistics.median(tpots) if tpots else None,
            "tpot_mean_s": statistics.fmean(tpots) if tpots else None,
            "decode_steps": len(dec),
            "decode_step_mean_s": dec_s / len(dec) if dec else None,
            "decode_step_median_s": statistics.median(s["s"] for s in dec) if dec else None,
            # (step number, seconds) of the slowest decode-only steps: a mean far above the
            # median comes from a few of them.
            "slowest_decode_steps": sorted(((i + 1, st["s"]) for i, st in enumerate(steps)
                                            if st["decode_only"]), key=lambda t: -t[1])[:5],
            "decode_tokens_per_s": dec_tok / dec_s if dec_s > 0 else None,
            "host_ms": host, "steps": len(steps)}


def _with_floor(r: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    fs, ft = floor["floor_step_s"], floor["floor_tokens_per_s"]
    r["floor_step_s"], r["floor_tokens_per_s"] = fs, ft
    r["tpot_ratio"] = r["tpot_median_s"] / fs if r.get("tpot_median_s") else None
    r["decode_step_ratio"] = r["decode_step_mean_s"] / fs if r.get("decode_step_mean_s") else None
    r["throughput_ratio"] = ft / r["output_tokens_per_s"] if r["output_tokens_per_s"] else None
    r["decode_throughput_ratio"] = (ft / r["decode_tokens_per_s"]
                                    if r.get("decode_tokens_per_s") else None)
    return r


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def table(rows: list[dict[str, Any]]) -> str:
    """The printed table (one line per concurrency)."""
    head = (f"{'c':>4} {'TTFT ms':>9} {'TPOT ms':>8} {'floor ms':>8} {'ratio':>6} "
            f"{'step ms':>8} {'out tok/s':>10} {'floor tok/s':>11} {'ratio':>6} "
            f"{'dec tok/s':>10} {'ratio':>6} partial")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['concurrency']:>4} {_ms(r['ttft_median_s']):>9} {_ms(r['tpot_median_s']):>8} "
            f"{_ms(r['floor_step_s']):>8} {_x(r['tpot_ratio']):>6} "
            f"{_ms(r['decode_step_mean_s']):>8} {r['output_tokens_per_s']:>10.1f} "
            f"{r['floor_tokens_per_s']:>11.0f} {_x(r['throughput_ratio']):>6} "
            f"{(r['decode_tokens_per_s'] or 0):>10.1f} {_x(r['decode_throughput_ratio']):>6} "
            f"{r['partial']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="layers of V4-Flash (default 43; "
                    "4 with --tiny)")
    ap.add_argument("--ep", action="store_true", help="expert parallel (whole experts per rank)")
    ap.add_argument("--graphs", action="store_true", help="decode CUDA graphs under TP "
                    "(engine option cuda_graphs_under_tp; static-shape steps on CPU)")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="engine option prefill_graphs (default: the engine's, on with "
                         "--graphs on one GPU)")
    ap.add_argument("--engine-warmup", action=argparse.BooleanOptionalAction, default=None,
                    help="engine option warmup (default: the engine's, on for one GPU)")
    ap.add_argument("--engine-precompile", action=argparse.BooleanOptionalAction,
                    default=None, help="engine option precompile (default: the engine's, on "
                    "for one GPU)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts a layer (43 "
                    "layers of 256 do not fit one GPU; one H100 holds 64)")
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,16,64; 1,4 tiny)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 8192 (64 tiny)")
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (6 tiny)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bf16", "auto"])
    ap.add_argument("--numerics", default="official", choices=["official", "bf16"])
    ap.add_argument("--cpu-dtype", default="float32", help="compute dtype on CPU (--tiny)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds from the start; the "
                    "running workload is aborted (partial) and later ones skipped")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="toy widths on CPU with gloo (smoke run)")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    ap.add_argument("--out", default=None, help="JSON results (rank 0)")
    ap.add_argument("--trace", action="store_true", help="print every step's time (rank 0)")
    ap.add_argument("--profile", default=None, help="append torch.profiler tables of 4 "
                    "decode-only steps per concurrency (rank 0) to this file")
    ap.add_argument("--host-profile", default=None, help="append cProfile tables of each "
                    "workload's first step (the prefill; rank 0) to this file")
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.layers = args.layers or (4 if args.tiny else 43)
    args.concurrency = [int(c) for c in (args.concurrency or ("1,4" if args.tiny
                                                              else "1,16,64")).split(",") if c]
    args.prompt_len = args.prompt_len or (64 if args.tiny else 8192)
    args.output_len = args.output_len or (6 if args.tiny else 128)
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"--concurrency must list integers >= 1; got {args.concurrency}")
    if args.output_len < 2:
        ap.error("--output-len must be >= 2 (TPOT needs two tokens)")
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    with tempfile.TemporaryDirectory(prefix="tp_bench-") as cfg_dir:
        with open(os.path.join(cfg_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(bench_config_dict(args), f)
        engine = build_engine(args, cfg_dir)
    par = engine.parallel
    infos = _gather(par, {"rank": par.rank, **engine.bench_build_info,
                          "num_pages": engine.manager.num_pages})
    if not engine.is_driver:
        engine.run_worker()
        # This rank's fill / launch per replay: a worker slower to launch holds the driver's
        # graph at its first all-reduce.
        host = _host_ms({}, {**_host_counters(engine.runner), "plan": 0.0}, 1)
        if host is not None:
            print(f"[rank {par.rank}] host ms per replay: fill {host['fill_per_replay']:.3f}, "
                  f"launch {host['launch_per_replay']:.3f}", flush=True)
        return 0

    cfg = engine.config
    cache_dtype = engine.runner.cache.dtype
    results: dict[str, Any] = {
        "layers": args.layers, "tiny": args.tiny, "world_size": par.world_size, "ep": args.ep,
        "graphs": args.graphs, "device": (torch.cuda.get_device_name() if args.device == "cuda"
                                          else "cpu"),
        "torch": torch.__version__, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "kv_cache": str(cache_dtype), "numerics": args.numerics, "ranks": infos,
        "anchor_sglang_tp4_tpot_s": ANCHOR_SGLANG_TPOT_S, "workloads": [], "errors": [],
        "floor_note": "max over ranks of checkpoint-format bytes read per decode step (dense + "
                      "touched experts + head on rank 0 + KV at prompt+output/2) / 4.29 TB/s; "
                      "collectives excluded"}

    def save() -> None:
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)

    for info in infos:
        log(f"rank {info['rank']}: {info['bytes']['total'] / 1e9:.2f} GB of weights "
            f"(experts {info['bytes']['routed_experts'] / 1e9:.2f} GB), built in "
            f"{info['seconds']:.1f} s; {info['num_pages']} cache pages")
    if engine.precompile_stats is not None:
        p = engine.precompile_stats
        log(f"engine precompile: {p['compiled']} of {p['kernels']} manifest kernels compiled "
            f"by {p['workers']} workers in {p['seconds']:.1f} s ({p['failed']} failed)")
    results["precompile_stats"] = engine.precompile_stats
    if engine.warmup_stats is not None:
        w = engine.warmup_stats
        log(f"engine warm-up: {w['requests']} requests, {w['steps']} steps, {w['seconds']:.1f} s, "
            f"{w['kernels_loaded']} Triton kernels compiled or loaded")
    results["build_s"] = time.perf_counter() - t_start
    save()
    try:
        if not args.no_warmup:
            for c in args.concurrency:
                if time.perf_counter() > deadline:
                    break
                w = run_workload(engine, c, min(16, args.prompt_len), 3, 10_000 + c, deadline)
                log(f"warm-up c={c}: {w['wall_s']:.1f} s")
        for c in args.concurrency:
            if time.perf_counter() > deadline:
                log(f"budget reached: concurrency {c} skipped")
                break
            r = run_workload(engine, c, args.prompt_len, args.output_len, args.seed + c, deadline,
                             args.profile, args.trace, args.host_profile)
            floor = decode_floor(cfg, par.world_size, args.ep, c,
                                 args.prompt_len + args.output_len // 2, cache_dtype)
            r = _with_floor(r, floor)
            r["floor_per_rank"] = floor["per_rank"]
            results["workloads"].append(r)
            log(f"c={c}: TPOT {_ms(r['tpot_median_s'])} ms (floor {_ms(r['floor_step_s'])} ms, "
                f"{_x(r['tpot_ratio'])}), {r['output_tokens_per_s']:.1f} output tok/s, "
                f"{r['kernels_loaded']} Triton kernels compiled or loaded meanwhile"
                f"{' (partial)' if r['partial'] else ''}"
                + "".join(f"\n    {name}" for name in r["kernels_loaded_names"]))
            save()
        graphs = engine.runner.decode_graphs
        results["graph_stats"] = dict(graphs.stats) if graphs is not None else None
        pg = engine.runner.prefill_graphs
        results["prefill_graph_stats"] = dict(pg.stats) if pg is not None else None
        results["graphs_disabled_reason"] = engine.runner.graphs_disabled_reason
        results["warmup_stats"] = engine.warmup_stats
    except Exception:
        results["errors"].append(traceback.format_exc()[-3000:])
        log("workload failed:\n" + results["errors"][-1])
    finally:
        engine.shutdown()
    results["total_s"] = time.perf_counter() - t_start
    save()
    print(table(results["workloads"]), flush=True)
    if results["workloads"] and results["workloads"][0]["concurrency"] == 1:
        tpot = results["workloads"][0]["tpot_median_s"]
        if tpot:
            print(f"anchor: SGLang TP4 on 4xH200 {ANCHOR_SGLANG_TPOT_S * 1e3:.2f} ms/token at c=1; "
                  f"this run {tpot * 1e3:.2f} ms on {par.world_size} "
                  f"({'beats' if tpot < ANCHOR_SGLANG_TPOT_S else 'misses'} it)", flush=True)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
