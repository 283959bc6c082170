"""The routing-plan kernel (``triton_moe.moe_plan``: one Triton launch) against its torch twin
``moe_plan_torch``, in the Triton interpreter: the same ``pairs`` / ``block_expert`` bit for bit.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import triton_moe as tri  # noqa: E402


def _ids(T: int, k: int, E: int, gen: torch.Generator, p_other: float,
         dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[T, k] expert ids in 0..E-1, each replaced with probability ``p_other`` by an id of no
    local expert (-1, E, or E + something: other expert-parallel shards)."""
    ids = torch.randint(0, E, (T, k), generator=gen)
    other = torch.randint(-1, 2, (T, k), generator=gen)
    other = torch.where(other == 1, E + torch.randint(0, 50, (T, k), generator=gen), other)
    other = torch.where(other == 0, torch.full_like(other, E), other)
    swap = torch.rand(T, k, generator=gen) < p_other
    return torch.where(swap, other, ids).to(dtype)


def _check_same(ids: torch.Tensor, E: int, BM: int, chunked: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    pairs, bexp = tri.moe_plan(ids, E, BM, chunked=chunked)
    pairs_ref, bexp_ref = tri.moe_plan_torch(ids, E, BM)
    assert pairs.dtype == torch.int32 and bexp.dtype == torch.int32
    assert pairs.shape == pairs_ref.shape and bexp.shape == bexp_ref.shape
    assert torch.equal(pairs, pairs_ref)
    assert torch.equal(bexp, bexp_ref)
    return pairs, bexp


# (T, k, E, BM, p_other): decode (1 token) to a prefill chunk of a few thousand pairs.
CASES = [(1, 1, 8, 16, 0.0), (1, 6, 256, 16, 0.0), (3, 2, 8, 32, 0.3), (16, 6, 256, 16, 0.1),
         (64, 6, 64, 32, 0.2), (100, 6, 16, 64, 0.05), (128, 6, 256, 16, 0.1),
         (500, 6, 48, 64, 0.0)]


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("T,k,E,BM,p_other", CASES)
def test_plan_kernel_equals_twin(T: int, k: int, E: int, BM: int, p_other: float,
                                 chunked: bool) -> None:
    """Both forms past decode sizes: one program per expert, and the chunked kernels."""
    gen = torch.Generator().manual_seed(T * 31 + E + BM)
    ids = _ids(T, k, E, gen, p_other)
    pairs, bexp = _check_same(ids, E, BM, chunked)
    # Independent checks of the contract (not only agreement with the twin).
    P = T * k
    assert bexp.shape[0] == -(-P // BM) + min(E, P)
    flat = ids.reshape(-1)
    real = pairs[pairs < P].long()
    assert torch.equal(real.sort().values,
                       torch.nonzero((flat >= 0) & (flat < E)).squeeze(1))
    assert bool((pairs <= P).all())


@pytest.mark.parametrize("T,k,E,BM,p_other", [(110, 6, 64, 16, 0.1), (37, 6, 384, 32, 0.0)])
def test_plan_kernel_many_chunks(monkeypatch: pytest.MonkeyPatch, T: int, k: int, E: int,
                                 BM: int, p_other: float) -> None:
    """The chunked kernels on chunks of 32 pairs instead of PLAN_CHUNK: ~20 and ~7 chunks, the
    last partial, every expert's pairs spread over several chunks; 384 experts."""
    from dsv4.ops import triton_moe_plan
    monkeypatch.setattr(triton_moe_plan, "PLAN_CHUNK", 32)
    gen = torch.Generator().manual_seed(T + E)
    _check_same(_ids(T, k, E, gen, p_other), E, BM, chunked=True)


@pytest.mark.parametrize("chunked", [False, True])
def test_plan_kernel_int32_ids_and_skewed_routing(chunked: bool) -> None:
    """int32 ids; every pair on two experts (blocks of one expert span many BM rows)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.where(torch.rand(300, 4, generator=gen) < 0.5, 3, 60).to(torch.int32)
    ids[5, 1] = -1
    _, bexp = _check_same(ids, 64, 16, chunked)
    used = bexp[bexp < 64]
    assert set(used.tolist()) == {3, 60}
    assert int((used == 3).sum()) == -(-int((ids == 3).sum()) // 16)


def test_plan_kernel_no_local_pairs_and_empty() -> None:
    """All ids on other shards: every block unused, every row padding; P = 0: empty plan."""
    ids = torch.full((5, 3), -1, dtype=torch.int64)
    ids[2] = 9
    pairs, bexp = _check_same(ids, 8, 16)
    assert bool((bexp == 8).all()) and bool((pairs == 15).all())
    pairs, bexp = tri.moe_plan(torch.zeros(0, 6, dtype=torch.int64), 8, 16)
    assert pairs.numel() == 0 and bexp.numel() == 0


def test_plan_kernel_is_deterministic_and_rejects_bad_block() -> None:
    gen = torch.Generator().manual_seed(3)
    ids = _ids(40, 6, 32, gen, 0.1)
    a = tri.moe_plan(ids, 32, 16)
    b = tri.moe_plan(ids, 32, 16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="BM"):
        tri.moe_plan(ids, 32, 24)


# The one-program kernel of P <= SMALL_PLAN_MAX_PAIRS pairs: every P from 1 to the limit at
# decode shapes, repeated ids within and across tokens, skipped ids, 16- and 32-row blocks.
@pytest.mark.parametrize("P,E,BM,p_other", [(1, 256, 16, 0.0), (6, 256, 16, 0.0),
                                            (7, 4, 16, 0.3), (12, 256, 16, 0.2),
                                            (33, 8, 32, 0.1), (48, 3, 16, 0.0),
                                            (63, 256, 16, 0.5), (64, 16, 16, 0.1),
                                            (64, 256, 32, 1.0)])
def test_small_plan_kernel_equals_twin(P: int, E: int, BM: int, p_other: float) -> None:
    from dsv4.ops.triton_moe_plan import SMALL_PLAN_MAX_PAIRS
    assert P <= SMALL_PLAN_MAX_PAIRS
    gen = torch.Generator().manual_seed(P * 7 + E + BM)
    ids = _ids(1, P, E, gen, p_other).reshape(1, P)
    _check_same(ids, E, BM)
    # Shaped as tokens x picks (the same flat order).
    if P % 2 == 0:
        _check_same(ids.reshape(P // 2, 2), E, BM)


@pytest.mark.parametrize("T,k,E,fmt,quant", [(1, 6, 256, 1, True), (3, 2, 8, 1, False),
                                             (5, 4, 6, 0, False), (2, 6, 16, 2, True),
                                             (10, 6, 64, 1, True)])
def test_plan_prep_fused_equals_plan_then_prep(T: int, k: int, E: int, fmt: int,
                                               quant: bool) -> None:
    """moe_plan_prep (decode: the plan and the activation prep in one launch) gives the twin's
    plan and, on every real pair's row, the bytes moe_prep writes after moe_plan."""
    gen = torch.Generator().manual_seed(T * 13 + k + E)
    ids = _ids(T, k, E, gen, 0.2)
    x = (torch.randn(T, 256, generator=gen) * 3).to(torch.bfloat16)
    BM, BK = 16, 128
    pairs, bexp, xs = tri.moe_plan_prep(x, ids, E, BM, fmt, quant, BK)
    pairs_ref, bexp_ref = tri.moe_plan_torch(ids, E, BM)
    assert torch.equal(pairs, pairs_ref) and torch.equal(bexp, bexp_ref)
    ref = torch.zeros_like(xs)
    tri.moe_prep(x, pairs, bexp, ref, T * k, E, k, True, fmt, quant, BM, BK)
    real = pairs < T * k
    assert torch.equal(xs[real], ref[real])
    with pytest.raises(ValueError, match="moe_plan_prep"):
        tri.moe_plan_prep(x, torch.zeros(T, 65 // T + 1, dtype=torch.long), E, BM, fmt, quant,
                          BK)
