"""The Triton parts of the decode experts on FP8 wgmma (dsv4.ops.gluon_moe_decode) in the
interpreter: the token rows' e4m3 codes and the act codes between the two GEMMs equal the torch
reference (formats.act_quant of the twin's values, laid out in the MMA column order) bit for
bit; padding rows and unused blocks stay unwritten.  (The Gluon GEMM itself has no interpreter:
tests/kernels/sm90_cases.py compiles it for sm_90, tests/kernels/test_moe_wgmma_gpu.py runs it.)

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4 import formats  # noqa: E402
from dsv4.ops import gluon_moe_decode as gm  # noqa: E402
from dsv4.ops import triton_moe as tm  # noqa: E402


def _reference_codes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in the MMA column order, scales) of rows v [R, K] by formats.act_quant."""
    q, s = formats.act_quant(v.float(), 128)
    codes = q.view(torch.uint8)
    perm = torch.tensor([gm.mma_column(k) for k in range(v.shape[1])])
    out = torch.empty_like(codes)
    out[:, perm] = codes
    return out, s.float()


def test_mma_column_is_a_permutation_within_groups() -> None:
    cols = [gm.mma_column(k) for k in range(64)]
    assert sorted(cols) == list(range(64))
    assert all(c // 32 == k // 32 for k, c in enumerate(cols))
    # Column 16h + 4q + i holds natural 8q + 2i + h.
    assert cols[8 * 1 + 2 * 3 + 1] == 16 + 4 * 1 + 3


def test_pairs_fit_the_products_columns() -> None:
    # One token (8 columns): its top-6, even with one expert picked twice.
    assert gm.pairs_fit(1, 6) and gm.pairs_fit(1, 8) and not gm.pairs_fit(1, 9)
    assert not gm.pairs_fit(2, 12)          # 8 columns could meet a block of 9..12 pairs
    # From 9 tokens the products are as wide as the plan's 16-row blocks: any number of pairs.
    assert gm.mma_columns(9) == gm.PLAN_BM
    assert gm.pairs_fit(16, 96) and gm.pairs_fit(64, 384)
    assert not gm.pairs_fit(64, 0)


@pytest.mark.parametrize("T", [1, 3])
def test_x_codes_match_act_quant(T: int) -> None:
    gen = torch.Generator().manual_seed(T)
    x = (torch.randn(T, 256, generator=gen) * torch.rand(T, 256, generator=gen) * 4).bfloat16()
    x[0, :128] = 0          # an all-zero block: the amax floor
    codes, scale = gm.x_codes(x)
    ref_codes, ref_scale = _reference_codes(x)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scale, ref_scale)


def test_act_codes_match_the_twin_epilogue() -> None:
    gen = torch.Generator().manual_seed(7)
    T, k, E, inter, BM = 3, 2, 4, 256, 16
    ids = torch.tensor([[0, 2], [2, 3], [0, 1]])
    pairs, block_expert = tm.moe_plan(ids, E, BM)
    R = pairs.numel()
    h = torch.randn(2, R, inter, generator=gen) * 3
    wts = torch.rand(T * k, generator=gen) + 0.1
    limit = 2.5
    codes = gm.act_codes(h, pairs, block_expert, wts, T * k, E, BM, limit)
    sentinel_rows = []
    for r in range(R):
        p = int(pairs[r])
        if p >= T * k or int(block_expert[r // BM]) >= E:
            sentinel_rows.append(r)
            continue
        g = h[0, r].bfloat16().float()
        u = h[1, r].bfloat16().float().clamp(-limit, limit)
        g = g.clamp(max=limit)
        a = (g * torch.sigmoid(g) * u * wts[p]).bfloat16().float()
        ref_c, ref_s = _reference_codes(a[None])
        assert torch.equal(codes[0][r], ref_c[0]), r
        assert torch.equal(codes[1][r], ref_s[0]), r
    assert sentinel_rows      # the plan has padding rows, which were skipped


def test_x_codes_refuses_ragged_widths() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        gm.x_codes(torch.zeros(2, 200, dtype=torch.bfloat16))
