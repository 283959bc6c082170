"""Static-shape decode steps (``StepContext.static``, the CUDA-graph mode) against the dynamic
path of the same tiny models: same logits bit for bit when no padding row is added, padding rows
that touch only the scratch slot and page, and a step traced once (with padding rows, as a graph
capture does) that replays later steps exactly."""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

from dsv4.cache.tensors import HybridCache
from dsv4.model.context import StaticShape, StepContext, bucket_for, decode_buckets

PAGE = 256
NUM_PAGES, NUM_SLOTS = 12, 6            # real ids; the scratch page / slot come after them
STATIC = StaticShape(max_pages=3, scratch_slot=NUM_SLOTS, scratch_page=NUM_PAGES)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from dsv4.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("static")
    return {v: make_tiny_checkpoint(root / v, variant=v, seed=0) for v in ("v4", "v41")}


_MODELS: dict[tuple[str, str], object] = {}


def tiny_model(paths: dict[str, str], variant: str, numerics: str):
    from dsv4.model.transformer import load_model

    key = (variant, numerics)
    if key not in _MODELS:
        _MODELS[key] = load_model(paths[variant], device="cpu", dtype=torch.float32,
                                  numerics=numerics)
    return _MODELS[key]


def new_cache(model, dtype: torch.dtype = torch.float32) -> HybridCache:
    return HybridCache.allocate(model.cfg, num_pages=NUM_PAGES + 1, num_slots=NUM_SLOTS + 1,
                                page_size=PAGE, dtype=dtype)


def cache_tensors(cache: HybridCache) -> dict[str, torch.Tensor]:
    out = {f"window{k}": v for k, v in cache.window.items()}
    out.update({f"comp{k}": v for k, v in cache.compressed.items()})
    out.update({f"keys{k}": v for k, v in cache.index_keys.items()})
    for k, s in cache.states.items():
        out[f"kv{k}"], out[f"score{k}"] = s.kv, s.score
    if cache.engram_lookback is not None:
        out["engram"] = cache.engram_lookback
    return out


