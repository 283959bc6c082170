"""The compact carry-over state of the compressor ops (one float64 pseudo-row per slot: the
header of dsv4/ops/torch_compress.py), against the raw fp32 rows.

The claim under test: for non-overlapping compressors the compact state gives the raw state's
pooled fp32 entries **bit for bit** (float64 errors ~1e-16 can only flip an fp32 rounding at a
near-tie, which random data never hits), whatever the split of the sequences into steps.

* twin tests (CPU, always): sequences driven through many schedules (one prefill; prefill then
  token-by-token decode; odd chunks across group boundaries; several requests per step at
  different positions; slots reused after a reset), ratios 8, 16 and 128, with and without
  ``ape``: compact pooled / finished entries ``torch.equal`` to raw ones of the same schedule
  and pooled entries equal to the raw one-shot prefill's; single steps of random states (raw
  state -> its pseudo-rows: :func:`compact_of`), static decode candidates with padding rows;
  the pseudo-row formula itself; argument checks;
* interpreter tests (``test_interp_*``, run in a child by ``test_compact_kernels_in_interpreter``):
  the Triton kernels with a compact state against the raw-state kernels (entries bit-equal over
  driven schedules, both ``compress_entries`` plans, with ``ape``) and against the compact twin
  (entries within the norm's sum-order tolerance; pseudo-rows to float64 rounding, since the
  kernel's reductions add in another order than torch's);
* the GPU cases at V4-Flash shapes are in tests/kernels/test_compress_decode.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from dsv4.ops import torch_compress as twin
from tests.kernels.interp_child import run_in_interpreter
from tests.kernels.test_triton_compress import (Case, _entry_args, _STEPS, make_ape, make_case,
                                                with_score)

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (run by "
                                  "test_compact_kernels_in_interpreter)")
TWIN = SimpleNamespace(compress_entries=twin.compress_entries,
                       compress_update_state=twin.compress_update_state)


# ------------------------------------------------------------------------------ helpers
def compact_of(state_kv: torch.Tensor, state_score: torch.Tensor, start_pos: torch.Tensor,
               slots: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact state [slots, 1, W] float64 equivalent to a raw state for requests starting
    at ``start_pos`` in ``slots``: each slot's pseudo-row of its open group's rows before the
    start (rows 0 .. p0 % r − 1); slots no request reads are empty."""
    n, _, W = state_kv.shape
    kv = torch.zeros(n, 1, W, dtype=torch.float64, device=state_kv.device)
    score = torch.full_like(kv, float("-inf"))
    for slot, p0 in zip(slots.tolist(), start_pos.tolist()):
        k = p0 % ratio
        if k == 0:
            continue                                   # nothing of the group before p0
        pk, pg = twin.summarize_rows(state_kv[slot:slot + 1, :k], state_score[slot:slot + 1, :k])
        kv[slot, 0], score[slot, 0] = pk[0], pg[0]
    return kv, score


def compact_case(case: Case) -> Case:
    """``case`` with its raw state replaced by the equivalent compact one."""
    kv, score = compact_of(case.state_kv, case.state_score, case.start_pos, case.slots,
                           case.ratio)
    return Case(**{**vars(case), "state_kv": kv, "state_score": score})


