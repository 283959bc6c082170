"""V4-Flash-shaped end-to-end benchmark on one GPU: prefill throughput and decode step time of the
dsv4 model (Triton backend, FP8 weights, MXFP4 experts kept quantized) against the hardware floor.

    PYTHONPATH=. python bench/flash_bench.py --layers 4 --out flash.json

The model has V4-Flash's real widths (D 4096, 64 heads × 512, q_lora 1024, o_groups 8,
256 experts top-6 with I 2048, vocab 129280) and the first ``--layers`` layers of its schedule
(L0-1 sliding window only, then CSA (ratio 4, indexer) / HCA (ratio 128) alternating; L0-2
hash-routed).  Weights are random and made directly on the GPU in their checkpoint formats (no
files).  The forward is driven directly: ``model.forward(StepContext, HybridCache)``.

Reported, each with its floor and ratio = measured / floor:

* prefill tokens/s of one request of S tokens (floor: FLOPs / 1459 TFLOP/s, the fp8 peak);
* decode step time at batch B with ``--ctx``-token contexts (the context is built once by a
  prefill and copied to the other requests' pages and slots), logits included (floor: bytes of
  weights in checkpoint formats + KV read / 4.29 TB/s), eager and as a CUDA-graph replay of one
  captured step;
* the routed-expert op alone (graph replay) at the decode batches;
* with ``--launch-ab``: each decode step captured once per :data:`LAUNCH_VARIANTS` entry (plain
  launches, programmatic dependent launch, ...) and the graphs' replays timed interleaved in
  one process, with each variant's logits compared to the plain one's.

Floors count the ideal bytes and FLOPs of the workload, not those of this implementation (which,
e.g., holds the head and the compressor weights in fp32): see docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import torch

from dsv4.cache.formats import RECORD_DTYPE, cache_formats, is_record_dtype
from dsv4.cache.tensors import HybridCache
from dsv4.config import ModelConfig
from dsv4.engine.prefill_graphs import PrefillGraphs, run_step
from dsv4.formats import QuantWeight
from dsv4.model.context import StepContext, pages_needed
from dsv4.model.layers import Linear, quantized_storage
from dsv4.model.moe import Experts
from dsv4.model.transformer import Transformer

BW = 4.29e12          # device copy bandwidth measured on the lent H200 (shared/GPU.md)
PEAK_FP8 = 1459e12    # fp8 e4m3 dense GEMM
PAGE = 256
DEV = "cuda"
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]          # the 43 backbone layers of V4-Flash


# ------------------------------------------------------------------------------ model
# --tiny: the same schedule and formats at toy widths (a CPU smoke run of this script).
TINY = {"vocab_size": 512, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 128,
        "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "moe_intermediate_size": 128,
        "n_routed_experts": 16, "index_n_heads": 4, "index_topk": 8, "sliding_window": 16}


def flash_config(layers: int, tiny: bool = False, experts: int | None = None) -> ModelConfig:
    """V4-Flash's config.json with the first ``layers`` layers and no MTP stage."""
    return ModelConfig.from_dict(flash_config_dict(layers, tiny, experts))


def flash_config_dict(layers: int, tiny: bool = False, experts: int | None = None) -> dict:
    """The official config.json keys of :func:`flash_config`; ``experts`` overrides the
    routed-expert count (all 43 layers with 256 experts do not fit one H200; a batch-1 step
    reads the same 6 experts a layer whatever the count)."""
    if not 1 <= layers <= 43:
        raise ValueError(f"--layers must be in 1..43; got {layers}")
    d = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 6, "num_hash_layers": min(3, layers), "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "sliding_window": 128, "index_n_heads": 64,
        "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0,
        "compress_ratios": FLASH_RATIOS[:layers],
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
        "expert_dtype": "fp4", "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if tiny:
        d.update(TINY)
    if experts is not None:
        if not d["num_experts_per_tok"] <= experts <= 256:
            raise ValueError(f"--experts must be in {d['num_experts_per_tok']}..256; got "
                             f"{experts}")
        d["n_routed_experts"] = experts
    return d


def _e8m0(shape: tuple[int, ...], center: int, gen: torch.Generator) -> torch.Tensor:
    """Random e8m0 scale bytes around 2^(center-127) (±1 octave)."""
    b = torch.randint(center - 1, center + 2, shape, generator=gen, device=DEV)
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


