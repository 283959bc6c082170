"""The Engram module (spec §4.7 "Engram module"): gate math against a spec-literal oracle,
dead tokens, and that a forward dequantizes only the rows it asks for."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.model.engram import Engram, gather_engram_rows


def _fill(eng: Engram, gen: torch.Generator) -> None:
    rows, hd = eng.embed.weight.shape
    with torch.no_grad():
        eng.embed.weight.copy_((torch.randn(rows, hd, generator=gen) * 4).to(torch.float8_e4m3fn))
        eng.embed.scale.copy_(torch.randint(120, 130, (rows, hd // 32), generator=gen,
                                            dtype=torch.uint8).view(torch.float8_e8m0fnu))
        eng.wkv.load_weight(torch.randn(eng.wkv.out_features, eng.wkv.in_features, generator=gen)
                            * 0.02)
        eng.q_weight.copy_(torch.randn(eng.q_weight.shape, generator=gen))
        eng.k_weight.copy_(torch.randn(eng.k_weight.shape, generator=gen))


def _oracle(eng: Engram, x: torch.Tensor, row_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Steps 1–6 per token and stream, from the spec text (fp64 for clarity)."""
    D, n = eng.dim, eng.hc_mult
    w8 = eng.embed.weight.to(torch.float64)
    sb = eng.embed.scale.view(torch.uint8).to(torch.float64)
    W = eng.wkv.weight.to(torch.float64)
    out = x.clone().to(torch.float64)
    for t in range(x.shape[0]):
        e = torch.cat([w8[r] * torch.repeat_interleave(2.0 ** (sb[r] - 127), 32)
                       for r in row_ids[t].tolist()])
        kv = W @ e
        key, value = kv[: n * D].view(n, D), kv[n * D:]
        for j in range(n):
            h = x[t, j].to(torch.float64)
            wqk = eng.q_weight[j].double() * eng.k_weight[j].double()
            rstd = 1 / math.sqrt(h.square().mean() + eng.eps) / math.sqrt(key[j].square().mean()
                                                                          + eng.eps)
            dot = float((h * wqk * key[j]).sum()) * rstd / math.sqrt(D)
            root = math.sqrt(max(abs(dot), 1e-6))
            gate = 1 / (1 + math.exp(-(root if dot >= 0 else -root)))
            if not mask[t]:
                gate = 0.0
            out[t, j] = h + gate * value
    return out


def test_forward_matches_spec_oracle(tiny_v41_cfg) -> None:
    cfg = tiny_v41_cfg
    gen = torch.Generator().manual_seed(0)
    eng = Engram(cfg, 3, dtype=torch.float32)
    _fill(eng, gen)
    T = 5
    x = torch.randn(T, cfg.hc_mult, cfg.dim, generator=gen)
    rows = torch.randint(0, eng.embed.num_rows, (T, eng.n_cols), generator=gen)
    mask = torch.tensor([True, True, False, True, True])
    y = eng(x, rows, mask)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), _oracle(eng, x, rows, mask), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[2], x[2])  # an image token passes through untouched
    assert not torch.allclose(y[0], x[0])
    # no mask = every token is text
    torch.testing.assert_close(eng(x, rows), eng(x, rows, torch.ones(T, dtype=torch.bool)))


def test_forward_bf16_stream(tiny_v41_cfg) -> None:
    cfg = tiny_v41_cfg
    gen = torch.Generator().manual_seed(1)
    eng = Engram(cfg, 1, dtype=torch.bfloat16)
    _fill(eng, gen)
    x = torch.randn(3, cfg.hc_mult, cfg.dim, generator=gen).to(torch.bfloat16)
    rows = torch.randint(0, eng.embed.num_rows, (3, eng.n_cols), generator=gen)
    y = eng(x, rows, torch.ones(3, dtype=torch.bool))
    assert y.dtype == torch.bfloat16
    ref = _oracle(eng, x, rows, torch.ones(3, dtype=torch.bool))
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)