def prefill(model, cache: HybridCache, prompts: list[list[int]], tables: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        n_pages = -(-len(p) // PAGE)
        types_ = [-1] * len(p) if model.cfg.is_v41 else None
        model.forward(StepContext.build(p, [len(p)], [0], [i], [tables[i][:n_pages]],
                                        token_types=types_), cache)


def decode_steps(model, cache: HybridCache, lens: list[int], tables: list[list[int]],
                 steps: int, bucket: int | None, seed: int) -> list[torch.Tensor]:
    """Greedy-free decode: random next tokens; ``bucket`` None = the dynamic path."""
    rng = random.Random(seed)
    R = len(lens)
    out = []
    for k in range(steps):
        ids = [rng.randrange(20, 400) for _ in range(R)]
        pos = [n + k for n in lens]
        bt = [t[:-(-(p + 1) // PAGE)] for t, p in zip(tables, pos)]
        types_ = [-1] * R if model.cfg.is_v41 else None
        if bucket is None:
            ctx = StepContext.build(ids, [1] * R, pos, list(range(R)), bt, token_types=types_)
        else:
            ctx = StepContext.static_decode(ids, pos, list(range(R)), bt, bucket, STATIC,
                                            token_types=types_)
        out.append(model.compute_logits(model.forward(ctx, cache))[:R])
    return out


def run_both(model, lens: list[int], bucket: int, steps: int = 6, seed: int = 0,
             cache_dtype: torch.dtype = torch.float32):
    rng = random.Random(seed)
    prompts = [[rng.randrange(20, 400) for _ in range(n)] for n in lens]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(lens))]
    results = []
    for b in (None, bucket):
        cache = new_cache(model, cache_dtype)
        prefill(model, cache, prompts, tables)
        results.append((decode_steps(model, cache, lens, tables, steps, b, seed), cache))
    return results


# ---------------------------------------------------------------------------- helpers
def test_buckets_and_static_shape_validation() -> None:
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert decode_buckets(1) == [1]
    assert bucket_for(5, decode_buckets(48)) == 8 and bucket_for(33, decode_buckets(48)) == 48
    assert bucket_for(49, decode_buckets(48)) is None
    with pytest.raises(ValueError, match="max_batch"):
        decode_buckets(0)
    with pytest.raises(ValueError, match="max_pages"):
        StaticShape(max_pages=0, scratch_slot=0, scratch_page=0)
    with pytest.raises(ValueError, match="scratch_slot"):
        StaticShape(max_pages=2, scratch_slot=-1, scratch_page=0)
    assert STATIC.pad_table() == [NUM_PAGES, -1, -1]


def test_static_decode_context_pads_rows_and_refuses_host_positions() -> None:
    ctx = StepContext.static_decode([7, 8], [300, 5], [1, 4], [[2, 5], [0]], 4, STATIC)
    assert ctx.input_ids.tolist() == [7, 8, 0, 0]
    assert ctx.positions.tolist() == [300, 5, 0, 0] and ctx.start_pos.tolist() == [300, 5, 0, 0]
    assert ctx.slots.tolist() == [1, 4, NUM_SLOTS, NUM_SLOTS]
    assert ctx.block_tables.tolist() == [[2, 5, -1], [0, -1, -1]] + [STATIC.pad_table()] * 2
    assert ctx.logits_indices.tolist() == [0, 1, 2, 3]
    assert ctx.cu_seqlens.tolist() == [0, 1, 2, 3, 4]
    assert ctx.is_decode and ctx.request_of_token.tolist() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="static-shape"):
        ctx.end_pos_host
    with pytest.raises(ValueError, match="bucket=1"):
        StepContext.static_decode([7, 8], [3, 5], [1, 4], [[2], [0]], 1, STATIC)
    with pytest.raises(ValueError, match="max_pages=3"):
        StepContext.static_decode([7], [3], [1], [[2, 3, 4, 5]], 1, STATIC)
    with pytest.raises(ValueError, match="decode only"):
        zeros = torch.zeros(2, dtype=torch.long)
        StepContext(input_ids=zeros, positions=zeros, cu_seqlens=torch.tensor([0, 2]),
                    start_pos=zeros[:1], slots=zeros[:1],
                    block_tables=torch.zeros(1, 3, dtype=torch.long),
                    logits_indices=torch.tensor([1]), seqlens_host=[2], start_pos_host=[0],
                    static=STATIC)


# ---------------------------------------------------------------------------- the model
@pytest.mark.parametrize("variant,numerics,lens,records", [
    ("v4", "bf16", [37, 300, 9, 255], False),  # window / ratio 4 / ratio 128 boundaries, 2 pages
    ("v4", "bf16", [3, 1, 5, 2], False),       # contexts shorter than the window at first
    ("v4", "official", [3, 1, 5, 2], False),
    ("v4", "official", [37, 300], True),       # the FP8 / FP4 cache records
    ("v41", "bf16", [21, 5], False),
    ("v41", "official", [21, 5], True),
])
def test_static_step_equals_dynamic_exactly(tiny_paths, variant, numerics, lens, records) -> None:
    """No padding row (R = bucket): the same logits and the same cache, bit for bit."""
    from dsv4.cache.formats import RECORD_DTYPE

    model = tiny_model(tiny_paths, variant, numerics)
    dtype = RECORD_DTYPE if records else torch.float32
    (dyn, c_dyn), (sta, c_sta) = run_both(model, lens, bucket=len(lens), cache_dtype=dtype)
    for k, (a, b) in enumerate(zip(dyn, sta)):
        assert torch.equal(a, b), f"step {k}: max diff {(a - b).abs().max()}"
    for name, t in cache_tensors(c_dyn).items():
        u = cache_tensors(c_sta)[name]
        if name.startswith(("window", "kv", "score", "engram")):
            t, u = t[:NUM_SLOTS], u[:NUM_SLOTS]          # the scratch slot is scratch
        elif t.shape[0] == NUM_PAGES + 1:
            t, u = t[:NUM_PAGES], u[:NUM_PAGES]
        assert torch.equal(t, u), name


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_padding_rows_touch_only_the_scratch_slot_and_page(tiny_paths, variant) -> None:
    """Padding rows (R=3 in a bucket of 8): close to the dynamic step (fp32 CPU GEMMs round a
    row by the number of rows, so not bit-equal), and every slot / page outside the step keeps
    its bits."""
    model = tiny_model(tiny_paths, variant, "bf16")
    lens = [40, 260, 12]
    rng = random.Random(3)
    prompts = [[rng.randrange(20, 400) for _ in range(n)] for n in lens]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(3)]
    cache_d, cache_s = new_cache(model), new_cache(model)
    for c in (cache_d, cache_s):
        prefill(model, c, prompts, tables)
        # Slots 3..5 and pages 9..11 belong to nobody in this step: fill them with a marker.
        for name, t in cache_tensors(c).items():
            if name.startswith(("window", "kv", "score", "engram")):
                t[3:NUM_SLOTS] = 7
            elif t.shape[0] == NUM_PAGES + 1:
                t[9:NUM_PAGES] = 7
    dyn = decode_steps(model, cache_d, lens, tables, 5, None, seed=1)
    sta = decode_steps(model, cache_s, lens, tables, 5, 8, seed=1)
    for a, b in zip(dyn, sta):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for name, t in cache_tensors(cache_s).items():
        if name.startswith(("window", "kv", "score", "engram")):
            assert bool((t[3:NUM_SLOTS] == 7).all()), name
        elif t.shape[0] == NUM_PAGES + 1:
            assert bool((t[9:NUM_PAGES] == 7).all()), name
            assert bool(t[NUM_PAGES].isfinite().all()), name   # masked entries: no NaN


@pytest.mark.parametrize("records", [False, True], ids=["fp32-cache", "fp8-records"])
def test_compact_c128_state_gives_the_raw_state_logits(tiny_paths, records,
                                                       monkeypatch) -> None:
    """The tiny V4's ratio-128 layers with the compact carry-over (the default) against raw
    rows (DSV4_COMPACT_STATE=0): prefills ending mid-group and decode steps, dynamic and static,
    that complete groups from the carry-over (127 -> 128, 255 -> 256): the same logits and the
    same pools, bit for bit."""
    import dsv4.cache.tensors as tensors
    from dsv4.cache.formats import RECORD_DTYPE

    model = tiny_model(tiny_paths, "v4", "bf16")
    c128 = [k for k in range(model.cfg.n_layers) if model.cfg.compressor_ratio(k) == 128]
    assert c128, "the tiny V4 has ratio-128 layers"
    dtype = RECORD_DTYPE if records else torch.float32
    runs = {}
    for compact in (True, False):
        monkeypatch.setattr(tensors, "COMPACT_STATE", compact)
        runs[compact] = run_both(model, [37, 300, 127, 255], bucket=4, steps=6,
                                 cache_dtype=dtype)
        state = runs[compact][0][1].compressor_state(c128[0], "attn")
        assert state.kv.dtype == (torch.float64 if compact else torch.float32)
    for path in (0, 1):                                      # dynamic, static
        (got, c_got), (want, c_want) = runs[True][path], runs[False][path]
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"path {path} step {k}: max diff {(a - b).abs().max()}"
        t_got, t_want = cache_tensors(c_got), cache_tensors(c_want)
        for name, t in t_want.items():
            if not name.startswith(("kv", "score")):
                assert torch.equal(t_got[name], t), name


# ---------------------------------------------------------------------------- graph semantics
def _static_moe(x, topk_ids, topk_weights, experts, swiglu_limit):
    """A routed-expert op without data-dependent shapes (every expert over every token, weight
    0 where not picked): the torch twin groups tokens on the host, the GPU kernel does not."""
    from dsv4.ops.torch_dense import swiglu

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for e in range(experts.num_experts):
        we = ((topk_ids == e).float() * topk_weights).sum(-1)
        a = swiglu(F.linear(x, experts.matrix(e, "w1", x.dtype)),
                   F.linear(x, experts.matrix(e, "w3", x.dtype)), swiglu_limit)
        out += F.linear((a * we[:, None]).to(x.dtype), experts.matrix(e, "w2", x.dtype)).float()
    return out


@pytest.mark.parametrize("variant,records", [("v4", True), ("v41", False)])
def test_step_traced_on_padding_replays_later_steps(tiny_paths, variant, records,
                                                     monkeypatch) -> None:
    """What a CUDA graph does, on the CPU: trace the static step once on padding rows only (every
    value read from the host is frozen into the trace, as a capture freezes it; a read of a
    tensor's value fails the trace), then replay the trace on real steps: logits and cache equal
    the eager static steps bit for bit.  V4 with the FP8 cache records (the CUDA default)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsv4.cache.formats import RECORD_DTYPE
    from dsv4.model.moe import MoE

    model = tiny_model(tiny_paths, variant, "official")
    for mod in model.modules():
        if isinstance(mod, MoE):
            # The composed experts + shared op would call the twin's moe_experts directly.
            table = {k: v for k, v in vars(mod.ops).items() if k != "moe_experts_shared"}
            monkeypatch.setattr(mod, "ops", types.SimpleNamespace(
                **{**table, "moe_experts": _static_moe}))
    B = 4
    cache = new_cache(model, RECORD_DTYPE if records else torch.float32)
    rng = random.Random(5)
    tables = [[0], [1, 2], [3], [5]]
    prefill(model, cache, [[rng.randrange(20, 400) for _ in range(n)] for n in (10, 300, 3, 7)],
            tables)
    start = {k: t.clone() for k, t in cache_tensors(cache).items()}
    v41 = model.cfg.is_v41

    def step(ids, pos, slots, tables):
        ctx = StepContext.from_static_tensors(
            ids, pos, slots, tables, STATIC,
            token_types=torch.full_like(ids, -1) if v41 else None)
        return model.compute_logits(model.forward(ctx, cache))

    pad = (torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long),
           torch.full((B,), STATIC.scratch_slot), torch.tensor([STATIC.pad_table()] * B))
    # V4.1: the Engram hasher checks the token-id range on CPU tensors (a host read that a CUDA
    # step skips); let the trace read it, the replay comparison below checks every value.
    traced = make_fx(step, tracing_mode="real", _error_on_data_dependent_ops=not v41)(*pad)
    steps = [([5, 6, 7, 0], [10, 300, 3, 0], [0, 1, 2, NUM_SLOTS], tables[:3] + [[NUM_PAGES]]),
             ([9, 8, 1, 2], [11, 301, 4, 7], [0, 1, 2, 3], tables),
             ([4, 3, 2, 1], [12, 302, 5, 8], [0, 1, 2, 3], tables)]

    def tensors(s):
        ids, pos, slots, tables = s
        return (torch.tensor(ids), torch.tensor(pos), torch.tensor(slots),
                torch.tensor([t + [-1] * (STATIC.max_pages - len(t)) for t in tables]))

    def restore():
        for k, t in cache_tensors(cache).items():
            t.copy_(start[k])

    restore()
    replayed = [traced(*tensors(s)) for s in steps]
    after_replay = {k: t.clone() for k, t in cache_tensors(cache).items()}
    restore()
    eager = [step(*tensors(s)) for s in steps]
    for k, (a, b) in enumerate(zip(replayed, eager)):
        assert torch.equal(a, b), f"step {k}"
    for k, t in cache_tensors(cache).items():
        assert torch.equal(after_replay[k], t), k
    assert not torch.equal(eager[1], eager[2])   # the steps differ: a frozen value would show