@torch.no_grad()
def fill_random(model: Transformer, seed: int = 0) -> None:
    """Random weights, made on the GPU in their checkpoint formats, with magnitudes that keep
    the activations O(1) (FP8 Linears: |W| ~ 1/sqrt(K); MXFP4 experts likewise)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    done: set[int] = set()

    def fp8_weight(lin: Linear) -> QuantWeight:
        n, k, b = lin.out_features, lin.in_features, lin.block
        w8 = (torch.randn(n, k, generator=gen, device=DEV) * 64).clamp(-448, 448)
        center = 127 - 6 - int(math.log2(math.sqrt(k)))
        return QuantWeight(w8.to(torch.float8_e4m3fn), _e8m0((-(-n // b), -(-k // b)), center,
                                                             gen), "fp8", b, (n, k))

    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantized_storage:
            module.load_weight(fp8_weight(module))
            done.update(id(p) for p in module.parameters())
        elif isinstance(module, Linear) and name.endswith("attn.wo_a"):
            # The checkpoint's FP8 wo_a, dequantized to bf16 as the loader does.
            module.weight.copy_(fp8_weight(module).dequantize(module.weight.dtype))
            done.update(id(p) for p in module.parameters())
        elif isinstance(module, Experts) and module.fmt == "fp4":
            for wname in ("w1", "w3", "w2"):
                w = getattr(module, wname)
                w.copy_(torch.randint(-128, 128, w.shape, generator=gen, device=DEV,
                                      dtype=torch.int8))
                s = getattr(module, f"{wname}_scale")
                k = w.shape[-1] * 2
                center = 127 - 2 - int(math.log2(math.sqrt(k)))
                s.copy_(_e8m0(tuple(s.shape), center, gen))
            # The layout a GPU checkpoint load gives (Experts.load_expert): K-chunk-major.
            module.relayout_kchunk()
            done.update(id(p) for p in module.parameters())
    for name, p in model.named_parameters():
        if id(p) in done:
            continue
        if not p.is_floating_point():
            continue
        if name.endswith("norm.weight") or name.endswith("norm"):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen, device=DEV) * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=DEV) * 0.1)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            picks = torch.rand(buf.shape[0], model.cfg.n_routed_experts, generator=gen,
                               device=DEV).topk(buf.shape[1], dim=-1).indices
            buf.copy_(picks)


def build_model(layers: int, tiny: bool = False, experts: int | None = None) -> Transformer:
    """The benchmark model on DEV, quantized storage (also on CPU, through the torch twins)."""
    cfg = flash_config(layers, tiny, experts)
    with torch.device(DEV), quantized_storage():
        model = Transformer(cfg, numerics="official", backend="triton", dtype=torch.bfloat16)
    fill_random(model)
    return model.eval()


# ------------------------------------------------------------------------------ floors
def _ckpt_bytes(name: str, p: torch.Tensor) -> int:
    """Bytes of a dense parameter in the checkpoint (fp32 mHC/ape/sink; bf16 otherwise)."""
    if p.dtype == torch.float32 and not any(s in name for s in ("hc_", "ape", "attn_sink")):
        return p.numel() * 2
    return p.numel() * p.element_size()


def weight_bytes(model: Transformer, batch: int) -> dict[str, float]:
    """Bytes of weights one decode step of ``batch`` tokens must read, in checkpoint formats."""
    cfg = model.cfg
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    distinct = E * (1 - (1 - k / E) ** batch)
    out = {"dense": 0.0, "experts": 0.0, "head": 0.0, "embed": 0.0}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear) and module.holds_quantized:
            out["dense"] += module.qweight.nbytes
            seen.update(id(p) for p in module.parameters())
        elif isinstance(module, Experts):
            per_expert = sum(t[0].numel() * t.element_size() for t in module.parameters())
            out["experts"] += per_expert * distinct
            seen.update(id(p) for p in module.parameters())
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        if name.startswith("head."):
            out["head"] += p.numel() * 2
        elif name.startswith("embed."):
            out["embed"] += batch * p.shape[1] * 2
        else:
            out["dense"] += _ckpt_bytes(name, p)
    out["distinct_experts_per_layer"] = distinct
    return out


def kv_bytes(cfg: ModelConfig, ctx_len: int, batch: int, records: bool = False) -> float:
    """KV bytes one decode step reads: window + selected/all compressed entries + the indexer
    keys scored, per request, summed over layers; bf16 rows, or (``records``) the official
    cache records (kv_cache_dtype "fp8": 584 B per V4 row, 68 B per index key)."""
    row, key = cfg.head_dim * 2, cfg.index_head_dim * 2
    if records:
        fmts = cache_formats(cfg)
        row, key = fmts.compressed.record_bytes, fmts.index_keys.record_bytes
    per = 0.0
    for layer in range(cfg.n_layers):
        r = cfg.ratio(layer)
        per += min(cfg.window_size, ctx_len) * row
        if r == 4:
            n = ctx_len // 4
            per += min(cfg.index_topk, n) * row + n * key
        elif r > 0:
            per += (ctx_len // r) * row
    return per * batch


def prefill_flops(model: Transformer, S: int) -> float:
    """FLOPs of a prefill of S tokens from position 0 (GEMMs with the active parameters, the
    attention core over the attended rows, the indexer scores; last-token logits)."""
    cfg = model.cfg
    active = 0
    for module in model.modules():
        if isinstance(module, Linear):
            active += module.in_features * module.out_features
    for layer in model.layers:
        active += layer.ffn.gate.weight.numel()
        active += cfg.n_activated_experts * 3 * cfg.moe_inter_dim * cfg.dim
        active += layer.hc_attn.fn.numel() + layer.hc_ffn.fn.numel()
    flops = 2.0 * active * S
    pos = torch.arange(S, dtype=torch.float64) + 1
    for layer in range(cfg.n_layers):
        r = cfg.ratio(layer)
        rows = torch.clamp(pos, max=cfg.window_size)
        if r == 4:
            rows = rows + torch.clamp(torch.floor(pos / 4), max=cfg.index_topk)
            flops += float((2 * cfg.index_n_heads * cfg.index_head_dim * torch.floor(pos / 4))
                           .sum())
        elif r > 0:
            rows = rows + torch.floor(pos / r)
        flops += float((4 * cfg.n_heads * cfg.head_dim * rows).sum())
    flops += 2.0 * cfg.dim * cfg.vocab_size
    return flops


# ------------------------------------------------------------------------------ helpers
def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def sync_time(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls (synchronized)."""
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def graph_time(fn: Callable[[], Any], replays: int = 20, timeline: str | None = None) -> float:
    """Median seconds of one replay of ``fn`` captured in a CUDA graph (fn already warmed);
    off the GPU (smoke runs) the median of plain calls.  ``timeline``: append the graph's
    kernel timeline (``bench/timeline.py``) to that file."""
    if DEV != "cuda":
        return statistics.median(sync_time(fn, 2))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    if timeline:
        from bench.timeline import graph_timeline
        with open(timeline, "a") as f:
            f.write(f"===== graph step, median {statistics.median(times) * 1e6:.1f} us\n")
            f.write(graph_timeline(g))
    del g
    return statistics.median(times)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


