"""Prefill over record caches through dense copies (dsv4/model/attention.py, issue #5).

A prefill / mixed step dequantizes each record source once per layer (the window source, the
compressed entries of the step's requests) and hands ``sparse_attn`` dense rows with re-mapped
indices; the values are the records' own (exact), so every output must equal the records path
bit for bit:

* the tiny V4 (layers: window only, CSA ratio 4, HCA ratio 128) and V4.1 (window only, ratio-2
  and ratio-1 KV sources, reuse and reindex layers, fp4 compressed records) models with
  ``kv_cache_dtype="fp8"`` record pools, two steps of two requests each, the second a
  chunked-prefill continuation (ring rows and entries of the first chunk are read) next to a new
  request: every layer's attention output, the logits and the cache bytes, dense path
  (``DENSE_PREFILL_MIN_TOKENS`` 0) against the records path (the constant huge), torch twins;
* the rule of :func:`dense_prefill_pays`;
* ``test_gpu_*`` (skipped without CUDA): a 4-layer V4-Flash-width prefill of 2,048 tokens, logits
  with the dense path on and off, and both times printed.

The same comparison through the Triton kernel (interpreter) is in
tests/kernels/test_dense_prefill_interp.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from dsv4.cache.formats import RECORD_DTYPE, PackedRows
from dsv4.cache.tensors import HybridCache
from dsv4.model import attention as attn_mod
from dsv4.model.attention import Attention, dense_prefill_pays
from dsv4.model.context import StaticShape, StepContext
from dsv4.ops import get_ops

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 128          # ratio 128 needs a page of >= 128 positions
NUM_PAGES, NUM_SLOTS = 8, 4
# (request, slot, start, tokens, pages) per step: step 1 holds A's first chunk and B; step 2
# A's second chunk (A's ring and its first chunk's entries are read) and a new request C.
STEPS = [
    [("A", 0, 0, 150, [0, 1, 2]), ("B", 1, 0, 90, [3])],
    [("A", 0, 150, 120, [0, 1, 2]), ("C", 2, 0, 40, [4])],
]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from dsv4.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("dense_prefill")
    return {v: make_tiny_checkpoint(root / v, variant=v, seed=0) for v in ("v4", "v41")}


_MODELS: dict[str, object] = {}


def tiny_model(paths: dict[str, str], variant: str):
    from dsv4.model.transformer import load_model

    if variant not in _MODELS:
        _MODELS[variant] = load_model(paths[variant], device="cpu", dtype=torch.float32,
                                      numerics="official")
    return _MODELS[variant]


def prompts(steps=STEPS, seed: int = 0) -> dict[str, list[int]]:
    """Token ids of each request, long enough for every chunk of ``steps``."""
    gen = torch.Generator().manual_seed(seed)
    n: dict[str, int] = {}
    for step in steps:
        for name, _, start, count, _ in step:
            n[name] = max(n.get(name, 0), start + count)
    return {k: torch.randint(20, 400, (v,), generator=gen).tolist() for k, v in n.items()}


def step_context(model, step, ids: dict[str, list[int]]) -> StepContext:
    flat = [t for name, _, s, n, _ in step for t in ids[name][s:s + n]]
    types_ = [-1] * len(flat) if model.cfg.is_v41 else None
    return StepContext.build(flat, [n for *_, n, _ in step], [s for _, _, s, _, _ in step],
                             [slot for _, slot, *_ in step], [p for *_, p in step],
                             token_types=types_)


class AttentionRecorder:
    """Records, per attention layer and call, the output and the kinds of sources its
    ``sparse_attn`` got (restored by monkeypatch)."""

    def __init__(self, model, monkeypatch: pytest.MonkeyPatch, sparse_attn=None) -> None:
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.sources: dict[int, list[tuple[str, str]]] = {}
        for module in model.modules():
            if not isinstance(module, Attention):
                continue
            layer = module.layer_id
            op = sparse_attn or module.ops.sparse_attn

            def wrapped(q, kv_a, idx_a, kv_b, idx_b, *args, _op=op, _layer=layer, **kw):
                kinds = tuple("none" if kv is None else
                              "records" if isinstance(kv, PackedRows) else "dense"
                              for kv in (kv_a, kv_b))
                self.sources.setdefault(_layer, []).append(kinds)
                out = _op(q, kv_a, idx_a, kv_b, idx_b, *args, **kw)
                self.outputs.setdefault(_layer, []).append(out.clone())
                return out

            monkeypatch.setattr(module, "ops",
                                SimpleNamespace(**{**vars(module.ops), "sparse_attn": wrapped}))


def run_steps(model, dense: bool, monkeypatch: pytest.MonkeyPatch, steps=STEPS,
              sparse_attn=None):
    """Run ``steps`` on a fresh record cache with the dense path on or off; returns (the
    recorder, the logits of each step, the cache)."""
    ids = prompts(steps)
    with monkeypatch.context() as mp:
        mp.setattr(attn_mod, "DENSE_PREFILL_MIN_TOKENS", 0 if dense else 10 ** 9)
        rec = AttentionRecorder(model, mp, sparse_attn)
        cache = HybridCache.allocate(model.cfg, num_pages=NUM_PAGES, num_slots=NUM_SLOTS,
                                     page_size=PAGE, dtype=RECORD_DTYPE)
        logits = []
        for step in steps:
            ctx = step_context(model, step, ids)
            logits.append(model.compute_logits(model.forward(ctx, cache)))
    return rec, logits, cache


def cache_tensors(cache: HybridCache) -> dict[str, torch.Tensor]:
    out = {f"window{k}": v for k, v in cache.window.items()}
    out.update({f"comp{k}": v for k, v in cache.compressed.items()})
    out.update({f"keys{k}": v for k, v in cache.index_keys.items()})
    return out


def assert_same_runs(model, dense_run, records_run) -> None:
    (rd, ld, cd), (rr, lr, cr) = dense_run, records_run
    cfg = model.cfg
    for layer in sorted(rr.outputs):
        # The records run reads records everywhere; the dense run dense rows everywhere (the
        # row rule passes at these sizes), except a compressed source still without entries.
        assert all(k == ("records", "none" if cfg.ratio(layer) == 0 else "records")
                   for k in rr.sources[layer]), (layer, rr.sources[layer])
        for k in rd.sources[layer]:
            assert k[0] == "dense", (layer, rd.sources[layer])
        for call, (a, b) in enumerate(zip(rd.outputs[layer], rr.outputs[layer])):
            assert torch.equal(a, b), (f"layer {layer} (ratio {cfg.ratio(layer)}) step {call}: "
                                       f"max diff {(a.float() - b.float()).abs().max()}")
    for step, (a, b) in enumerate(zip(ld, lr)):
        assert torch.equal(a, b), f"logits of step {step}"
    for name, t in cache_tensors(cd).items():
        assert torch.equal(t, cache_tensors(cr)[name]), name


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_dense_sources_equal_the_records_exactly(tiny_paths, variant, monkeypatch) -> None:
    model = tiny_model(tiny_paths, variant)
    dense = run_steps(model, True, monkeypatch)
    records = run_steps(model, False, monkeypatch)
    assert_same_runs(model, dense, records)
    cfg = model.cfg
    kinds = {cfg.ratio(layer) for layer in dense[0].outputs}
    assert kinds == ({0, 4, 128} if variant == "v4" else {0, 1, 2}), kinds
    # Every compressed layer read a dense copy of its entries in step 2 (A's entries exist);
    # the HCA layers of step 1 too (A has 1 entry of ratio 128).
    for layer, calls in dense[0].sources.items():
        if cfg.ratio(layer):
            assert calls[1][1] == "dense", (layer, calls)


# ---------------------------------------------------------------------------- the rule
def _prefill_ctx(seqlens, start_pos, page_size: int = PAGE) -> StepContext:
    n = sum(seqlens)
    R = len(seqlens)
    tables = [[0] * (-(-(s + c) // page_size)) for s, c in zip(start_pos, seqlens)]
    return StepContext.build([5] * n, seqlens, start_pos, list(range(R)), tables)


def test_dense_prefill_rule(monkeypatch) -> None:
    from dsv4.cache.formats import v4_kv_record

    monkeypatch.setattr(attn_mod, "DENSE_PREFILL_MIN_TOKENS", 64)
    monkeypatch.setattr(attn_mod, "DENSE_PREFILL_ROWS_PER_TOKEN", 4)
    monkeypatch.setattr(attn_mod, "DENSE_PREFILL_SLACK_ROWS", 4096)
    fmt = v4_kv_record(512, 64)                                  # V4-Flash's 584-byte records

    big = _prefill_ctx([2048], [0])
    assert dense_prefill_pays(big, fmt, window=128)
    assert dense_prefill_pays(big, fmt, ratio=4) and dense_prefill_pays(big, fmt, ratio=128)
    # No records (a bf16 cache): nothing to dequantize.
    assert not dense_prefill_pays(big, None, window=128)
    assert not dense_prefill_pays(big, None, ratio=4)
    # Too few tokens.
    small = _prefill_ctx([63], [0])
    assert not dense_prefill_pays(small, fmt, window=128)
    assert dense_prefill_pays(_prefill_ctx([64], [0]), fmt, window=128)
    # No entry yet (L = 0): the records path (nothing to copy).
    assert not dense_prefill_pays(_prefill_ctx([100], [0]), fmt, ratio=128)
    # Decode-only steps, dynamic or static: the records path.
    dec = _prefill_ctx([1] * 80, [5000] * 80)
    assert dec.num_tokens >= 64 and not dense_prefill_pays(dec, fmt, window=128)
    static = StepContext.static_decode([5] * 4, [300] * 4, [0, 1, 2, 3], [[0, 1]] * 4, 4,
                                       StaticShape(max_pages=2, scratch_slot=4, scratch_page=9))
    assert not dense_prefill_pays(static, fmt, window=128)
    assert not dense_prefill_pays(static, fmt, ratio=4)
    # Too many dense rows: a 64-token chunk among 60 long decode requests (window: 61·128 +
    # 124 rows > 4·124 + 4096; ratio 4: 61 · 8K entries), a late chunk of a long prompt.
    mixed = _prefill_ctx([64] + [1] * 60, [0] + [32768] * 60)
    assert not dense_prefill_pays(mixed, fmt, window=128)
    assert not dense_prefill_pays(mixed, fmt, ratio=4)
    assert not dense_prefill_pays(mixed, fmt, ratio=128)       # 61 · 256 rows
    late = _prefill_ctx([1024], [65536])
    assert dense_prefill_pays(late, fmt, window=128)
    assert not dense_prefill_pays(late, fmt, ratio=4)          # 16,640 > 4·1024 + 4096 rows
    assert dense_prefill_pays(late, fmt, ratio=128)             # 520 rows
    # The bound itself: R·L <= 4·T + slack.
    edge = _prefill_ctx([1024], [(4 * 1024 + 4096) * 4 - 1024])
    assert dense_prefill_pays(edge, fmt, ratio=4)
    assert not dense_prefill_pays(_prefill_ctx([1024], [(4 * 1024 + 4096) * 4 - 1020]), fmt,
                                  ratio=4)


def test_dense_entry_rows_follow_the_pool_rows() -> None:
    """The dense copy's row table has the pool table's blanks, request r's entry j at r·L + j,
    and the copy holds exactly the pool rows of the table."""
    from dsv4.cache.formats import v4_kv_record
    from dsv4.model.compressor import entry_pool_rows

    ctx = _prefill_ctx([100, 30, 300], [200, 0, 40])
    pool_rows = entry_pool_rows(ctx, 4, PAGE)
    local = attn_mod._dense_entry_rows(ctx, 4, PAGE)
    R, L = pool_rows.shape
    assert L == 340 // 4
    want = torch.arange(R * L).view(R, L)
    assert torch.equal(local, torch.where(pool_rows >= 0, want, -1))
    fmt = v4_kv_record(128, 64)
    pool = fmt.pack(torch.randn(2, PAGE // 4, 128, generator=torch.Generator().manual_seed(1)))
    dense = attn_mod._dense_entries(get_ops("torch"), ctx, pool, fmt, 4, PAGE, torch.bfloat16)
    assert dense.shape == (R * L, 128) and dense.dtype == torch.bfloat16
    have = pool_rows.view(-1) >= 0
    flat = fmt.unpack(pool.view(-1, fmt.record_bytes), torch.float32)
    assert torch.equal(dense[have].float(), flat[pool_rows.view(-1)[have]])


# ---------------------------------------------------------------------------- GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _flash_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "flash_bench.py"
    spec = importlib.util.spec_from_file_location("flash_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@cuda
def test_gpu_flash_prefill_dense_equals_records(monkeypatch) -> None:
    """4 V4-Flash-width layers (window, window, CSA, HCA; Triton, official numerics, fp8 cache),
    one 2,048-token prefill then a 1,024-token continuation: the records path twice (the model is
    deterministic: identical), the dense path under the records path's attention plan and under
    its own plan: statistically close (spec §6.13: the kernel sums the dequantized records and
    the bf16 rows in other orders on the GPU — see the kernel test below — and four layers of FP8
    fake quantization amplify those roundings: on the H200 the kernel's outputs differed by 7e-5
    relative (0.08% of them by one bf16 step), the logits by 8e-2); prints times and differences."""
    from dsv4.ops import triton_attn as ta

    fb = _flash_bench()
    model = fb.build_model(4)
    S, S2 = 2048, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (S + S2,), generator=gen, device="cuda")
    pages = list(range(-(-(S + S2) // fb.PAGE)))
    default_plan = ta.pick_attn_config

    def records_plan(*args, records: bool = False, **kw):
        return default_plan(*args, records=True, **kw)

    results, times = {}, {}
    runs = (("records", False, False), ("records again", False, False),
            ("dense, records plan", True, True), ("dense", True, False))
    for name, dense, same_plan in runs:
        monkeypatch.setattr(attn_mod, "DENSE_PREFILL_MIN_TOKENS", 0 if dense else 10 ** 9)
        monkeypatch.setattr(ta, "pick_attn_config", records_plan if same_plan else default_plan)
        cache = HybridCache.allocate(model.cfg, num_pages=len(pages), num_slots=1,
                                     page_size=fb.PAGE, dtype=RECORD_DTYPE, device="cuda")
        with torch.no_grad():
            def first():
                ctx = StepContext.build(ids[:S], [S], [0], [0], [pages], device="cuda",
                                        logits_indices=list(range(S - 8, S)))
                return model.compute_logits(model.forward(ctx, cache))

            first()                                               # warm-up (compiles)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                cache.reset_slots([0])
                out1 = first()
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t0) / 3
            ctx2 = StepContext.build(ids[S:], [S2], [S], [0], [pages], device="cuda",
                                     logits_indices=list(range(S2 - 8, S2)))
            out2 = model.compute_logits(model.forward(ctx2, cache))
        results[name] = (out1.clone(), out2.clone())
    print("\n4-layer V4-Flash prefill of %d tokens, fp8 cache: %s" % (S, ", ".join(
        f"{n} {t * 1e3:.2f} ms" for n, t in times.items())))
    ref = results["records"]
    for name in ("records again", "dense, records plan", "dense"):
        for k, (a, b) in enumerate(zip(results[name], ref)):
            assert torch.isfinite(a).all(), name
            rel = ((a - b).norm() / b.norm()).item()
            print(f"{name} vs records, step {k}: rel {rel:.2e}, max diff "
                  f"{(a - b).abs().max().item():.3e}, argmax agree "
                  f"{(a.argmax(-1) == b.argmax(-1)).float().mean().item():.2f}")
            if name == "records again":
                assert torch.equal(a, b), f"{name} step {k}: max diff {(a - b).abs().max()}"
            else:
                # (The argmax of a random model's 129K logits has tiny margins: printed only.)
                assert rel < 0.2, f"{name} step {k}: relative difference {rel:.2e}"


@cuda
@pytest.mark.parametrize("ratio", [4, 128])
def test_gpu_attention_layer_dense_equals_records(ratio: int) -> None:
    """The kernel at real widths (H 64, d 512, 2,048 tokens, window 128 + the compressed list of
    a ratio-4 / ratio-128 layer) on records and on their unpacked bf16 rows: identical with the
    same tile plan (the kernel's property), and with each source's default plan (what the model
    gets; the records plan runs 8 warps, the dense one 4)."""
    from dsv4.cache.formats import v4_kv_record
    from dsv4.ops import triton_attn as ta

    gen = torch.Generator(device="cuda").manual_seed(ratio)
    T, H, d, W = 2048, 64, 512, 128
    fmt = v4_kv_record(d, 64)
    n_ent = T // ratio
    win = fmt.pack(torch.randn(W + T, d, generator=gen, device="cuda"))
    comp = fmt.pack(torch.randn(n_ent, d, generator=gen, device="cuda"))
    pos = torch.arange(T, device="cuda")
    k = torch.arange(W, device="cuda")
    wpos = (pos[:, None] - W + 1 + k[None, :])
    idx_a = torch.where(wpos >= 0, W + wpos, -1).to(torch.int32)
    vis = (pos + 1) // ratio
    kb = 512 if ratio == 4 else n_ent
    if ratio == 4:   # a random top-512 of the visible entries, ascending, −1 after
        scores = torch.rand(T, n_ent, generator=gen, device="cuda")
        scores = scores.masked_fill(torch.arange(n_ent, device="cuda")[None] >= vis[:, None], -1)
        top = scores.topk(kb, dim=-1)
        idx_b = torch.where(top.values >= 0, top.indices, n_ent).sort(-1).values
        idx_b = torch.where(idx_b < n_ent, idx_b, -1).to(torch.int32)
    else:
        j = torch.arange(n_ent, device="cuda")
        idx_b = torch.where(j[None] < vis[:, None], j[None], -1).to(torch.int32)
    q = torch.randn(T, H, d, generator=gen, device="cuda").to(torch.bfloat16)
    sink = torch.randn(H, generator=gen, device="cuda")
    rec = (PackedRows(win, fmt), idx_a, PackedRows(comp, fmt), idx_b)
    dense = (fmt.unpack(win, torch.bfloat16), idx_a, fmt.unpack(comp, torch.bfloat16), idx_b)
    plan = ta.pick_attn_config(T, H, d, W + kb, q.device, records=True)
    same = [ta.sparse_attn_with_config(q, *src, sink, d ** -0.5, torch.bfloat16, plan)
            for src in (rec, dense)]
    # The records path dequantizes in registers and sums its nope / rope parts in another order
    # than the one dot over the bf16 rows: equal to bf16 rounding (bit-identical only in the
    # interpreter, test_dense_sources_equal_the_records_exactly).
    d_same = _rel(same[0], same[1])
    print(f"\nratio {ratio}: records vs bf16 rows, same plan: rel {d_same:.2e}, "
          f"{(same[0] != same[1]).float().mean().item():.2%} of the outputs differ")
    assert torch.isfinite(same[0]).all() and d_same < 4e-3, d_same
    times = {}
    outs = {}
    for name, src in (("records", rec), ("dense", dense)):
        ta.sparse_attn(q, *src, sink, d ** -0.5, torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            outs[name] = ta.sparse_attn(q, *src, sink, d ** -0.5, torch.bfloat16)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 5
    unpack = lambda: (fmt.unpack(win, torch.bfloat16), fmt.unpack(comp, torch.bfloat16))  # noqa
    unpack()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        unpack()
    torch.cuda.synchronize()
    print(f"\nratio {ratio}: sparse_attn on records {times['records'] * 1e6:.0f} us, on bf16 "
          f"rows {times['dense'] * 1e6:.0f} us, unpack {(time.perf_counter() - t0) / 5 * 1e6:.0f}"
          f" us")
    a, b = outs["records"], outs["dense"]
    print(f"default plans: rel {_rel(a, b):.2e}")
    assert _rel(a, b) < 4e-3, (f"default plans: {(a != b).sum().item()} of {a.numel()} differ, "
                               f"max diff {(a.float() - b.float()).abs().max()}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