def empty_state(n_slots: int, ratio: int, W: int, compact: bool, device: str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty carry-over state of either form (kv 0, score −inf)."""
    shape = (n_slots, 1 if compact else ratio, W)
    dtype = torch.float64 if compact else torch.float32
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.full(shape, float("-inf"), dtype=dtype, device=device))


@dataclass
class Seq:
    """One request's rows over its whole sequence."""

    kv: torch.Tensor
    score: torch.Tensor


def make_seqs(n: int, lengths: list[int], W: int, seed: int, device: str = "cpu") -> list[Seq]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        kv = torch.randn(lengths[k], W, generator=gen)
        score = torch.randn(lengths[k], W, generator=gen) * 2
        out.append(Seq(kv.to(device), score.to(device)))
    return out


# A schedule: steps of (sequence id, slot, tokens).  A sequence's first step resets its slot
# (the engine's reset_slots); its position advances by the tokens it is given.
Schedule = list[list[tuple[int, int, int]]]


def chunked(seq: int, slot: int, sizes: list[int], n: int) -> Schedule:
    """One sequence of n tokens fed in chunks of ``sizes`` (the last size repeats)."""
    steps, pos, k = [], 0, 0
    while pos < n:
        size = min(sizes[min(k, len(sizes) - 1)], n - pos)
        steps.append([(seq, slot, size)])
        pos, k = pos + size, k + 1
    return steps


def seq_lengths(r: int, n: int) -> list[int]:
    """Lengths of the sequences of :func:`schedules` (n >= 2r + 3)."""
    return [n, n, 2 * r + 3, r + 1]


def schedules(r: int, n: int) -> dict[str, Schedule]:
    """Splits of sequence 0 (n tokens) and a batched schedule of sequences 0..3 (lengths
    :func:`seq_lengths`) at different positions in one step: chunks and decode rows mixed,
    sequence 3 reusing sequence 2's slot once it has ended."""
    out = {"one-shot": chunked(0, 1, [n], n),
           "prefill+decode": chunked(0, 1, [r + 3, 1], n),
           "odd": chunked(0, 1, [3, r - 2, 7, 1, 1, 2 * r + 1, 5], n),
           "ends-at-boundary": chunked(0, 1, [r, 1, r - 1, r + 1, 1], n)}
    slot = {0: 2, 1: 0, 2: 3, 3: 3}
    lengths = seq_lengths(r, n)
    rounds = [[(0, r + 5), (1, 2)], [(1, 2 * r - 1), (2, 1), (0, 1)],
              [(2, 2 * r + 2), (0, r - 1), (1, 1)], [(3, 1), (0, 3), (1, r)]]
    done = [0] * 4
    batched: Schedule = []
    while sum(done) < sum(lengths):
        want = rounds[len(batched)] if len(batched) < len(rounds) else [(0, 1), (1, 3), (3, 2)]
        step = []
        for s, size in want:
            k = min(size, lengths[s] - done[s])
            if k > 0:
                step.append((s, slot[s], k))
                done[s] += k
        batched.append(step)
    assert done[2] == lengths[2] and len(batched) > 3    # sequence 2 ended before 3 began
    out["batched"] = batched
    return out


def rope_rows(ent: torch.Tensor, ratio: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [E, half] at the entries' first positions (a function of the entry only, so
    every schedule rotates an entry alike)."""
    freq = torch.arange(1, half + 1, dtype=torch.float32, device=ent.device) * 1e-3
    ang = (ent * ratio).float()[:, None] * freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def drive(ops: SimpleNamespace, seqs: list[Seq], schedule: Schedule, ratio: int,
          compact: bool, ape: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
          pooled: bool = False, n_slots: int = 5, rope: int = 8
          ) -> tuple[dict[tuple[int, int], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Run ``schedule`` through ``ops`` (compress_entries, compress_update_state) from empty
    slots; returns ({(sequence, entry): finished entry [d]}, final state).  ``pooled``: the
    twin's pooled fp32 entries (compress_pool, before the norm) instead of finished ones."""
    W = seqs[0].kv.shape[1]
    dev = seqs[0].kv.device
    skv, ssc = empty_state(n_slots, ratio, W, compact, str(dev))
    weight = torch.linspace(0.5, 1.5, W, device=dev)
    pos = [0] * len(seqs)
    out: dict[tuple[int, int], torch.Tensor] = {}
    long = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    for step in schedule:
        for s, slot, _ in step:
            if pos[s] == 0:                                # a new sequence: reset its slot
                skv[slot] = 0.0
                ssc[slot] = float("-inf")
        kv = torch.cat([seqs[s].kv[pos[s]:pos[s] + n] for s, _, n in step])
        score = torch.cat([seqs[s].score[pos[s]:pos[s] + n] for s, _, n in step])
        start = long([pos[s] for s, _, _ in step])
        cu = long([0] + torch.tensor([n for _, _, n in step]).cumsum(0).tolist())
        slots = long([slot for _, slot, _ in step])
        keys = [(s, j) for s, _, n in step for j in range(pos[s] // ratio,
                                                          (pos[s] + n) // ratio)]
        req = long([i for i, (s, _, n) in enumerate(step)
                    for _ in range(pos[s] // ratio, (pos[s] + n) // ratio)])
        ent = long([j for _, j in keys])
        if pooled:
            biased = twin.bias_step_scores(score, ape, start, cu, ratio)
            got = twin.compress_pool(kv, biased, skv, ssc, req, ent, start, cu, slots, ratio,
                                     False)
        else:
            cos, sin = rope_rows(ent, ratio, rope // 2) if rope else (None, None)
            got = ops.compress_entries(kv, score, skv, ssc, req, ent, None, start, cu, slots,
                                       ratio, False, weight, 1e-6, cos, sin, out_dtype, ape=ape)
        ops.compress_update_state(kv, score, skv, ssc, start, cu, slots, ratio, False, ape=ape)
        for k, key in enumerate(keys):
            out[key] = got[k]
        for s, _, n in step:
            pos[s] += n
    return out, (skv, ssc)


def assert_same_entries(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    keys = sorted(want)
    g = torch.stack([got[k] for k in keys])
    w = torch.stack([want[k] for k in keys])
    diff = (g.float() - w.float()).abs()
    assert torch.equal(g, w), (f"{what}: {int((g != w).sum())} of {g.numel()} elements differ "
                               f"(max {diff.max().item():.3g})")


# --------------------------------------------------------------------------------- twin tests
_TWIN_RATIOS = [(8, 5 * 8 + 3), (16, 3 * 16 + 9), (128, 2 * 128 + 40)]


@pytest.mark.parametrize("ratio,n", _TWIN_RATIOS, ids=[f"r{r}" for r, _ in _TWIN_RATIOS])
@pytest.mark.parametrize("with_ape", [False, True], ids=["no-ape", "ape"])
def test_twin_compact_entries_are_the_raw_entries(ratio: int, n: int, with_ape: bool) -> None:
    """Every schedule: compact pooled and finished entries equal to the raw state's, bit for
    bit; pooled entries equal to the raw one-shot prefill's (split invariance kept)."""
    d = 16
    seqs = make_seqs(4, seq_lengths(ratio, n), d, seed=ratio + with_ape)
    gen = torch.Generator().manual_seed(7 * ratio)
    ape = torch.randn(ratio, d, generator=gen) * 3 if with_ape else None
    scheds = schedules(ratio, n)
    one_shot, _ = drive(TWIN, seqs, scheds["one-shot"], ratio, False, ape, pooled=True)
    assert len(one_shot) == n // ratio
    for name, sched in scheds.items():
        raw_p, _ = drive(TWIN, seqs, sched, ratio, False, ape, pooled=True)
        comp_p, _ = drive(TWIN, seqs, sched, ratio, True, ape, pooled=True)
        assert_same_entries(comp_p, raw_p, f"{name} pooled")
        assert_same_entries({k: v for k, v in comp_p.items() if k[0] == 0}, one_shot,
                            f"{name} pooled vs one-shot")
        for dtype in (torch.float32, torch.bfloat16):
            raw_e, _ = drive(TWIN, seqs, sched, ratio, False, ape, dtype)
            comp_e, _ = drive(TWIN, seqs, sched, ratio, True, ape, dtype)
            assert_same_entries(comp_e, raw_e, f"{name} {dtype} entries")


def test_twin_compact_comparison_is_not_vacuous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard: a pseudo-row that drops a row (or a state left unreset) changes the entries."""
    ratio, n, d = 16, 3 * 16 + 9, 16
    seqs = make_seqs(4, seq_lengths(ratio, n), d, seed=1)
    sched = chunked(0, 1, [ratio + 3, 1], n)
    want, _ = drive(TWIN, seqs, sched, ratio, True, pooled=True)
    real = twin.summarize_rows

    def lossy(kv, score):          # forgets the group's first row
        return real(kv[:, 1:], score[:, 1:])

    monkeypatch.setattr(twin, "summarize_rows", lossy)
    got, _ = drive(TWIN, seqs, sched, ratio, True, pooled=True)
    assert not torch.equal(torch.stack([got[k] for k in sorted(got)]),
                           torch.stack([want[k] for k in sorted(want)]))


def test_twin_pseudo_row_formula() -> None:
    """summarize_rows: (k*, g*) with exp(g* − M)·k* = Σ exp(g_i − M)·k_i, Σ exp(g_i − M) =
    exp(g* − M) for any M; empty channels give kv 0, score −inf (no NaN); −inf rows count as
    nothing."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 7, 5, generator=gen)
    score = torch.randn(3, 7, 5, generator=gen) * 4
    score[0, :, 1] = float("-inf")                       # an empty channel
    score[1, 2:, :] = float("-inf")                      # empty rows
    k, g = twin.summarize_rows(kv, score)
    assert k.dtype == g.dtype == torch.float64
    assert k[0, 1] == 0 and torch.isneginf(g[0, 1]) and not k.isnan().any()
    s64, k64 = score.double(), kv.double()
    for M in (0.0, 3.5, -2.0):
        w = torch.exp(s64 - M)
        num = (w * k64).sum(1)
        den = w.sum(1)
        live = ~torch.isneginf(g)
        torch.testing.assert_close((torch.exp(g - M) * k)[live], num[live], rtol=1e-14,
                                   atol=1e-14)
        torch.testing.assert_close(torch.exp(g - M)[live], den[live], rtol=1e-14, atol=0)
    k1, g1 = twin.summarize_rows(kv[1:2, :2], score[1:2, :2])
    assert torch.equal(k1, k[1:2]) and torch.equal(g1, g[1:2])


def _step_cases(device: str = "cpu", d: int = 16) -> list[tuple[str, Case]]:
    """Single steps of random raw states (the compact one derived by compact_of): mixed chunks
    and decode rows, static decode candidates with padding rows, a ratio-128 group split
    between the state and the step."""
    out = []
    for ratio in (8, 16):
        starts, lens = _STEPS[8]
        starts = [s * ratio // 8 for s in starts]
        out.append((f"r{ratio}-mixed", make_case(ratio, False, d, starts, lens, seed=ratio,
                                                 device=device)))
        st = [ratio - 1, 2 * ratio + 1, 3 * ratio - 1, 0]
        out.append((f"r{ratio}-static", make_case(ratio, False, d, st, [1] * 4, static=True,
                                                  scratch_rows=2, seed=30 + ratio,
                                                  device=device)))
    out.append(("r128", make_case(128, False, d, [100, 0, 255], [60, 130, 2], seed=41,
                                  device=device)))
    out.append(("r128-static", make_case(128, False, d, [127, 300, 255, 128], [1] * 4,
                                         static=True, scratch_rows=2, seed=42, device=device)))
    return out


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_twin_compact_single_steps(out_dtype: torch.dtype) -> None:
    """One step from a random raw state and from its compact form: the same entries (bits),
    with and without ape; the updated compact state is the pseudo-row of the updated raw one."""
    for name, case in _step_cases():
        cc = compact_case(case)
        for ape in (None, make_ape(case)):
            want = twin.compress_entries(*_entry_args(case, out_dtype), ape=ape)
            got = twin.compress_entries(*_entry_args(cc, out_dtype), ape=ape)
            assert torch.equal(got, want), name
            if case.valid is not None:
                assert (got[~case.valid] == 0).all() and got[case.valid].isfinite().all()
            rkv, rsc = case.state_kv.clone(), case.state_score.clone()
            ckv, csc = cc.state_kv.clone(), cc.state_score.clone()
            geo = (case.start_pos, case.cu_seqlens, case.slots, case.ratio, False)
            twin.compress_update_state(case.kv, case.score, rkv, rsc, *geo, ape=ape)
            twin.compress_update_state(case.kv, case.score, ckv, csc, *geo, ape=ape)
            end = case.start_pos + case.cu_seqlens.diff()
            real = case.slots if case.valid is None else case.slots[:4]
            want_kv, want_sc = compact_of(rkv, rsc, end, case.slots, case.ratio)
            torch.testing.assert_close(ckv[real], want_kv[real], rtol=1e-13, atol=1e-13)
            torch.testing.assert_close(csc[real], want_sc[real], rtol=1e-13, atol=1e-13)


def test_twin_rejects_bad_compact_states() -> None:
    case = compact_case(make_case(8, False, 16, [0, 5], [9, 3]))
    args = (case.start_pos, case.cu_seqlens, case.slots, 8, False)
    with pytest.raises(ValueError, match=r"\[num_slots, 1, 16\]"):
        twin.compress_update_state(case.kv, case.score, case.state_kv.expand(-1, 2, -1),
                                   case.state_score.expand(-1, 2, -1), *args)
    with pytest.raises(ValueError, match="state_score must be float64"):
        twin.compress_update_state(case.kv, case.score, case.state_kv, case.state_score.float(),
                                   *args)
    ov = make_case(4, True, 16, [0, 5], [9, 3])
    kv64 = torch.zeros(ov.state_kv.shape[0], 1, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="non-overlapping"):
        twin.compress_update_state(ov.kv, ov.score, kv64, kv64.clone(), ov.start_pos,
                                   ov.cu_seqlens, ov.slots, 4, True)


def test_model_compressor_compact_state_stores_the_raw_entries(monkeypatch) -> None:
    """The model's HCA Compressor (ratio 128, torch ops, fused ape) over prefill chunks and
    decode steps that complete groups from the carry-over: the same pool bits with the compact
    cache state as with the raw one (DSV4_COMPACT_STATE=0); a state left stale differs."""
    import dsv4.cache.tensors as tensors
    from dsv4.model.context import StepContext
    from dsv4.ops import get_ops
    from tests.kernels.test_triton_compress import _model_compressors

    cfg, layer, name, comps = _model_compressors("hca", [get_ops("torch")] * 3)
    assert comps[0][2].spec.compact and comps[0][2].kv.dtype == torch.float64
    monkeypatch.setattr(tensors, "COMPACT_STATE", False)
    raw_cache = tensors.HybridCache.allocate(cfg, 4, 2, 128, torch.float32)
    raw_state = raw_cache.compressor_state(layer, name)
    assert raw_state.kv.shape[1] == 128 and raw_state.kv.dtype == torch.float32
    comps[1] = (comps[1][0], raw_cache, raw_state)
    x = torch.randn(300, cfg.dim, generator=torch.Generator().manual_seed(4))
    pos = 0
    # Entry 0 completes in a decode step, entry 1 in a chunk that starts mid-group.
    for n in (100, 27, 1, 1, 3, 1, 90, 36, 1, 40):
        ctx = StepContext.build(torch.zeros(n, dtype=torch.long), [n], [pos], [1], [[0, 1]])
        for k, (comp, cache, state) in enumerate(comps):
            if k == 2 and pos == 223:
                cache.reset_slots([1])                 # the guard: a lost carry-over
            comp(x[pos:pos + n], ctx, state, cache.compressed_pool(layer), None)
        pos += n
    pools = [c[1].compressed_pool(layer) for c in comps]
    assert pools[0][:2, 0].abs().sum(-1).gt(0).all()   # entries 0 and 1 stored
    assert torch.equal(pools[0], pools[1])
    assert not torch.equal(pools[0], pools[2])


# ------------------------------------------------------------------------ interpreter tests
def test_compact_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests are collected directly")
    run_in_interpreter(__file__, "interp", min_passed=12)


PLANS = [("loop", None), ("split", None), ("split", "4,1")]


@pytest.fixture(params=PLANS, ids=[p if t is None else f"{p}-{t}" for p, t in PLANS])
def plan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name, tile = request.param
    monkeypatch.setenv("DSV4_COMPRESS_PLAN", name)
    monkeypatch.setenv("DSV4_COMPRESS_TILE", tile or "")
    # The compact kernels (and the fused ape) run: not the twin fallback of their GPU gate.
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    return name


def _triton() -> SimpleNamespace:
    from dsv4.ops import triton_compress as tri

    assert tri.compact_kernels()
    return SimpleNamespace(compress_entries=tri.compress_entries,
                           compress_update_state=tri.compress_update_state)


def _assert_states_close(got: tuple, want: tuple, slots: torch.Tensor | None = None) -> None:
    """Pseudo-rows to float64 rounding (the kernel's reductions add in another order)."""
    for g, w in zip(got, want):
        if slots is not None:
            g, w = g[slots], w[slots]
        assert g.dtype == w.dtype == torch.float64
        assert torch.equal(torch.isneginf(g), torch.isneginf(w))
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)


def _assert_entries_close(got: dict, want: dict, dtype: torch.dtype) -> None:
    from tests.kernels.test_triton_compress import assert_within_ulp

    keys = sorted(want)
    assert got.keys() == want.keys()
    g = torch.stack([got[k] for k in keys])
    w = torch.stack([want[k] for k in keys])
    if dtype == torch.float32:
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-6)
    else:
        assert_within_ulp(g, w)


@needs_interp
@pytest.mark.parametrize("ratio,n", [(8, 4 * 8 + 3), (16, 2 * 16 + 9)], ids=["r8", "r16"])
def test_interp_compact_schedules(ratio: int, n: int, plan: str) -> None:
    """Driven schedules through the kernels: compact entries bit-equal to the raw-state
    kernels' (fp32, bf16 with ape), within tolerance of the compact twin's; the final
    pseudo-rows the twin's to float64 rounding."""
    tri = _triton()
    d = 16
    seqs = make_seqs(4, seq_lengths(ratio, n), d, seed=ratio)
    gen = torch.Generator().manual_seed(ratio)
    ape = torch.randn(ratio, d, generator=gen) * 3
    scheds = schedules(ratio, n)
    for name in ("prefill+decode", "batched"):
        for a, dtype in ((None, torch.float32), (ape, torch.bfloat16)):
            raw, _ = drive(tri, seqs, scheds[name], ratio, False, a, dtype)
            comp, state = drive(tri, seqs, scheds[name], ratio, True, a, dtype)
            assert_same_entries(comp, raw, f"{name} {dtype}")
            ref, ref_state = drive(TWIN, seqs, scheds[name], ratio, True, a, dtype)
            _assert_entries_close(comp, ref, dtype)
            _assert_states_close(state, ref_state)
    _counters_clean()


@needs_interp
def test_interp_compact_ratio_128(plan: str) -> None:
    """Ratio 128 (d 24: a partial channel block): a few chunks across the group boundaries
    and decode rows, with ape: bit-equal to the raw-state kernels, close to the twin."""
    tri = _triton()
    r, d = 128, 24
    seqs = make_seqs(2, [300, 140], d, seed=5)
    gen = torch.Generator().manual_seed(6)
    ape = torch.randn(r, d, generator=gen) * 3
    sched: Schedule = [[(0, 1, 100), (1, 3, 127)], [(0, 1, 60), (1, 3, 1)],
                       [(0, 1, 1), (1, 3, 1)], [(0, 1, 95), (1, 3, 11)], [(0, 1, 1)],
                       [(0, 1, 43)]]
    for a in (None, ape):
        raw, _ = drive(tri, seqs, sched, r, False, a)
        comp, state = drive(tri, seqs, sched, r, True, a)
        assert len(comp) == 2 + 1
        assert_same_entries(comp, raw, "r128")
        ref, ref_state = drive(TWIN, seqs, sched, r, True, a)
        _assert_entries_close(comp, ref, torch.float32)
        _assert_states_close(state, ref_state)
    _counters_clean()


@needs_interp
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_compact_single_steps(out_dtype: torch.dtype, plan: str) -> None:
    """Single steps from random states (static candidates with padding rows included): the
    compact kernels give the raw kernels' entries (bits) and the compact twin's (tolerance);
    their pseudo-rows are the twin's (float64 rounding), also on column slices of a wider
    GEMM output."""
    tri = _triton()
    for name, case in _step_cases():
        if name == "r128" and out_dtype == torch.bfloat16:
            continue                                  # (one ratio-128 mixed step is enough)
        cc = compact_case(case)
        for ape in (None, make_ape(case)):
            want = tri.compress_entries(*_entry_args(case, out_dtype), ape=ape)
            got = tri.compress_entries(*_entry_args(cc, out_dtype), ape=ape)
            assert torch.equal(got, want), name
            ref = twin.compress_entries(*_entry_args(cc, out_dtype), ape=ape)
            _assert_entries_close(dict(enumerate(got)), dict(enumerate(ref)), out_dtype)
            W = case.kv.shape[1]
            wide = torch.cat((case.kv, case.score, torch.full_like(case.kv, float("nan"))), 1)
            sliced = with_score(Case(**{**vars(cc), "kv": wide[:, :W]}), wide[:, W:2 * W])
            real = case.slots if case.valid is None else case.slots[:4]
            geo = (case.start_pos, case.cu_seqlens, case.slots, case.ratio, False)
            tw_state = (cc.state_kv.clone(), cc.state_score.clone())
            twin.compress_update_state(case.kv, case.score, *tw_state, *geo, ape=ape)
            for rows in (cc, sliced):
                st = (cc.state_kv.clone(), cc.state_score.clone())
                tri.compress_update_state(rows.kv, rows.score, *st, *geo, ape=ape)
                _assert_states_close(st, tw_state, real)
    _counters_clean()


@needs_interp
def test_interp_compact_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until COMPACT_KERNELS_VERIFIED (and without DSV4_UNVERIFIED_KERNELS=1) a compact state
    runs the twin (no launch); with the gate open the kernels run."""
    from dsv4.ops import triton_compress as tri

    monkeypatch.setattr(tri, "COMPACT_KERNELS_VERIFIED", False)
    case = compact_case(make_case(8, False, 16, *_STEPS[8], seed=3))
    calls: list[str] = []
    for kernel in ("_compress_entries_kernel", "_compress_entries_split_kernel",
                   "_compress_state_kernel"):
        real = getattr(tri, kernel)
        monkeypatch.setattr(tri, kernel, _Spy(real, kernel, calls))
    for env, launches in (("0", 0), ("1", 2)):
        monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", env)
        calls.clear()
        tri.compress_entries(*_entry_args(case, torch.float32))
        st = (case.state_kv.clone(), case.state_score.clone())
        tri.compress_update_state(case.kv, case.score, *st, case.start_pos, case.cu_seqlens,
                                  case.slots, 8, False)
        assert len(calls) == launches, (env, calls)
        want = (case.state_kv.clone(), case.state_score.clone())
        twin.compress_update_state(case.kv, case.score, *want, case.start_pos,
                                   case.cu_seqlens, case.slots, 8, False)
        _assert_states_close(st, want)


class _Spy:
    """A kernel whose launches (``kernel[grid](...)``) are recorded, then run."""

    def __init__(self, kernel, name: str, calls: list[str]) -> None:
        self.kernel, self.name, self.calls = kernel, name, calls

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.kernel[grid]


def _counters_clean() -> None:
    from dsv4.ops.triton_dense import splitk_counters

    assert not splitk_counters(torch.device("cpu"), 1).any(), "arrival counters left dirty"