# How kernels are issued (env of the capture): plain stream order; programmatic dependent
# launch as the engine uses it (dsv4/ops/pdl.py: steps of up to PDL_MAX_TOKENS tokens), with
# and without the mHC Sinkhorn on the comb lane and the attention compressor's branch lane
# (dsv4/ops/streams.py), with the compressor's loop plan (dsv4/ops/triton_compress.py), and
# PDL at every step size.  (A key "attention.NAME" sets that module constant instead of a variable.)
LAUNCH_VARIANTS = {
    "plain": {"DSV4_PDL": "0"},
    "pdl": {"DSV4_PDL": "1"},
    "pdl, no comb lane": {"DSV4_PDL": "1", "DSV4_COMB_LANE": "0"},
    "pdl, compress loop plan": {"DSV4_PDL": "1", "DSV4_COMPRESS_PLAN": "loop"},
    "pdl, no branch lane": {"DSV4_PDL": "1", "DSV4_BRANCH_LANE": "0"},
    "pdl at any size": {"DSV4_PDL": "1", "DSV4_PDL_MAX_TOKENS": str(1 << 30)},
    "pdl, window branch in order": {"DSV4_PDL": "1", "attention.KV_ON_SIDE_LANE": "0"},
    "pdl, index keys in order": {"DSV4_PDL": "1", "attention.INDEX_KEYS_ON_BRANCH": "0"},
    # "ops-": fused ops taken out of the op tables (the model then calls their parts).
    "pdl, gate and shared sum unfused": {"DSV4_PDL": "1",
                                         "ops-": "moe_gate,moe_experts_shared"},
    "pdl, experts' plan in its own launch": {"DSV4_PDL": "1", "ops-": "moe_gate_plan"},
    # "module.NAME": a module constant of _AB_MODULES set for the capture.
    "pdl, former one-row GEMV plans": {"DSV4_PDL": "1", "triton_dense.GEMV_WIDE_ONE_ROW": "0"},
    "pdl, wide one-row GEMV plans": {"DSV4_PDL": "1", "triton_dense.GEMV_WIDE_ONE_ROW": "1"},
    "pdl, wide one-row bf16w plans": {"DSV4_PDL": "1",
                                      "triton_linear32.BF16W_WIDE_ONE_ROW": "1"},
    "pdl, unsplit short attention": {"DSV4_PDL": "1", "triton_attn.ATTN_SPLIT_MIN_ROWS": "128"},
    "pdl, inverse rope in its own launch": {"DSV4_PDL": "1",
                                            "triton_attn.ROPE_IN_COMBINE": "0"},
    "pdl, act prep in the up kernel": {"DSV4_PDL": "1", "triton_moe.UP_PREP_ACT": "1"},
    "pdl, combine in the down kernel": {"DSV4_PDL": "1", "triton_moe.DOWN_COMBINE": "1"},
    # (The one-token experts on FP8 wgmma are the default, DSV4_MOE_WGMMA: "pdl" is on them.)
    "pdl, experts on Triton": {"DSV4_PDL": "1", "gluon_moe_decode.WGMMA_DECODE": "0"},
    "pdl, experts on wgmma": {"DSV4_PDL": "1", "gluon_moe_decode.WGMMA_DECODE": "1"},
    "pdl, experts on wgmma, 5 launches": {"DSV4_PDL": "1", "gluon_moe_decode.WGMMA_DECODE": "1",
                                          "gluon_moe_decode.FUSED_FILL": "0"},
    # Past one token (measurements only: MAX_TOKENS is 1 by default).
    "pdl, wgmma experts to 64 tokens": {"DSV4_PDL": "1", "gluon_moe_decode.MAX_TOKENS": "64"},
    "pdl, wgmma experts to 64 tokens, 5 launches": {"DSV4_PDL": "1",
                                                    "gluon_moe_decode.MAX_TOKENS": "64",
                                                    "gluon_moe_decode.FUSED_FILL": "0"},
    "pdl, act prep in up, combine in down": {"DSV4_PDL": "1", "triton_moe.UP_PREP_ACT": "1",
                                             "triton_moe.DOWN_COMBINE": "1"},
    # The same launches captured a second time: their bits against the first capture's tell a
    # nondeterministic step (a race, an atomic order) from a variant's own rounding.
    "plain, second capture": {"DSV4_PDL": "0"},
    "pdl, second capture": {"DSV4_PDL": "1"},
}
# ``--ab-variants``: the LAUNCH_VARIANTS entries to capture ("plain", the bits' reference, always).
AB_ONLY: list[str] = []


def _ab_module(name: str) -> Any:
    import importlib
    return importlib.import_module({"attention": "dsv4.model.attention",
                                    "triton_dense": "dsv4.ops.triton_dense",
                                    "triton_linear32": "dsv4.ops.triton_linear32",
                                    "triton_attn": "dsv4.ops.triton_attn",
                                    "triton_moe": "dsv4.ops.triton_moe",
                                    "gluon_moe_decode": "dsv4.ops.gluon_moe_decode"}[name])


def _without_ops(names: str) -> contextlib.ExitStack:
    """Remove the comma-separated ops from every built op table until the stack closes (the
    model's modules hold those tables)."""
    import dsv4.ops as ops_mod
    stack = contextlib.ExitStack()
    for table in list(ops_mod._cache.values()):
        for name in names.split(","):
            if hasattr(table, name):
                stack.callback(setattr, table, name, getattr(table, name))
                delattr(table, name)
    return stack