def test_gather_is_exact() -> None:
    w = torch.tensor([[0.5, -1.25] * 16, [448.0, -0.001953125] * 16]).to(torch.float8_e4m3fn)
    s = torch.tensor([[127], [120]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = gather_engram_rows(w, s, torch.tensor([[1, 0, 1]]), torch.float32)
    assert got.shape == (1, 3, 32)
    assert got[0, 1, :2].tolist() == [0.5, -1.25]
    assert got[0, 0, :2].tolist() == [448.0 * 2.0 ** -7, -0.001953125 * 2.0 ** -7]


class _VirtualTable(torch.Tensor):
    """A table of billions of rows without storage: only ``index_select`` on dim 0 is allowed
    (rows are generated from their ids); any other use of the whole table fails."""

    @staticmethod
    def __new__(cls, rows: int, cols: int, dtype: torch.dtype, scale: bool):
        t = torch.Tensor._make_wrapper_subclass(cls, (rows, cols), dtype=dtype, device="cpu")
        t.is_scale = scale
        t.requested = []
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_select.default and isinstance(args[0], _VirtualTable):
            table, dim, index = args
            assert dim == 0
            table.requested.append(index.clone())
            cols = table.shape[1]
            if table.is_scale:  # scale byte 126..128 by row id
                return (126 + index[:, None] % 3 + torch.zeros(cols, dtype=torch.int64)).to(
                    torch.uint8).view(torch.float8_e8m0fnu)
            vals = ((index[:, None] * 7 + torch.arange(cols)) % 15 - 7).float() * 0.25
            return vals.to(torch.float8_e4m3fn)
        raise AssertionError(f"the whole Engram table was touched by {func}")


def test_forward_touches_only_requested_rows(tiny_v41_cfg) -> None:
    cfg = tiny_v41_cfg
    gen = torch.Generator().manual_seed(2)
    eng = Engram(cfg, 1, dtype=torch.float32)
    _fill(eng, gen)
    huge = 3_000_000_000
    weight = _VirtualTable(huge, 32, torch.float8_e4m3fn, scale=False)
    scale = _VirtualTable(huge, 1, torch.float8_e8m0fnu, scale=True)
    del eng.embed.weight, eng.embed.scale
    eng.embed.weight, eng.embed.scale = weight, scale
    T = 3
    rows = torch.randint(0, huge, (T, eng.n_cols), generator=gen)
    x = torch.randn(T, cfg.hc_mult, cfg.dim, generator=gen)
    y = eng(x, rows, torch.ones(T, dtype=torch.bool))
    assert torch.isfinite(y).all() and not torch.equal(y, x)
    assert [r.tolist() for r in weight.requested] == [rows.reshape(-1).tolist()]
    assert [r.tolist() for r in scale.requested] == [rows.reshape(-1).tolist()]
    # the looked-up values are the generated rows times their scale
    e = gather_engram_rows(weight, scale, rows[:1, :2], torch.float32)
    r0 = int(rows[0, 0])
    expect = [((r0 * 7 + c) % 15 - 7) * 0.25 * 2.0 ** (r0 % 3 - 1) for c in range(32)]
    assert e[0, 0].tolist() == expect


def test_forward_shape_errors(tiny_v41_cfg) -> None:
    eng = Engram(tiny_v41_cfg, 1, dtype=torch.float32)
    x = torch.zeros(2, 4, 64)
    with pytest.raises(ValueError, match="row_ids"):
        eng(x, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="x has shape"):
        eng(torch.zeros(2, 3, 64), torch.zeros(2, eng.n_cols, dtype=torch.int64))
    with pytest.raises(ValueError, match="token_mask"):
        eng(x, torch.zeros(2, eng.n_cols, dtype=torch.int64), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="engram_layer_ids"):
        Engram(tiny_v41_cfg, 2)


def test_parameter_names(tiny_v41_cfg) -> None:
    eng = Engram(tiny_v41_cfg, 3, dtype=torch.bfloat16)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in eng.state_dict().items()}
    cfg = tiny_v41_cfg
    assert shapes == {
        "embed.weight": ((cfg.engram_num_embeddings[1], 32), torch.float8_e4m3fn),
        "embed.scale": ((cfg.engram_num_embeddings[1], 1), torch.float8_e8m0fnu),
        "wkv.weight": ((cfg.dim * 5, 2 * 2 * 32), torch.bfloat16),
        "q_weight": ((4, cfg.dim), torch.bfloat16),
        "k_weight": ((4, cfg.dim), torch.bfloat16),
    }


def test_load_table_from_quant_weight_keeps_format(tiny_v41_cfg) -> None:
    from dsv4.formats import QuantWeight, dequant_mxfp8, quant_mxfp8

    eng = Engram(tiny_v41_cfg, 1, dtype=torch.float32)
    rows = eng.embed.num_rows
    dense = torch.randn(rows, 32)
    w8, s8 = quant_mxfp8(dense)
    eng.embed.load_weight(QuantWeight(w8, s8, "mxfp8", 32, (rows, 32)))
    assert eng.embed.weight.dtype == torch.float8_e4m3fn
    ids = torch.tensor([[0, rows - 1, 7]])
    assert torch.equal(eng.embed.lookup(ids, torch.float32)[0],
                       dequant_mxfp8(w8, s8, torch.float32)[ids[0]])
    with pytest.raises(ValueError, match="mxfp8"):
        eng.embed.load_weight(dense)
    with pytest.raises(ValueError, match="shape"):
        eng.embed.load_weight(QuantWeight(w8[:-1], s8[:-1], "mxfp8", 32, (rows - 1, 32)))


def test_unquantized_checkpoint_has_dense_table(tiny_v41_bf16_cfg) -> None:
    cfg = tiny_v41_bf16_cfg
    eng = Engram(cfg, 1, dtype=torch.float32)
    assert eng.embed.scale is None and "embed.scale" not in eng.state_dict()
    table = torch.randn(eng.embed.num_rows, 32)
    eng.embed.load_weight(table)
    ids = torch.tensor([[3, 9], [0, 1]])
    assert torch.equal(eng.embed.lookup(ids, torch.float32), table[ids])
    with pytest.raises(ValueError, match="dense tensor"):
        eng.embed.load_weight(table[:5])


def test_official_numerics_quantize_wkv_input_only_slightly(tiny_v41_cfg) -> None:
    cfg = tiny_v41_cfg
    gen = torch.Generator().manual_seed(5)
    a = Engram(cfg, 1, numerics="bf16", dtype=torch.float32)
    b = Engram(cfg, 1, numerics="official", dtype=torch.float32)
    _fill(a, gen)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, cfg.hc_mult, cfg.dim, generator=gen)
    rows = torch.randint(0, a.embed.num_rows, (4, a.n_cols), generator=gen)
    ya, yb = a(x, rows), b(x, rows)
    # the looked-up rows are e4m3 × 2^k already: fp8 re-quantization of them is nearly lossless
    torch.testing.assert_close(ya, yb, rtol=1e-2, atol=1e-2)
