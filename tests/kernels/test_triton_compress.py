"""The compressor ops (dsv4/ops/torch_compress.py, triton_compress.py).

* twin tests (CPU, always): argument checks, entries against the float64 formula over steps
  that split a sequence, the ``valid`` zeros; the ``ape`` argument (the ops add the position
  bias) against scores biased before the call: the same bits, entries and state;
* (the compact C128 state form: tests/kernels/test_compress_compact.py;)
* interpreter tests (``test_interp_*``): the Triton kernels against the twin at tiny shapes,
  both plans of ``compress_entries`` (loop; split: one block finished in registers, several
  blocks finished by the last arrival, forced by ``DSV4_COMPRESS_PLAN`` / ``_TILE``), with the
  fused ``ape`` add bit-equal to pre-biased scores in every plan and its GPU gate; they
  need ``TRITON_INTERPRET=1`` before triton is imported, so a normal run starts them in a
  child pytest (``test_kernels_in_interpreter``);
* GPU tests (``test_gpu_*``, skipped without CUDA): V4-Flash shapes, 64 requests (decode sizes
  and every plan: tests/kernels/test_compress_decode.py).

Tolerances, kernel vs twin: both pool in float64 and round once to fp32, but the norm's sum of
squares is reduced in another order (and the GPU may fuse the RoPE products into FMAs), so fp32
entries agree to ~1e-6 relative; a bf16 entry can then differ by one bf16 ulp where that small
fp32 difference straddles a rounding boundary of one of its bf16 roundings.  The state update
only moves values: bit-exact.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsv4.ops import torch_compress as twin
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[2]
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (run by "
                                  "test_kernels_in_interpreter)")
needs_cuda = pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs CUDA")


# ----------------------------------------------------------------------------- random cases
@dataclass
class Case:
    """One step of R requests for one compressor: its rows, state, entries and RoPE rows."""

    kv: torch.Tensor
    score: torch.Tensor
    state_kv: torch.Tensor
    state_score: torch.Tensor
    request: torch.Tensor
    entry: torch.Tensor
    valid: torch.Tensor | None
    start_pos: torch.Tensor
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    ratio: int
    overlap: bool
    weight: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None

    def entries(self, op, out_dtype: torch.dtype) -> torch.Tensor:
        return op(self.kv, self.score, self.state_kv, self.state_score, self.request, self.entry,
                  self.valid, self.start_pos, self.cu_seqlens, self.slots, self.ratio,
                  self.overlap, self.weight, 1e-6, self.cos, self.sin, out_dtype)

    def update(self, op, state_kv: torch.Tensor, state_score: torch.Tensor) -> None:
        op(self.kv, self.score, state_kv, state_score, self.start_pos, self.cu_seqlens,
           self.slots, self.ratio, self.overlap)


def make_case(ratio: int, overlap: bool, d: int, starts: list[int], lens: list[int], *,
              rope: int = 8, seed: int = 0, static: bool = False, device: str = "cpu",
              scratch_rows: int = 0) -> Case:
    """A step whose requests start at ``starts`` with ``lens`` tokens, random rows and a random
    (partly empty) state.  ``static``: one candidate entry per request with a ``valid`` mask,
    as a static-shape decode step plans them; ``scratch_rows`` padding rows (position 0,
    one shared scratch slot) are appended."""
    gen = torch.Generator().manual_seed(seed)
    coff = 2 if overlap else 1
    W, R0 = coff * d, len(starts)
    starts = list(starts) + [0] * scratch_rows
    lens = list(lens) + [1] * scratch_rows
    R, T = len(starts), sum(lens)
    n_slots = R0 + 3
    kv = torch.randn(T, W, generator=gen)
    score = torch.randn(T, W, generator=gen) * 2
    state_kv = torch.randn(n_slots, coff * ratio, W, generator=gen)
    state_score = torch.randn(n_slots, coff * ratio, W, generator=gen) * 2
    empty = torch.rand(n_slots, coff * ratio, generator=gen) < 0.2
    state_score[empty] = float("-inf")
    state_kv[empty] = 0.0
    slots = torch.cat((torch.randperm(n_slots - 1, generator=gen)[:R0],
                       torch.full((scratch_rows,), n_slots - 1)))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    if static:
        request = list(range(R))
        entry = [max((s + 1) // ratio - 1, 0) for s in starts]
        valid = torch.tensor([(s + 1) % ratio == 0 for s in starts])
    else:
        request = [i for i, (s, n) in enumerate(zip(starts, lens))
                   for _ in range(s // ratio, (s + n) // ratio)]
        entry = [j for s, n in zip(starts, lens) for j in range(s // ratio, (s + n) // ratio)]
        valid = None
    E = len(request)
    weight = torch.rand(d, generator=gen) + 0.5
    cos = sin = None
    if rope:
        angles = torch.rand(E, rope // 2, generator=gen) * 6.3
        cos, sin = torch.cos(angles), torch.sin(angles)
    long = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    out = Case(kv, score, state_kv, state_score, long(request), long(entry), valid, long(starts),
               cu, slots.long(), ratio, overlap, weight, cos, sin)
    for name, value in vars(out).items():
        if isinstance(value, torch.Tensor):
            setattr(out, name, value.to(device))
    return out


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> None:
    """Every element of the bf16 ``got`` within ``ulps`` bf16 ulps of ``want``."""
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan())
    g, w = g.nan_to_num(), w.nan_to_num()
    mag = torch.maximum(g.abs(), w.abs()).clamp_min(2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    bad = (g - w).abs() > ulps * ulp
    assert not bad.any(), f"{int(bad.sum())} elements beyond {ulps} ulp; max diff " \
                          f"{(g - w).abs().max().item()}"


# ------------------------------------------------------------------------------- twin tests
def _formula(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Pooled entries of one whole sequence from the spec's formula, in float64."""
    d = kv.shape[1] // (2 if overlap else 1)
    out = []
    for j in range(kv.shape[0] // ratio):
        cur = slice(j * ratio, j * ratio + ratio)
        k_rows, s_rows = kv[cur, -d:].double(), score[cur, -d:].double()
        if overlap and j > 0:
            prev = slice(j * ratio - ratio, j * ratio)
            k_rows = torch.cat((kv[prev, :d].double(), k_rows))
            s_rows = torch.cat((score[prev, :d].double(), s_rows))
        out.append((torch.softmax(s_rows, 0) * k_rows).sum(0))
    return torch.stack(out)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False), (2, False)])