def launch_variants_ab(fn: Callable[[], torch.Tensor], rounds: int = 30) -> dict:
    """Capture ``fn`` once per :data:`LAUNCH_VARIANTS` entry and time the graphs' replays
    interleaved (one of each per round, so drift hits all alike): median µs per variant and
    whether its output equals the plain one's bit for bit."""
    graphs, outs = {}, {}
    for name, env in LAUNCH_VARIANTS.items():
        if AB_ONLY and name != "plain" and name not in AB_ONLY:
            continue
        with contextlib.ExitStack() as stack:
            for k, v in env.items():
                if k == "ops-":
                    stack.enter_context(_without_ops(v))
                elif "." in k:                      # a module constant, not a variable
                    mod, attr = k.split(".", 1)
                    module = _ab_module(mod)
                    stack.callback(setattr, module, attr, getattr(module, attr))
                    setattr(module, attr, int(v))
                else:
                    stack.enter_context(_env(k, v))
            fn()                                              # compiles this variant's kernels
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs[name] = fn()
            g.replay()
            graphs[name] = g
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b) * 1e3)
    # Replays of one graph on the same inputs must repeat its bits: count the ones that do not.
    unstable = {}
    for name, g in graphs.items():
        first = outs[name].clone()
        unstable[name] = 0
        for _ in range(5):
            g.replay()
            torch.cuda.synchronize()
            unstable[name] += not torch.equal(outs[name], first)
        outs[name] = first
    ref = outs["plain"].double()
    res = {name: {"median_us": statistics.median(t), "min_us": min(t),
                  "same_bits": bool(torch.equal(outs[name], outs["plain"])),
                  "rel_diff": float((outs[name].double() - ref).norm() / ref.norm()),
                  "unstable_replays": unstable[name]}
           for name, t in times.items()}
    del graphs
    return res


def request_pages(req: int, pages_per_req: int) -> list[int]:
    return list(range(req * pages_per_req, (req + 1) * pages_per_req))


@torch.no_grad()
def clone_request(cache: HybridCache, src_slot: int, src_pages: list[int], dst_slots: list[int],
                  dst_pages: list[list[int]]) -> None:
    """Copy one request's cache (pages of every pool, window ring, compressor carry-over) to
    other requests, so a batch of long contexts costs one prefill."""
    if not dst_slots:
        return
    src_p = torch.tensor(src_pages, device=DEV)
    dst_p = torch.tensor([p for row in dst_pages for p in row], device=DEV)
    n = len(dst_slots)
    dst_s = torch.tensor(dst_slots, device=DEV)
    for pool in list(cache.compressed.values()) + list(cache.index_keys.values()):
        pool[dst_p] = pool[src_p].repeat(n, *([1] * (pool.dim() - 1)))
    for ring in cache.window.values():
        ring[dst_s] = ring[src_slot].clone().expand(n, *ring.shape[1:])
    for st in cache.states.values():
        st.kv[dst_s] = st.kv[src_slot].clone().expand(n, *st.kv.shape[1:])
        st.score[dst_s] = st.score[src_slot].clone().expand(n, *st.score.shape[1:])


# ------------------------------------------------------------------------------ benches
def bench_prefill(model: Transformer, cache: HybridCache, S: int, reps: int,
                  gaps: str | None = None, graphs: Any = None) -> dict:
    """Median seconds of a prefill of S tokens from position 0 (last-token logits); ``gaps``:
    append the GPU idle gaps of one more call (``bench/timeline.py`` ``eager_gaps``) there;
    ``graphs``: a ``PrefillGraphs`` that runs the step where it serves it."""
    cfg = model.cfg
    gen = torch.Generator(device=DEV).manual_seed(S)
    ids = torch.randint(0, cfg.vocab_size, (S,), generator=gen, device=DEV)
    pages = list(range(pages_needed(S, PAGE)))

    forward = run_step(model, graphs)

    def step() -> torch.Tensor:
        cache.reset_slots([0])
        ctx = StepContext.build(ids, [S], [0], [0], [pages], device=DEV)
        return model.compute_logits(forward(ctx, cache))

    logits = step()  # warm-up (kernel compilation; the graphs' capture)
    finite = bool(torch.isfinite(logits).all())
    secs = statistics.median(sync_time(step, reps))
    if gaps and DEV == "cuda":
        from bench.timeline import eager_gaps
        with open(gaps, "a") as f:
            f.write(f"##### prefill {S} tokens\n{eager_gaps(step)}\n")
    flops = prefill_flops(model, S)
    floor = flops / PEAK_FP8
    return {"S": S, "seconds": secs, "tokens_per_s": S / secs, "tflop": flops / 1e12,
            "achieved_tflops": flops / secs / 1e12, "floor_s": floor, "ratio": secs / floor,
            "finite": finite}


