"""mHC ops and modules (spec §3.4, §3.10): against a float64 transcription of the spec and
against transformers' own DeepSeek-V4 hyper-connection modules with shared random weights."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.mhc import HyperConnection, HyperHead, expand_streams
from dsv4.ops import get_ops
from dsv4.ops import torch_dense as td
from test_parity_util import hf_config, hf_modeling, small_config

N_HC, D = 4, 32


def _random_hc(seed: int, rows: int, n: int = N_HC, d: int = D, scale_len: int = 3):
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(rows, n * d, generator=g) * 0.2
    base = torch.randn(rows, generator=g) * 0.5
    scale = torch.rand(scale_len, generator=g) + 0.5
    return fn, base, scale


def _spec_hc_pre(x, fn, scale, base, norm_eps, hc_eps, iters):
    """Float64, loop-based transcription of spec §3.4 steps 1-5 (independent of the op)."""
    x = x.double()
    T, n, d = x.shape
    flat = x.reshape(T, n * d)
    r = 1.0 / torch.sqrt((flat * flat).mean(-1, keepdim=True) + norm_eps)
    mixes = (flat @ fn.double().T) * r
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(mixes[:, :n] * s[0] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n:2 * n] * s[1] + b[n:2 * n])
    C = (mixes[:, 2 * n:] * s[2] + b[2 * n:]).reshape(T, n, n)
    out = torch.empty_like(C)
    for t in range(T):
        c = C[t].clone()
        c = torch.exp(c - c.max(dim=1, keepdim=True).values)
        c = c / c.sum(dim=1, keepdim=True) + hc_eps
        for k in range(n):  # column normalization: sum over j
            c[:, k] = c[:, k] / (c[:, k].sum() + hc_eps)
        for _ in range(iters - 1):
            for j in range(n):
                c[j, :] = c[j, :] / (c[j, :].sum() + hc_eps)
            for k in range(n):
                c[:, k] = c[:, k] / (c[:, k].sum() + hc_eps)
        out[t] = c
    y = sum(pre[:, j, None] * x[:, j] for j in range(n))
    return y, post, out


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_hc_pre_matches_spec_transcription(iters: int) -> None:
    fn, base, scale = _random_hc(0, (2 + N_HC) * N_HC)
    x = torch.randn(9, N_HC, D, generator=torch.Generator().manual_seed(1))
    y, post, comb = td.hc_pre(x, fn, scale, base, 1e-6, 1e-6, iters)
    y_ref, post_ref, comb_ref = _spec_hc_pre(x, fn, scale, base, 1e-6, 1e-6, iters)
    assert y.dtype == x.dtype and post.dtype == torch.float32 and comb.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post.double(), post_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comb.double(), comb_ref, rtol=1e-5, atol=1e-6)


def test_sinkhorn_is_close_to_doubly_stochastic_and_not_symmetric() -> None:
    fn, base, scale = _random_hc(2, (2 + N_HC) * N_HC)
    x = torch.randn(5, N_HC, D, generator=torch.Generator().manual_seed(2))
    _, _, comb = td.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    _, _, comb1 = td.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 1)
    # The last step normalizes columns (exact); rows converge with the iterations.
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, N_HC), atol=1e-4, rtol=0)
    row_err = (comb.sum(-1) - 1).abs().max()
    assert row_err < 0.1 and row_err < (comb1.sum(-1) - 1).abs().max()
    assert not torch.allclose(comb, comb.transpose(-1, -2), atol=1e-3)


def test_hc_post_direction_and_dtype() -> None:
    """new_k = post_k·out + Σ_j comb[j,k]·x_j, math in fp32, result in x_res.dtype."""
    g = torch.Generator().manual_seed(3)
    T = 6
    out = torch.randn(T, D, generator=g).bfloat16()
    x_res = torch.randn(T, N_HC, D, generator=g).bfloat16()
    post = torch.rand(T, N_HC, generator=g) * 2
    comb = torch.rand(T, N_HC, N_HC, generator=g)
    y = td.hc_post(out, x_res, post, comb)
    ref = torch.empty(T, N_HC, D, dtype=torch.float64)
    for k in range(N_HC):
        ref[:, k] = post[:, k, None].double() * out.double()
        for j in range(N_HC):
            ref[:, k] += comb[:, j, k, None].double() * x_res[:, j].double()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref.bfloat16(), rtol=0, atol=0.02)
    # comb^T, not comb: with a non-symmetric comb the transposed mix must differ.
    y_wrong = td.hc_post(out, x_res, post, comb.transpose(-1, -2))
    assert not torch.equal(y, y_wrong)


def test_hc_head_matches_spec() -> None:
    fn, base, scale = _random_hc(4, N_HC, scale_len=1)
    x = torch.randn(7, N_HC, D)
    y = td.hc_head(x, fn, scale, base, 1e-6, 1e-6)
    flat = x.double().reshape(7, -1)
    r = 1 / torch.sqrt((flat ** 2).mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid((flat @ fn.double().T) * r * scale.double() + base.double()) + 1e-6
    ref = (pre[..., None] * x.double()).sum(1)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named() -> None:
    fn, base, scale = _random_hc(0, (2 + N_HC) * N_HC)
    with pytest.raises(ValueError, match="hc_pre: fn"):
        td.hc_pre(torch.randn(3, N_HC, D + 1), fn, scale, base, 1e-6, 1e-6, 2)
    with pytest.raises(ValueError, match="hc_head: x"):
        td.hc_head(torch.randn(3, D), fn[:N_HC], scale[:1], base[:N_HC], 1e-6, 1e-6)
    with pytest.raises(ValueError, match="hc_post"):
        td.hc_post(torch.randn(3, D + 1), torch.randn(3, N_HC, D), torch.rand(3, N_HC),
                   torch.rand(3, N_HC, N_HC))


def test_official_names_of_the_hc_modules() -> None:
    cfg = small_config()
    ops = get_ops("torch")
    assert HyperConnection(cfg, ops).official_names("layers.2.hc_ffn.") == {
        "layers.2.hc_ffn_fn": "fn", "layers.2.hc_ffn_base": "base",
        "layers.2.hc_ffn_scale": "scale"}
    assert set(HyperHead(cfg, ops).official_names("hc_head.")) == {
        "hc_head_fn", "hc_head_base", "hc_head_scale"}


def test_modules_match_transformers_hyper_connection() -> None:
    """Our HyperConnection / HyperHead against transformers' with the same random weights."""
    mod = hf_modeling()
    cfg = small_config(hidden_size=D)
    hcfg = hf_config(cfg)
    ops = get_ops("torch")
    ours, theirs = HyperConnection(cfg, ops), mod.DeepseekV4HyperConnection(hcfg).float()
    fn, base, scale = _random_hc(5, (2 + N_HC) * N_HC)
    head, head_hf = HyperHead(cfg, ops), mod.DeepseekV4HyperHead(hcfg).float()
    hfn, hbase, hscale = _random_hc(6, N_HC, scale_len=1)
    with torch.no_grad():
        for m, names, vals in ((ours, ("fn", "base", "scale"), (fn, base, scale)),
                               (theirs, ("fn", "base", "scale"), (fn, base, scale)),
                               (head, ("fn", "base", "scale"), (hfn, hbase, hscale)),
                               (head_hf, ("hc_fn", "hc_base", "hc_scale"), (hfn, hbase, hscale))):
            for name, v in zip(names, vals):
                getattr(m, name).copy_(v)
    h = torch.randn(11, D, generator=torch.Generator().manual_seed(7))
    x = expand_streams(h, N_HC) + 0.3 * torch.randn(11, N_HC, D)
    with torch.no_grad():
        y, post, comb = ours.pre(x)
        post_hf, comb_hf, y_hf = theirs(x[None])
        torch.testing.assert_close(y, y_hf[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(post, post_hf[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comb, comb_hf[0], rtol=1e-5, atol=1e-6)
        out = torch.randn(11, D)
        new = ours.post(out, x, post, comb)
        new_hf = post_hf.unsqueeze(-1) * out[None].unsqueeze(-2) + torch.matmul(
            comb_hf.transpose(-1, -2), x[None])
        torch.testing.assert_close(new, new_hf[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head(x), head_hf(x[None])[0], rtol=1e-5, atol=1e-5)


def test_bf16_hc_post_mixes_in_fp32_like_the_reference() -> None:
    """Spec §6.10: DeepSeek's reference mixes post/comb with the streams in fp32 and casts once;
    transformers casts post/comb to the activation dtype first. We follow the reference: in bf16
    our result is the correctly rounded fp32-exact value almost everywhere, the other is not."""
    g = torch.Generator().manual_seed(8)
    T = 64
    out = (torch.randn(T, D, generator=g) * 4).bfloat16()
    x_res = (torch.randn(T, N_HC, D, generator=g) * 4).bfloat16()
    post = torch.rand(T, N_HC, generator=g) * 2
    comb = torch.softmax(torch.randn(T, N_HC, N_HC, generator=g), dim=-1)
    truth = (post.double().unsqueeze(-1) * out.double().unsqueeze(-2)
             + torch.matmul(comb.double().transpose(-1, -2), x_res.double()))
    ours = td.hc_post(out, x_res, post, comb)
    # transformers' DeepseekV4DecoderLayer: post.to(dtype) * out + comb.to(dtype)^T @ x_res.
    hf_style = (post.bfloat16().unsqueeze(-1) * out.unsqueeze(-2)
                + torch.matmul(comb.bfloat16().transpose(-1, -2), x_res))
    err_ours = (ours.double() - truth).abs()
    err_hf = (hf_style.double() - truth).abs()
    assert (ours == truth.bfloat16()).float().mean() > 0.99
    assert err_ours.max() < err_hf.max() and err_ours.mean() < err_hf.mean()