def test_twin_pools_a_split_sequence_like_the_formula(ratio: int, overlap: bool) -> None:
    gen = torch.Generator().manual_seed(ratio)
    d, n = 8, 37
    coff = 2 if overlap else 1
    kv = torch.randn(n, coff * d, generator=gen)
    score = torch.randn(n, coff * d, generator=gen)
    state_kv = torch.zeros(2, coff * ratio, coff * d)
    state_score = torch.full_like(state_kv, float("-inf"))
    weight = torch.rand(d, generator=gen) + 0.5
    got, pos = [], 0
    for size in (3, 1, 9, 1, 1, 22):
        end = pos + size
        req = torch.zeros((end // ratio) - (pos // ratio), dtype=torch.int64)
        ent = torch.arange(pos // ratio, end // ratio)
        args = (kv[pos:end], score[pos:end], state_kv, state_score)
        geo = (torch.tensor([pos]), torch.tensor([0, size]), torch.tensor([1]), ratio, overlap)
        got.append(twin.compress_entries(*args, req, ent, None, *geo, weight, 1e-6, None, None,
                                         torch.float32))
        twin.compress_update_state(*args, *geo)
        pos = end
    pooled = _formula(kv, score, ratio, overlap)
    want = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + 1e-6) * weight.double()
    torch.testing.assert_close(torch.cat(got).double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(state_score[0]).all()          # the other slot is untouched


def test_twin_zeros_entries_that_do_not_complete() -> None:
    case = make_case(4, True, 16, [3, 6, 7, 0], [1, 1, 1, 1], static=True)
    out = case.entries(twin.compress_entries, torch.float32)
    assert case.valid.tolist() == [True, False, True, False]
    assert (out[~case.valid] == 0).all() and (out[case.valid] != 0).any()
    assert out[case.valid].isfinite().all()


def test_twin_rejects_bad_arguments() -> None:
    case = make_case(4, True, 16, [0, 5], [9, 3])
    with pytest.raises(ValueError, match="state_kv"):
        twin.compress_update_state(case.kv, case.score, case.state_kv[:, :4], case.state_score,
                                   case.start_pos, case.cu_seqlens, case.slots, 4, True)
    with pytest.raises(ValueError, match="float32"):
        twin.compress_update_state(case.kv.double(), case.score.double(), case.state_kv,
                                   case.state_score, case.start_pos, case.cu_seqlens,
                                   case.slots, 4, True)
    case.weight = case.weight[:8]
    with pytest.raises(ValueError, match="norm_weight"):
        case.entries(twin.compress_entries, torch.float32)


def make_ape(case: Case, seed: int = 0) -> torch.Tensor:
    """A random position bias [ratio, W] (magnitudes like the scores')."""
    gen = torch.Generator().manual_seed(1000 + seed)
    ape = torch.randn(case.ratio, case.kv.shape[1], generator=gen) * 3
    return ape.to(case.kv.device)


def prebiased(case: Case, ape: torch.Tensor) -> torch.Tensor:
    """``score + ape[pos % r]`` with each row's position from the step's host lists (what the
    model's Compressor._rows adds before the ops, independent of the ops' own row mapping)."""
    starts, cu = case.start_pos.tolist(), case.cu_seqlens.tolist()
    pos = [starts[i] + k for i in range(len(starts)) for k in range(cu[i + 1] - cu[i])]
    pos += [0] * (case.score.shape[0] - len(pos))
    pos_t = torch.tensor(pos, dtype=torch.int64, device=case.score.device)
    return case.score + ape[pos_t % case.ratio]


def with_score(case: Case, score: torch.Tensor) -> Case:
    return Case(**{**vars(case), "score": score})


def _ape_cases(device: str = "cpu", d: int = 16) -> list[tuple[str, Case]]:
    """Steps for the ape checks: mixed chunks and decode rows, a static decode step with padding
    rows, per compressor kind, and a ratio-128 group split between the state and the step."""
    out = []
    for ratio, overlap in ((4, True), (8, False), (2, False)):
        starts, lens = _STEPS[ratio]
        out.append((f"r{ratio}-mixed", make_case(ratio, overlap, d, starts, lens, seed=20 + ratio,
                                                 device=device)))
        st = [ratio - 1, 2 * ratio + 1, 3 * ratio - 1, 0]
        out.append((f"r{ratio}-static", make_case(ratio, overlap, d, st, [1] * 4, static=True,
                                                  scratch_rows=2, seed=30 + ratio,
                                                  device=device)))
    out.append(("r128", make_case(128, False, d, [100, 0], [60, 130], seed=41, device=device)))
    return out


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_twin_ape_is_the_prebiased_scores(out_dtype: torch.dtype) -> None:
    """The twins with ``ape`` give, to the bit, what they give on scores biased before the call
    (the model's old add): entries, and the state (which stores the biased scores)."""
    for name, case in _ape_cases():
        ape = make_ape(case)
        biased = with_score(case, prebiased(case, ape))
        want = biased.entries(twin.compress_entries, out_dtype)
        got = twin.compress_entries(*_entry_args(case, out_dtype), ape=ape)
        assert torch.equal(got, want), name
        skv, ssc = case.state_kv.clone(), case.state_score.clone()
        biased.update(twin.compress_update_state, biased.state_kv, biased.state_score)
        twin.compress_update_state(case.kv, case.score, skv, ssc, case.start_pos,
                                   case.cu_seqlens, case.slots, case.ratio, case.overlap,
                                   ape=ape)
        assert torch.equal(skv, biased.state_kv) and torch.equal(ssc, biased.state_score), name


def test_twin_ape_none_and_step_positions() -> None:
    case = make_case(4, True, 16, [0, 5, 3], [9, 0, 2], seed=3)
    # An empty request in the middle: rows map to the requests around it.
    pos = twin.step_positions(case.start_pos, case.cu_seqlens, case.score.shape[0])
    assert pos.tolist() == list(range(9)) + [3, 4]
    assert twin.bias_step_scores(case.score, None, case.start_pos, case.cu_seqlens, 4) \
        is case.score
    ape = make_ape(case)
    assert torch.equal(twin.bias_step_scores(case.score, ape, case.start_pos, case.cu_seqlens, 4),
                       prebiased(case, ape))


def test_twin_rejects_bad_ape() -> None:
    case = make_case(4, True, 16, [0, 5], [9, 3])
    ape = make_ape(case)
    for bad in (ape[:3], ape[:, :16], ape.double(), ape[None]):
        with pytest.raises(ValueError, match="ape"):
            twin.compress_entries(*_entry_args(case, torch.float32), ape=bad)
        with pytest.raises(ValueError, match="ape"):
            twin.compress_update_state(case.kv, case.score, case.state_kv, case.state_score,
                                       case.start_pos, case.cu_seqlens, case.slots, 4, True,
                                       ape=bad)


def _entry_args(case: Case, out_dtype: torch.dtype) -> tuple:
    return (case.kv, case.score, case.state_kv, case.state_score, case.request, case.entry,
            case.valid, case.start_pos, case.cu_seqlens, case.slots, case.ratio, case.overlap,
            case.weight, 1e-6, case.cos, case.sin, out_dtype)


def _unfused(fn):
    """``fn`` behind a wrapper that says it does not fuse ``ape`` (a gated Triton op)."""
    def op(*args, **kwargs):
        return fn(*args, **kwargs)
    op.ape_fused = lambda: False
    return op


def _fused_and_unfused(table: dict) -> list[SimpleNamespace]:
    """An op table (as a dict) as it is, and with both compressor ops saying they do not fuse
    ``ape`` (the model then adds it in _rows)."""
    from dsv4.model.compressor import ops_fuse_ape

    fused = SimpleNamespace(**table)
    unfused = SimpleNamespace(**{**table,
                                 "compress_entries": _unfused(table["compress_entries"]),
                                 "compress_update_state": _unfused(table["compress_update_state"])})
    assert ops_fuse_ape(fused) and not ops_fuse_ape(unfused)
    return [fused, unfused]


def _same_pools_and_states(pools, states) -> None:
    assert torch.equal(pools[0], pools[1])
    assert torch.equal(states[0].kv, states[1].kv)
    assert torch.equal(states[0].score, states[1].score)


def _model_compressors(layer_kind: str, tables: list[SimpleNamespace]) -> tuple:
    """Compressors of one tiny layer (same random weights, a non-zero ape) over the op
    ``tables``, each with its own cache; returns (cfg, layer, name, [(comp, cache, state)])."""
    sys.path.insert(0, str(REPO / "tests" / "model"))
    from test_attention_helpers import LAYER_CSA, LAYER_HCA, tiny_config

    from dsv4.cache.tensors import HybridCache
    from dsv4.model.compressor import Compressor

    cfg = tiny_config()
    layer = LAYER_HCA if layer_kind == "hca" else LAYER_CSA
    name = "index" if layer_kind == "csa_index" else "attn"
    gen = torch.Generator().manual_seed(3)
    comps = []
    for ops in tables:
        cache = HybridCache.allocate(cfg, 4, 2, 128, torch.float32)
        state = cache.compressor_state(layer, name)
        comp = Compressor(cfg, layer, state.spec, "bf16", ops, torch.float32,
                          rotate=name == "index")
        comps.append((comp, cache, state))
    with torch.no_grad():
        for ps in zip(*(c[0].parameters() for c in comps)):
            ps[0].copy_(torch.randn(ps[0].shape, generator=gen) * 0.5)
            for p_k in ps[1:]:
                p_k.copy_(ps[0])
    assert comps[0][0].ape.abs().sum() > 0
    return cfg, layer, name, comps


def _run_model_steps(cfg, layer: int, name: str, comps: list, check) -> None:
    """A prefill chunk and decode steps through every compressor; ``check(pools, states)``."""
    from dsv4.model.context import StepContext

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(140, cfg.dim, generator=gen)
    pos = 0
    for n in (131, 1, 1, 1, 6):
        ctx = StepContext.build(torch.zeros(n, dtype=torch.long), [n], [pos], [1], [[0, 1]])
        pools = []
        for comp, cache, state in comps:
            pool = (cache.index_key_pool(layer) if name == "index"
                    else cache.compressed_pool(layer))
            comp(x[pos:pos + n], ctx, state, pool, None)
            pools.append(pool)
        check(pools, [c[2] for c in comps])
        pos += n
    assert pools[0].abs().sum() > 0


@pytest.mark.parametrize("layer_kind", ["csa_attn", "csa_index", "hca"])
def test_model_compressor_fused_ape_is_bit_identical(layer_kind: str) -> None:
    """The model's Compressor handing ``ape`` to the (twin) ops stores the entries and state of
    the old path that adds it in _rows (ops that say they do not fuse it), to the bit."""
    from dsv4.ops import get_ops

    tables = _fused_and_unfused(vars(get_ops("torch")))
    _run_model_steps(*_model_compressors(layer_kind, tables), _same_pools_and_states)


def test_ops_fuse_ape_follows_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.model.compressor import ops_fuse_ape
    from dsv4.ops import get_ops, triton_compress as tri

    assert ops_fuse_ape(get_ops("torch"))
    ops = SimpleNamespace(compress_entries=tri.compress_entries)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    assert tri.ape_fused() and ops_fuse_ape(ops)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "0")
    assert tri.ape_fused() == ops_fuse_ape(ops) == tri.APE_FUSED_VERIFIED
    monkeypatch.setattr(tri, "APE_FUSED_VERIFIED", True)
    assert tri.ape_fused() and ops_fuse_ape(ops)


def test_ops_table_has_the_compressor_ops() -> None:
    from dsv4.ops import get_ops

    ops = get_ops("torch")
    assert ops.compress_entries is twin.compress_entries
    assert ops.compress_update_state is twin.compress_update_state


# ------------------------------------------------------------------------ interpreter tests
def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests are collected directly")
    run_in_interpreter(__file__, "interp", min_passed=40)


def _compare(case: Case, out_dtype: torch.dtype) -> None:
    from dsv4.ops import triton_compress as tri

    want = case.entries(twin.compress_entries, out_dtype)
    got = case.entries(tri.compress_entries, out_dtype)
    assert got.dtype == want.dtype == out_dtype and got.shape == want.shape
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        assert_within_ulp(got, want)
    skv, ssc = case.state_kv.clone(), case.state_score.clone()
    case.update(twin.compress_update_state, case.state_kv, case.state_score)
    case.update(tri.compress_update_state, skv, ssc)
    assert torch.equal(skv, case.state_kv) and torch.equal(ssc, case.state_score)


# Per ratio: requests whose groups come from the state only, the step only, or both (starts
# mid-group), one-token steps that complete a group or not, a chunk spanning several groups.
_STEPS = {4: ([0, 5, 3, 10, 14, 21], [9, 3, 1, 7, 2, 1]),
          8: ([0, 13, 7, 20, 30, 47], [19, 3, 1, 12, 2, 1]),
          2: ([0, 5, 3, 10, 14, 21], [9, 3, 1, 7, 2, 1])}


# compress_entries plans: (DSV4_COMPRESS_PLAN, DSV4_COMPRESS_TILE); at d 16 / 24 the split
# plan's default is one block finished in registers (ratio 128: blocks of 8 channels), "4,1"
# four to six blocks finished by the last arrival, "8,2" two or three over two warps.
PLANS = [("loop", None), ("split", None), ("split", "4,1"), ("split", "8,2")]
_plan_ids = [p if t is None else f"{p}-{t}" for p, t in PLANS]


@pytest.fixture(params=PLANS, ids=_plan_ids)
def plan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name, tile = request.param
    monkeypatch.setenv("DSV4_COMPRESS_PLAN", name)
    if tile:
        monkeypatch.setenv("DSV4_COMPRESS_TILE", tile)
    else:
        monkeypatch.delenv("DSV4_COMPRESS_TILE", raising=False)
    return name


def _counters_clean() -> None:
    from dsv4.ops.triton_dense import splitk_counters

    assert not splitk_counters(torch.device("cpu"), 1).any(), "arrival counters left dirty"


@needs_interp
@pytest.mark.parametrize("ratio,overlap,rope", [(4, True, 8), (8, False, 8), (2, False, 0)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_interp_entries_and_state(ratio: int, overlap: bool, rope: int,
                                  out_dtype: torch.dtype, plan: str) -> None:
    starts, lens = _STEPS[ratio]
    _compare(make_case(ratio, overlap, 16, starts, lens, rope=rope, seed=ratio), out_dtype)
    _counters_clean()


@needs_interp
def test_interp_ratio_128_and_odd_width(plan: str) -> None:
    # A full ratio-128 group from the state plus the step; d = 24 leaves a partial channel block.
    _compare(make_case(128, False, 24, [100, 0], [60, 130], rope=8, seed=5), torch.float32)
    _compare(make_case(4, True, 24, [2, 7], [11, 1], rope=8, seed=6), torch.bfloat16)
    _counters_clean()


@needs_interp
def test_interp_split_plan_matches_loop_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan gives the loop plan's entries (within the norm's sum-order tolerance), also
    where request e is not entry e (the split plan's speculative row reads miss)."""
    from dsv4.ops import triton_compress as tri

    case = make_case(4, True, 24, [0, 5, 3, 10, 14, 21], [9, 3, 1, 7, 2, 1], rope=8, seed=9)
    assert (case.request != torch.arange(case.request.shape[0])).any()
    outs = {}
    for name, tile in PLANS:
        monkeypatch.setenv("DSV4_COMPRESS_PLAN", name)
        monkeypatch.setenv("DSV4_COMPRESS_TILE", tile or "")
        outs[(name, tile)] = case.entries(tri.compress_entries, torch.float32)
    for key, got in outs.items():
        torch.testing.assert_close(got, outs[("loop", None)], rtol=2e-6, atol=1e-6, msg=str(key))
    _counters_clean()


def test_entries_plan_by_entry_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.ops import triton_compress as tri

    monkeypatch.delenv("DSV4_COMPRESS_PLAN", raising=False)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    assert tri.entries_plan(1) == tri.entries_plan(tri.SPLIT_MAX_ENTRIES) == "split"
    assert tri.entries_plan(tri.SPLIT_MAX_ENTRIES + 1) == "loop"
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "0")
    assert tri.entries_plan(1) == ("split" if tri.SPLIT_PLAN_VERIFIED else "loop")
    monkeypatch.setenv("DSV4_COMPRESS_PLAN", "split")
    assert tri.entries_plan(10 ** 6) == "split"
    monkeypatch.setenv("DSV4_COMPRESS_PLAN", "loop")
    assert tri.entries_plan(1) == "loop"
    monkeypatch.setenv("DSV4_COMPRESS_PLAN", "fast")
    with pytest.raises(ValueError, match="DSV4_COMPRESS_PLAN"):
        tri.entries_plan(1)
    monkeypatch.delenv("DSV4_COMPRESS_PLAN")
    # V4-Flash tiles: d 512 ratio 4 in 16 blocks over one warp, the indexer's d 128 in 4,
    # ratio 128 in 32 blocks of 16 channels over 4 warps.
    assert tri.split_tiles(4, True, 512) == (8, 32, 512, 1)
    assert tri.split_tiles(4, True, 128) == (8, 32, 128, 1)
    assert tri.split_tiles(128, False, 512) == (128, 16, 512, 4)


@needs_interp
@pytest.mark.parametrize("ratio,overlap", [(4, True), (2, False)])
def test_interp_column_slices_read_in_place(ratio: int, overlap: bool) -> None:
    """kv / score as column slices of one wider GEMM output (the stacked wkv + wgate on the GPU):
    the kernels read them in place (row strides) and give what contiguous rows give."""
    from dsv4.ops import triton_compress as tri

    starts, lens = _STEPS[ratio]
    case = make_case(ratio, overlap, 16, starts, lens, rope=8, seed=11)
    want = case.entries(tri.compress_entries, torch.float32)
    skv, ssc = case.state_kv.clone(), case.state_score.clone()
    case.update(tri.compress_update_state, skv, ssc)
    wide = torch.cat((case.kv, case.score, torch.full_like(case.kv, float("nan"))), dim=1)
    W = case.kv.shape[1]
    case.kv, case.score = wide[:, :W], wide[:, W:2 * W]
    assert not case.kv.is_contiguous() and case.kv.stride(0) == 3 * W
    got = case.entries(tri.compress_entries, torch.float32)
    assert torch.equal(got, want)
    case.update(tri.compress_update_state, case.state_kv, case.state_score)
    assert torch.equal(case.state_kv, skv) and torch.equal(case.state_score, ssc)


@needs_interp
@pytest.mark.parametrize("ratio,overlap", [(4, True), (128, False)])
def test_interp_static_candidates_and_padding(ratio: int, overlap: bool, plan: str) -> None:
    starts = [ratio - 1, 2 * ratio + 1, 3 * ratio - 1, 0]
    case = make_case(ratio, overlap, 16, starts, [1] * 4, static=True, scratch_rows=2, seed=7)
    from dsv4.ops import triton_compress as tri

    want = case.entries(twin.compress_entries, torch.float32)
    got = case.entries(tri.compress_entries, torch.float32)
    assert case.valid.tolist() == [True, False, True, False, False, False]
    assert (got[~case.valid] == 0).all()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    # Padding rows share the scratch slot (its final rows are either row's): compare the rest.
    skv, ssc = case.state_kv.clone(), case.state_score.clone()
    case.update(twin.compress_update_state, case.state_kv, case.state_score)
    case.update(tri.compress_update_state, skv, ssc)
    real = case.slots[:4]
    assert torch.equal(skv[real], case.state_kv[real])
    assert torch.equal(ssc[real], case.state_score[real])


@needs_interp
@pytest.mark.parametrize("layer_kind", ["csa_attn", "csa_index", "hca"])
def test_interp_model_compressor_matches_torch_ops(layer_kind: str) -> None:
    """The model's Compressor with the Triton op table stores the entries of the torch one over
    a prefill chunk and decode steps (its state carried by the kernels)."""
    from dsv4.ops import get_ops

    # The projections stay the twin's (linear_fp32 sums in another order), so the compress
    # kernels see the same rows and their state must match to the bit.
    twin_linear = get_ops("torch").linear_fp32
    tables = [SimpleNamespace(**{**vars(get_ops(backend)), "linear_fp32": twin_linear})
              for backend in ("torch", "triton")]

    def check(pools, states):
        torch.testing.assert_close(pools[1], pools[0], rtol=2e-6, atol=1e-6)
        if states[0].spec.compact:
            # The HCA's float64 pseudo-rows: sums in another order, to float64 rounding.
            for a, b in ((states[1].kv, states[0].kv), (states[1].score, states[0].score)):
                torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
        else:
            assert torch.equal(states[1].kv, states[0].kv)

    _run_model_steps(*_model_compressors(layer_kind, tables), check)


@needs_interp
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_fused_ape(out_dtype: torch.dtype, plan: str,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan with the fused ``ape`` add (HAS_APE) gives, to the bit, the kernels' entries
    and state on scores biased in torch before the call, also on column slices of a wider GEMM
    output; and the twin's entries (within the kernels' tolerance) and state (bit-exact)."""
    from dsv4.ops import triton_compress as tri

    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    assert tri.ape_fused()
    for name, case in _ape_cases():
        ape = make_ape(case)
        biased = with_score(case, prebiased(case, ape))
        want = biased.entries(tri.compress_entries, out_dtype)
        got = tri.compress_entries(*_entry_args(case, out_dtype), ape=ape)
        assert torch.equal(got, want), name
        ref = twin.compress_entries(*_entry_args(case, out_dtype), ape=ape)
        if out_dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6, msg=name)
        else:
            assert_within_ulp(got, ref)
        # Column slices: kv and score read in place from one wider row (the stacked GEMM).
        W = case.kv.shape[1]
        wide = torch.cat((case.kv, case.score, torch.full_like(case.kv, float("nan"))), dim=1)
        sliced = Case(**{**vars(case), "kv": wide[:, :W], "score": wide[:, W:2 * W]})
        assert torch.equal(tri.compress_entries(*_entry_args(sliced, out_dtype), ape=ape), got)
        for rows in (case, sliced):
            skv, ssc = case.state_kv.clone(), case.state_score.clone()
            tri.compress_update_state(rows.kv, rows.score, skv, ssc, case.start_pos,
                                      case.cu_seqlens, case.slots, case.ratio, case.overlap,
                                      ape=ape)
            bkv, bsc = case.state_kv.clone(), case.state_score.clone()
            twin.compress_update_state(biased.kv, biased.score, bkv, bsc, case.start_pos,
                                       case.cu_seqlens, case.slots, case.ratio, case.overlap)
            real = case.slots[:4] if case.valid is not None else case.slots
            assert torch.equal(skv[real], bkv[real]) and torch.equal(ssc[real], bsc[real]), name
    _counters_clean()


@needs_interp
def test_interp_ape_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until APE_FUSED_VERIFIED (and without DSV4_UNVERIFIED_KERNELS=1) the wrappers add ape in
    torch (the twin's add) and launch without it; with the gate open they fuse it.  Same bits
    either way."""
    from dsv4.ops import triton_compress as tri

    monkeypatch.setenv("DSV4_COMPRESS_PLAN", "split")
    monkeypatch.delenv("DSV4_COMPRESS_TILE", raising=False)
    monkeypatch.setattr(tri, "APE_FUSED_VERIFIED", False)
    case = make_case(4, True, 16, *_STEPS[4], seed=12)
    ape = make_ape(case)
    calls = []
    real_bias = twin.bias_step_scores

    def spy(*args, **kwargs):
        calls.append(1)
        return real_bias(*args, **kwargs)

    monkeypatch.setattr(twin, "bias_step_scores", spy)
    outs = {}
    for env in ("0", "1"):
        monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", env)
        calls.clear()
        skv, ssc = case.state_kv.clone(), case.state_score.clone()
        outs[env] = tri.compress_entries(*_entry_args(case, torch.float32), ape=ape)
        tri.compress_update_state(case.kv, case.score, skv, ssc, case.start_pos,
                                  case.cu_seqlens, case.slots, 4, True, ape=ape)
        assert len(calls) == (2 if env == "0" else 0)
        outs[env, "state"] = (skv, ssc)
    assert torch.equal(outs["0"], outs["1"])
    assert all(torch.equal(a, b) for a, b in zip(outs["0", "state"], outs["1", "state"]))


@needs_interp
@pytest.mark.parametrize("layer_kind", ["csa_attn", "hca"])
def test_interp_model_compressor_fused_ape(layer_kind: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's Compressor over the Triton table with the fused ape add (gate open) stores
    the bits of the Triton table with the gate closed (the model's own add in _rows)."""
    from dsv4.ops import get_ops

    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    base = {**vars(get_ops("triton")), "linear_fp32": get_ops("torch").linear_fp32}
    _run_model_steps(*_model_compressors(layer_kind, _fused_and_unfused(base)),
                     _same_pools_and_states)


# ---------------------------------------------------------------------------------- GPU tests
@needs_cuda
@pytest.mark.parametrize("ratio,overlap,d", [(4, True, 512), (4, True, 128), (128, False, 512),
                                             (2, False, 512)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_flash_shapes(ratio: int, overlap: bool, d: int, out_dtype: torch.dtype) -> None:
    """V4-Flash shapes (rope 64; V4.1's ratio 2 without RoPE): a 64-request static decode step
    (two padding rows) and a mixed prefill step of chunks and decode rows."""
    from dsv4.ops import triton_compress as tri

    rope = 0 if ratio == 2 else 64
    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 40 * ratio, (62,), generator=gen).tolist()
    starts[:8] = [(k + 1) * ratio - 1 for k in range(8)]        # some candidates complete
    for static in (True, False):
        if static:
            case = make_case(ratio, overlap, d, starts, [1] * 62, rope=rope, static=True,
                             scratch_rows=2, device="cuda")
        else:
            lens = [3 * ratio + 5, 2 * ratio, 1, 17] + [1] * 60
            case = make_case(ratio, overlap, d, [0, ratio + 3] + starts[:62], lens, rope=rope,
                             device="cuda")
        want = case.entries(twin.compress_entries, out_dtype)
        got = case.entries(tri.compress_entries, out_dtype)
        if out_dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_within_ulp(got, want)
        skv, ssc = case.state_kv.clone(), case.state_score.clone()
        case.update(twin.compress_update_state, case.state_kv, case.state_score)
        case.update(tri.compress_update_state, skv, ssc)
        real = case.slots[:62] if static else case.slots
        assert torch.equal(skv[real], case.state_kv[real])
        assert torch.equal(ssc[real], case.state_score[real])