def bench_decode(model: Transformer, cache: HybridCache, B: int, ctx_len: int, steps: int,
                 pages_per_req: int, graphs: bool, timeline: str | None = None,
                 launch_ab: bool = False) -> dict:
    cfg = model.cfg
    gen = torch.Generator(device=DEV).manual_seed(B)
    tables = [request_pages(r, pages_per_req) for r in range(B)]
    # Build the context of request 0 by a real prefill, then copy it to the others.
    cache.reset_slots(list(range(B)))
    ids = torch.randint(0, cfg.vocab_size, (ctx_len,), generator=gen, device=DEV)
    ctx = StepContext.build(ids, [ctx_len], [0], [0], [tables[0]], device=DEV)
    model.forward(ctx, cache)
    clone_request(cache, 0, tables[0], list(range(1, B)), tables[1:])
    _sync()

    def decode_ctx(pos: int) -> StepContext:
        tok = torch.randint(0, cfg.vocab_size, (B,), generator=gen, device=DEV)
        return StepContext.build(tok, [1] * B, [pos] * B, list(range(B)), tables, device=DEV)

    # Eager: real decoding, the position advancing each step (host planning included).
    model.compute_logits(model.forward(decode_ctx(ctx_len), cache))   # warm-up
    pos = [ctx_len + 1]

    def eager_step() -> None:
        c = decode_ctx(pos[0])
        pos[0] += 1
        model.compute_logits(model.forward(c, cache))

    eager = statistics.median(sync_time(eager_step, steps))
    wb = weight_bytes(model, B)
    kvb = kv_bytes(cfg, ctx_len, B, is_record_dtype(cache.dtype))
    total = wb["dense"] + wb["experts"] + wb["head"] + wb["embed"] + kvb
    floor = total / BW
    out = {"B": B, "ctx": ctx_len, "eager_step_s": eager, "floor_s": floor,
           "ratio_eager": eager / floor, "weight_bytes": wb, "kv_bytes": kvb,
           "eager_tokens_per_s": B / eager}
    if graphs and DEV == "cuda":
        # One step (fixed positions; its per-step plan memoized in the context) captured and
        # replayed: the device time of a decode step without Python/launch overhead.
        try:
            c = decode_ctx(pos[0])
            model.compute_logits(model.forward(c, cache))            # fills c.memo
            if timeline:
                with open(timeline, "a") as f:
                    f.write(f"##### decode B={B}, ctx {ctx_len}\n")
            step = lambda: model.compute_logits(model.forward(c, cache))  # noqa: E731
            g = graph_time(step, timeline=timeline)
            out.update({"graph_step_s": g, "ratio_graph": g / floor, "graph_tokens_per_s": B / g})
            if launch_ab:
                out["launch_ab"] = launch_variants_ab(step)
        except Exception as e:  # report, keep the eager number
            out["graph_error"] = f"{type(e).__name__}: {e}"[:400]
            out["graph_traceback"] = traceback.format_exc()[-2500:]
    return out


def bench_moe_only(model: Transformer, B: int) -> dict:
    """The routed-expert op of one learned layer at B tokens (decode batch or prefill chunk),
    as a graph replay, against max(bytes of the distinct experts touched / BW, FLOPs / fp8
    peak)."""
    layer = next(l for l in model.layers if not l.ffn.gate.is_hash)
    ex = layer.ffn.experts.weights()
    cfg = model.cfg
    gen = torch.Generator(device=DEV).manual_seed(1000 + B)
    x = torch.randn(B, cfg.dim, generator=gen, device=DEV).to(torch.bfloat16)
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    ids = torch.rand(B, E, generator=gen, device=DEV).topk(k, dim=-1).indices
    w = torch.rand(B, k, generator=gen, device=DEV) / 4
    fn = lambda: model.ops.moe_experts(x, ids, w, ex, cfg.swiglu_limit)  # noqa: E731
    fn()
    # Prefill-sized calls are timed eagerly (launch overhead is noise there).
    secs = graph_time(fn, 50) if B <= 256 else statistics.median(sync_time(fn, 5))
    distinct = int(torch.unique(ids).numel())
    per_expert = sum(t[0].numel() * t.element_size() for t in layer.ffn.experts.parameters())
    flops = 2.0 * B * k * 3 * cfg.moe_inter_dim * cfg.dim
    floor = max(distinct * per_expert / BW, flops / PEAK_FP8)
    return {"B": B, "graph_s": secs, "distinct_experts": distinct, "floor_s": floor,
            "ratio": secs / floor, "GBps": distinct * per_expert / secs / 1e9,
            "tflops": flops / secs / 1e12}


@torch.no_grad()
def bench_transformers(layers: int, tiny: bool, prefill: int, decode: list[tuple[int, int]],
                       log, experts: int | None = None) -> dict:
    """The same shapes through transformers' DeepseekV4ForCausalLM in bf16 (random weights made
    on the device): prefill of ``prefill`` tokens, and decode steps at (batch, context) pairs
    (time per step after a prefill of the context, with its KV cache)."""
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    d = flash_config_dict(layers, tiny, experts)
    d.pop("quantization_config", None)
    d.pop("expert_dtype", None)
    cfg = DeepseekV4Config.from_dict(d)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            model = DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    model.to(torch.bfloat16)
    out: dict[str, Any] = {"transformers": transformers.__version__, "decode": []}
    gen = torch.Generator(device=DEV).manual_seed(11)
    ids = torch.randint(0, d["vocab_size"], (1, prefill), generator=gen, device=DEV)
    model(ids[:, :64])                                                 # warm-up
    secs = statistics.median(sync_time(lambda: model(ids, use_cache=False), 2))
    out["prefill"] = {"S": prefill, "seconds": secs, "tokens_per_s": prefill / secs}
    log(f"transformers prefill S={prefill}: {secs * 1e3:.1f} ms")
    for B, ctx_len in decode:
        ctx_ids = torch.randint(0, d["vocab_size"], (B, ctx_len), generator=gen, device=DEV)
        res = model(ctx_ids, use_cache=True)
        past = res.past_key_values
        tok = res.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(3):
            _sync()
            t0 = time.perf_counter()
            res = model(tok, past_key_values=past, use_cache=True)
            _sync()
            times.append(time.perf_counter() - t0)
            past, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
        r = {"B": B, "ctx": ctx_len, "step_s": statistics.median(times)}
        out["decode"].append(r)
        log(f"transformers decode B={B} ctx={ctx_len}: {r['step_s'] * 1e3:.1f} ms/step")
    del model
    return out


MOE_DECODE_PLANS = [(64, 64, 4, 4), (32, 32, 4, 4), (32, 64, 4, 3), (16, 32, 2, 4),
                    (32, 32, 2, 4), (64, 128, 4, 3), (128, 128, 4, 3)]
