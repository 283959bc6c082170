"""The fused mHC post + next pre (``hc_post_pre``) kernel against its torch twin, in the Triton
interpreter (run by tests/kernels/test_interpreter.py in a child with TRITON_INTERPRET=1).

Tolerances are those of the unfused hc tests in test_dense.py, for the same reasons:
* x_new, fp32 streams: rel 1e-6 (the kernel adds post·out and the n comb terms in its own order;
  fp32 rounding only);
* x_new, bf16 streams: rel 4e-3 (an fp32 ordering difference can move a value across a bf16
  rounding boundary: one bf16 ulp, 2^-8 relative, on a few elements);
* y / post / comb: rel 1e-5 against the twin's hc_pre of the kernel's own x_new (fp32 split-K
  sums in another order); y in bf16: 4e-3 (one rounding of the output).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_mhc  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

EPS = dict(norm_eps=1e-6, hc_eps=1e-6, iters=20)


def _inputs(T: int, n: int, D: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    out = torch.randn(T, D, generator=gen).to(dtype)
    x_res = torch.randn(T, n, D, generator=gen).to(dtype)
    post = torch.rand(T, n, generator=gen) * 2
    comb = torch.rand(T, n, n, generator=gen)  # not symmetric: the direction is checked
    fn = torch.randn(rows, n * D, generator=gen) * 0.1
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(rows, generator=gen) * 0.5
    return out, x_res, post, comb, fn, scale, base


# T = 1 (one token, many D splits), 19 (two token tiles, masked rows); D 96 / 80 not powers of
# two (masked chunks); n = 2 checks the stream count is not hard-wired to 4.
@pytest.mark.parametrize("T,n,D", [(1, 4, 96), (19, 4, 80), (3, 2, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_pre_matches_twin(T: int, n: int, D: int, dtype: torch.dtype) -> None:
    args = _inputs(T, n, D, dtype, seed=T * 7 + n)
    x_new, y, post, comb = triton_mhc.hc_post_pre(*args, **EPS)
    assert x_new.shape == (T, n, D) and x_new.dtype == dtype
    assert y.shape == (T, D) and y.dtype == dtype
    assert post.shape == (T, n) and comb.shape == (T, n, n)
    x_ref = ref.hc_post(*args[:4])
    assert rel_err(x_new.float(), x_ref.float()) < (1e-6 if dtype == torch.float32 else 4e-3)
    # The pre must read the streams as stored: compare with the twin's pre of x_new itself.
    y_r, post_r, comb_r = ref.hc_pre(x_new, *args[4:], **EPS)
    assert rel_err(y.float(), y_r.float()) < (1e-5 if dtype == torch.float32 else 4e-3)
    assert rel_err(post, post_r) < 1e-5
    assert rel_err(comb, comb_r) < 1e-5
    # And the whole op against the composed twin.
    _, y_c, post_c, comb_c = ref.hc_post_pre(*args, **EPS)
    assert rel_err(post, post_c) < 1e-5 and rel_err(comb, comb_c) < 1e-5


@pytest.mark.parametrize("T,n,D", [(19, 4, 80), (3, 2, 40), (2, 1, 24)])
def test_gates_once_gives_the_same_bits(T: int, n: int, D: int) -> None:
    """A plan loading the post / comb gates once before the D loop computes every value the
    same way as the plan loading them each chunk: all four outputs bit for bit."""
    args = _inputs(T, n, D, torch.bfloat16, seed=T + n)
    plan = triton_mhc.HcPlan(16, 16, 4, 2, per_sm=1, mix="bf16x3")
    once = triton_mhc.HcPlan(16, 16, 4, 2, per_sm=1, mix="bf16x3", gates_once=True)
    a = triton_mhc.hc_post_pre_with_plan(*args, **EPS, plan=plan)
    b = triton_mhc.hc_post_pre_with_plan(*args, **EPS, plan=once)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert rel_err(a[0].float(), ref.hc_post(*args[:4]).float()) < 4e-3


def test_hc_post_pre_equals_unfused_kernels() -> None:
    """Same result as the two unfused kernels (hc_post then hc_pre) in the interpreter."""
    args = _inputs(5, 4, 64, torch.bfloat16, seed=3)
    x_new, y, post, comb = triton_mhc.hc_post_pre(*args, **EPS)
    x2 = triton_mhc.hc_post(*args[:4])
    y2, post2, comb2 = triton_mhc.hc_pre(x2, *args[4:], **EPS)
    assert rel_err(x_new.float(), x2.float()) < 4e-3
    assert rel_err(y.float(), y2.float()) < 4e-3
    assert rel_err(post, post2) < 1e-5 and rel_err(comb, comb2) < 1e-5


def test_hc_post_pre_rejects_bad_shapes() -> None:
    out, x_res, post, comb, fn, scale, base = _inputs(2, 4, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="fn"):
        triton_mhc.hc_post_pre(out, x_res, post, comb, fn[:, :64], scale, base, **EPS)
    with pytest.raises(ValueError, match="x_res"):
        triton_mhc.hc_post_pre(out[:, :16], x_res, post, comb, fn, scale, base, **EPS)
    with pytest.raises(ValueError, match="comb"):
        triton_mhc.hc_post_pre(out, x_res, post, comb[:, :2], fn, scale, base, **EPS)
    with pytest.raises(ValueError, match="iters"):
        triton_mhc.hc_post_pre(out, x_res, post, comb, fn, scale, base, 1e-6, 1e-6, 0)