MOE_PREFILL_PLANS = [(64, 64, 128, 4, 8, 3), (128, 64, 128, 8, 8, 3), (128, 128, 128, 8, 8, 3),
                     (64, 128, 128, 4, 4, 3), (128, 64, 64, 8, 4, 4)]


def sweep_moe(model: Transformer, batches: list[int], prefill_tokens: int, log) -> dict:
    """Time expert tile plans (graph replays) at decode batches and one prefill size; returns
    {tokens: (best MoeConfig fields, us)} and every timing."""
    from dsv4.ops import triton_moe as tm
    layer = next(l for l in model.layers if not l.ffn.gate.is_hash)
    ex = layer.ffn.experts.weights()
    cfg = model.cfg
    E, k, D, inter = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    out: dict[str, Any] = {"runs": [], "best": {}}
    for T in batches + [prefill_tokens]:
        gen = torch.Generator(device=DEV).manual_seed(T)
        x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=gen, device=DEV).topk(k, dim=-1).indices
        w = torch.rand(T, k, generator=gen, device=DEV) / 4
        if T == prefill_tokens:
            plans = [tm.MoeConfig(bm, bu, bd, 128, wu, wd, st)
                     for bm, bu, bd, wu, wd, st in MOE_PREFILL_PLANS]
        else:
            plans = [tm.MoeConfig(16, bu, bd, 128, wa, wa, st) for bu, bd, wa, st in
                     MOE_DECODE_PLANS]
            plan_s = graph_time(lambda: tm.moe_plan(ids, E, 16), 30)
            out["runs"].append({"T": T, "plan_only_us": plan_s * 1e6})
        best = None
        for p in plans:
            try:
                fn = lambda p=p: tm.moe_experts_with_config(x, ids, w, ex, 10.0, p)  # noqa
                fn()
                us = graph_time(fn, 20 if T == prefill_tokens else 40) * 1e6
            except Exception as e:
                out["runs"].append({"T": T, "plan": p.__dict__, "error": str(e)[:200]})
                continue
            out["runs"].append({"T": T, "plan": p.__dict__, "us": us})
            if best is None or us < best[1]:
                best = (p, us)
        if best is not None:
            out["best"][T] = best
            log(f"moe sweep T={T}: best {best[0]} {best[1]:.1f} us; " + ", ".join(
                f"{r['plan']['BN_up']}/{r['plan']['BN_down']}/{r['plan']['BM']}/"
                f"w{r['plan']['warps_up']}:{r['us']:.0f}" for r in out["runs"]
                if r.get("T") == T and "us" in r))
    return out


def install_best_moe_plans(best: dict) -> None:
    """Make the expert op use the swept plans: nearest swept token count by pairs/expert."""
    from dsv4.ops import triton_moe as tm
    default = tm.pick_moe_config
    table = sorted(best.items())

    def pick(num_pairs: int, num_experts: int, dim: int, inter: int, block_k: int):
        T = max(1, num_pairs // 6)
        if not table:
            return default(num_pairs, num_experts, dim, inter, block_k)
        t_best = min(table, key=lambda kv: abs(math.log(kv[0]) - math.log(T)))
        if T > 1024 and t_best[0] <= 1024:
            return default(num_pairs, num_experts, dim, inter, block_k)
        return t_best[1][0]
    tm.pick_moe_config = pick


def capture_prefill_graphs(graphs: Any) -> dict[str, Any]:
    """Capture every bucket of ``graphs`` (a ``PrefillGraphs``) up front, as the engine does at
    start; returns the buckets, graph count, capture seconds and the GB it reserved."""
    # A capture empties the allocator's cache first: start from an empty one so the difference
    # is the graphs' pool and buffers, not the cache it dropped.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved0 = torch.cuda.memory_reserved()
    with torch.no_grad():
        graphs.capture_all()
    return {"buckets": graphs.buckets, "graphs": int(graphs.stats["graphs"]),
            "capture_s": graphs.stats["capture_s"],
            "reserved_GB": (torch.cuda.memory_reserved() - reserved0) / 1e9}


def profile_steps(model: Transformer, cache: HybridCache, ctx_len: int, path: str, log) -> None:
    """torch.profiler tables (device time per op/kernel) of a prefill of ctx_len tokens and of
    eager decode steps at batch 1 and 64 on ctx_len contexts."""
    from torch.profiler import ProfilerActivity, profile
    cfg = model.cfg
    gen = torch.Generator(device=DEV).manual_seed(3)
    ppr = pages_needed(ctx_len + 8, PAGE)
    nreq = max(1, min(64, cache.num_slots, cache.num_pages // ppr))
    tables = [request_pages(r, ppr) for r in range(nreq)]
    ids = torch.randint(0, cfg.vocab_size, (ctx_len,), generator=gen, device=DEV)
    report = []

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])

    def run(name: str, fn: Callable[[], Any]) -> None:
        fn()
        _sync()
        with profile(activities=acts) as prof:
            fn()
            _sync()
        ka = prof.key_averages()
        for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
            try:
                tab = ka.table(sort_by=key, row_limit=45, max_name_column_width=60)
                break
            except Exception:
                tab = None
        report.append(f"===== {name}\n{tab}")
        log(f"profile {name}:\n" + "\n".join((tab or "").splitlines()[:22]))

    def prefill() -> None:
        cache.reset_slots([0])
        c = StepContext.build(ids, [ctx_len], [0], [0], [tables[0]], device=DEV)
        model.compute_logits(model.forward(c, cache))

    run(f"prefill {ctx_len}", prefill)
    clone_request(cache, 0, tables[0], list(range(1, nreq)), tables[1:])
    for B in sorted({1, nreq}):
        def dec(B: int = B) -> None:
            tok = torch.randint(0, cfg.vocab_size, (B,), generator=gen, device=DEV)
            c = StepContext.build(tok, [1] * B, [ctx_len] * B, list(range(B)), tables[:B],
                                  device=DEV)
            model.compute_logits(model.forward(c, cache))
        run(f"decode B={B}", dec)
    with open(path, "w") as f:
        f.write("\n\n".join(report))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts a layer (default V4-Flash's 256); fewer let all 43 "
                         "layers fit one GPU for the batch-1 step, whose bytes do not change")
    ap.add_argument("--moe-fp8-codes", action="store_true",
                    help="keep the MXFP4 experts' FP8 re-encoding on the GPU (the engine "
                         "option moe_fp8_codes): prefill's FP8-MMA experts skip re-encoding")
    ap.add_argument("--prefill", default="1024,8192,32768",
                    help="prompt lengths (the issue's 1K, 8K and 32K)")
    ap.add_argument("--decode-batches", default="1,16,64,256")
    ap.add_argument("--ctx", type=int, default=8192, help="context length of decode requests")
    ap.add_argument("--steps", type=int, default=5, help="timed eager decode steps")
    ap.add_argument("--reps", type=int, default=3, help="timed prefill repetitions")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--prefill-graphs", type=int, default=0, metavar="MAX_TOKENS",
                    help="prefills of at most MAX_TOKENS run as piecewise CUDA graphs "
                    "(dsv4.engine.prefill_graphs; 0: eager)")
    ap.add_argument("--launch-ab", action="store_true",
                    help="also time each decode graph captured under every LAUNCH_VARIANTS "
                         "entry (interleaved replays) and compare their logits")
    ap.add_argument("--ab-variants", default="",
                    help="with --launch-ab: only these LAUNCH_VARIANTS names, ';'-separated "
                         "(plain always)")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bf16"],
                    help="cache storage: the official records (the GPU default) or bf16 rows")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later parts skipped")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="toy widths (smoke test)")
    ap.add_argument("--sweep-moe", action="store_true",
                    help="time expert tile plans first and use the best ones")
    ap.add_argument("--moe-tokens", default="", help="extra token counts for the expert-op "
                    "timing (prefill chunks), e.g. 2048,8192")
    ap.add_argument("--sweep-prefill", type=int, default=8192, help="prefill tokens swept")
    ap.add_argument("--profile", default=None, help="write torch.profiler tables here")
    ap.add_argument("--timeline", default=None,
                    help="append each decode graph's kernel timeline (bench/timeline.py) here")
    ap.add_argument("--gaps", default=None,
                    help="append each prefill's GPU idle gaps (bench/timeline.py) here")
    ap.add_argument("--hf", default=None,
                    help="also run transformers: 'S;B:ctx,B:ctx' e.g. '4096;1:4096,16:1024'")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny (smoke test)")
    args = ap.parse_args(argv)
    global DEV
    DEV = args.device
    AB_ONLY[:] = [v.strip() for v in args.ab_variants.split(";") if v.strip()]
    if os.environ.get("DSV4_RECORD_KERNELS"):
        # Record this run's kernel specializations into a manifest (dsv4.ops.precompile), as
        # an engine does: e.g. the launch variants' decode kernels.
        from dsv4.ops import precompile
        precompile.record_to(os.environ["DSV4_RECORD_KERNELS"])
    unknown = [v for v in AB_ONLY if v not in LAUNCH_VARIANTS]
    if unknown:
        ap.error(f"--ab-variants: unknown {unknown}; known: {list(LAUNCH_VARIANTS)}")
    t_start = time.time()
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    results: dict[str, Any] = {"layers": args.layers, "experts": args.experts,
                               "device": name, "tiny": args.tiny,
                               "torch": torch.__version__, "prefill": [], "decode": [],
                               "moe_only": [], "errors": []}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    model = build_model(args.layers, args.tiny, args.experts)
    if args.moe_fp8_codes:
        kept = model.keep_expert_fp8_codes()
        log(f"kept FP8 expert codes: {kept / 1e9:.1f} GB")
    results["moe_fp8_codes"] = bool(args.moe_fp8_codes)
    results["gpu_mem_model_GB"] = torch.cuda.memory_allocated() / 1e9 if DEV == "cuda" else 0.0
    log(f"model built: {args.layers} layers, {results['gpu_mem_model_GB']:.1f} GB on the GPU")
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    prefills = [int(s) for s in args.prefill.split(",") if s]
    ppr = pages_needed(args.ctx + args.steps + 4, PAGE)
    num_pages = max(max(batches, default=1) * ppr, pages_needed(max(prefills, default=1), PAGE))
    cache_dtype = RECORD_DTYPE if args.kv_cache_dtype == "fp8" else torch.bfloat16
    cache = HybridCache.allocate(model.cfg, num_pages=num_pages, num_slots=max(batches, default=1),
                                 page_size=PAGE, dtype=cache_dtype, device=DEV)
    results["kv_cache_dtype"] = args.kv_cache_dtype
    log(f"cache: {num_pages} pages, {max(batches, default=1)} slots, "
        f"{cache.memory_bytes() / 1e9:.2f} GB, {args.kv_cache_dtype}")

    try:  # the expert kernel against its torch twin on this model's weights
        layer = next(l for l in model.layers if not l.ffn.gate.is_hash)
        gen = torch.Generator(device=DEV).manual_seed(7)
        x = torch.randn(8, model.cfg.dim, generator=gen, device=DEV).to(torch.bfloat16)
        w, ids = layer.ffn.gate(x.float(), torch.zeros(8, dtype=torch.int64, device=DEV))
        from dsv4.ops import torch_dense
        ex = layer.ffn.experts.weights()
        y = model.ops.moe_experts(x, ids, w, ex, model.cfg.swiglu_limit)
        y_ref = torch_dense.moe_experts(x, ids, w, ex, model.cfg.swiglu_limit)
        results["moe_check_rel_err"] = float((y - y_ref).double().norm()
                                             / y_ref.double().norm())
        log(f"moe kernel vs twin: rel err {results['moe_check_rel_err']:.2e}")
    except Exception:
        results["errors"].append(f"moe check: {traceback.format_exc()[-1500:]}")
        from dsv4.ops import torch_dense
        model.ops.moe_experts = torch_dense.moe_experts
        log("moe kernel failed: the torch twin runs the experts in this run")
    if args.sweep_moe:
        try:
            sw = sweep_moe(model, batches, args.sweep_prefill, log)
            results["moe_sweep"] = {"runs": sw["runs"], "best": {
                str(t): [b[0].__dict__, b[1]] for t, b in sw["best"].items()}}
            install_best_moe_plans(sw["best"])
        except Exception:
            results["errors"].append(f"moe sweep: {traceback.format_exc()[-1500:]}")
        save()
    for B in batches + [int(t) for t in args.moe_tokens.split(",") if t]:
        try:
            r = bench_moe_only(model, B)
            results["moe_only"].append(r)
            log(f"moe B={B}: {r['graph_s'] * 1e6:.1f} us, floor {r['floor_s'] * 1e6:.1f} us "
                f"(x{r['ratio']:.2f}, {r['GBps']:.0f} GB/s, {r['tflops']:.0f} TFLOP/s)")
        except Exception as e:
            results["errors"].append(f"moe B={B}: {traceback.format_exc()[-1500:]}")
            log(f"moe B={B} failed: {e}")
        save()
    if args.profile:
        try:
            profile_steps(model, cache, args.ctx, args.profile, log)
        except Exception:
            results["errors"].append(f"profile: {traceback.format_exc()[-1500:]}")
    prefill_graphs = None
    if args.prefill_graphs:
        prefill_graphs = PrefillGraphs(model, args.prefill_graphs,
                                       use_graphs=DEV == "cuda" and not args.no_graphs,
                                       cache=cache)
        if prefill_graphs.use_graphs:
            try:
                cap = capture_prefill_graphs(prefill_graphs)
                results["prefill_graphs_capture"] = cap
                log(f"prefill graphs: {cap['graphs']} graphs of buckets {cap['buckets']} "
                    f"captured in {cap['capture_s']:.1f} s, {cap['reserved_GB']:.2f} GB more "
                    f"reserved")
            except Exception as e:
                results["errors"].append(
                    f"prefill graphs capture: {traceback.format_exc()[-1500:]}")
                log(f"prefill graphs capture failed: {e}")
                prefill_graphs = None
    results["prefill_graphs"] = args.prefill_graphs
    for S in prefills:
        if time.time() - t_start > args.budget:
            log(f"budget reached: prefill {S} skipped")
            break
        try:
            r = bench_prefill(model, cache, S, args.reps, args.gaps, prefill_graphs)
            results["prefill"].append(r)
            log(f"prefill S={S}: {r['seconds'] * 1e3:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
                f"floor {r['floor_s'] * 1e3:.2f} ms (x{r['ratio']:.2f}), finite={r['finite']}")
        except Exception as e:
            results["errors"].append(f"prefill {S}: {traceback.format_exc()[-1500:]}")
            log(f"prefill {S} failed: {e}")
        save()
    for B in batches:
        if time.time() - t_start > args.budget:
            log(f"budget reached: decode B={B} skipped")
            break
        try:
            r = bench_decode(model, cache, B, args.ctx, args.steps, ppr, not args.no_graphs,
                             args.timeline, args.launch_ab)
            results["decode"].append(r)
            g = (f", graph {r['graph_step_s'] * 1e3:.2f} ms (x{r['ratio_graph']:.2f})"
                 if "graph_step_s" in r else f", graph failed: {r.get('graph_error', 'off')}")
            for name, v in r.get("launch_ab", {}).items():
                bits = "" if v["same_bits"] else f" (rel {v['rel_diff']:.1e})"
                if v.get("unstable_replays"):
                    bits += f" ({v['unstable_replays']}/5 replays changed)"
                g += f" | {name} {v['median_us']:.1f} us{bits}"
            log(f"decode B={B} ctx={args.ctx}: eager {r['eager_step_s'] * 1e3:.2f} ms/step "
                f"(x{r['ratio_eager']:.2f}){g}; floor {r['floor_s'] * 1e3:.3f} ms")
        except Exception as e:
            results["errors"].append(f"decode B={B}: {traceback.format_exc()[-1500:]}")
            log(f"decode B={B} failed: {e}")
        if DEV == "cuda":
            torch.cuda.empty_cache()
        save()
    if args.hf and time.time() - t_start < args.budget + 60:
        del model, cache
        if DEV == "cuda":
            torch.cuda.empty_cache()
        try:
            s_part, d_part = args.hf.split(";")
            pairs = [tuple(int(v) for v in p.split(":")) for p in d_part.split(",") if p]
            results["transformers"] = bench_transformers(args.layers, args.tiny, int(s_part),
                                                         pairs, log, args.experts)
        except Exception:
            results["errors"].append(f"transformers: {traceback.format_exc()[-1500:]}")
            log("transformers run failed (see errors)")
    save()
    print(json.dumps({k: v for k, v in results.items() if k != "errors"}, indent=None)[:3000])
    for e in results["errors"]:
        print("ERROR", e[-800:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
