"""The Triton attention kernels reading cache records in place (kv_cache_dtype "fp8") against
their torch twins over the same records, in the Triton interpreter (TRITON_INTERPRET=1; see
tests/kernels/test_interpreter.py).

The kernel dequantizes inside: on records it must give exactly what it gives on the dequantized
rows (same tiles, same order), and agree with the torch twin to fp32 rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.cache import formats as cf  # noqa: E402
from dsv4.ops import torch_attn as ref  # noqa: E402
from dsv4.ops import triton_attn as tri  # noqa: E402
from interp_helpers import random_indices, rel_err  # noqa: E402


def _records(fmt: cf.RecordFormat, n: int, gen: torch.Generator) -> cf.PackedRows:
    """n random rows over a spread of magnitudes, packed as ``fmt``."""
    x = torch.randn(n, fmt.dim, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    return cf.PackedRows(fmt.pack(x), fmt)


# V4: window and compressed pools both hold the 584-byte layout (here at head_dim 128);
# V4.1: e4m3 window records and e2m1 compressed records.
LAYOUTS = {
    "v4": (cf.v4_kv_record(128, 64), cf.v4_kv_record(128, 64)),
    "v41": (cf.fp8_record(128, 32), cf.fp4_record(128, 16, "e4m3")),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attn_reads_records_in_place(layout: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(layout) + (dtype == torch.bfloat16))
    fmt_a, fmt_b = LAYOUTS[layout]
    T, H, d = 3, 20, 128
    q = torch.randn(T, H, d, generator=gen).to(dtype)
    kv_a, kv_b = _records(fmt_a, 37, gen), _records(fmt_b, 11, gen)
    idx_a = random_indices(T, 70, 37, gen, 0.3)   # a partial second block of 64
    idx_a[0] = -1                           # a token with nothing in source a
    idx_b = random_indices(T, 9, 11, gen, 0.2).long()
    sink = torch.randn(H, generator=gen)
    p_dtype = torch.bfloat16 if dtype == torch.bfloat16 else None
    o = tri.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, d ** -0.5, p_dtype=p_dtype)
    assert o.shape == (T, H, d) and o.dtype == dtype and torch.isfinite(o.float()).all()
    rows_a, rows_b = fmt_a.unpack(kv_a.data, dtype), fmt_b.unpack(kv_b.data, dtype)
    o_rows = tri.sparse_attn(q, rows_a, idx_a, rows_b, idx_b, sink, d ** -0.5, p_dtype=p_dtype)
    assert torch.equal(o, o_rows)
    o_ref = ref.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, d ** -0.5, p_dtype=p_dtype)
    assert rel_err(o.float(), o_ref.float()) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("cfg", [tri.AttnConfig(BH=16, BN=16, split_kv=3),
                                 tri.AttnConfig(BH=16, BN=32, split_kv=2, dv=32)])
def test_record_plans_agree(cfg: tri.AttnConfig) -> None:
    """Split-KV and split value columns re-read the records (the value slice): same result."""
    gen = torch.Generator().manual_seed(cfg.split_kv)
    T, H, d = 2, 20, 128
    fmt = cf.v4_kv_record(128, 64)
    q = torch.randn(T, H, d, generator=gen)
    kv_a, kv_b = _records(fmt, 30, gen), _records(fmt, 25, gen)
    idx_a, idx_b = random_indices(T, 40, 30, gen, 0.25), random_indices(T, 7, 25, gen, 0.25)
    sink = torch.randn(H, generator=gen)
    o = tri.sparse_attn_with_config(q, kv_a, idx_a, kv_b, idx_b, sink, 0.1, None, cfg)
    o_ref = ref.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, 0.1)
    assert rel_err(o, o_ref) < 1e-5


def test_record_source_errors() -> None:
    fmt = cf.v4_kv_record(128, 64)
    q = torch.randn(2, 16, 64)
    kv = cf.PackedRows(fmt.pack(torch.randn(4, 128)), fmt)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_a records hold 128 channels; expected 64"):
        tri.sparse_attn(q, kv, idx, None, None, torch.zeros(16), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_read_fp4_keys_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    T, h, dI, Nk, L = 4, 8, 64, 50, 150
    fmt = cf.fp4_record(dI, 32, "e8m0")
    q = torch.randn(T, h, dI, generator=gen).to(dtype)
    w = torch.randn(T, h, generator=gen)
    keys = _records(fmt, Nk, gen)
    rows = torch.randint(0, Nk, (T, L), generator=gen)
    n_vis = torch.tensor([0, 1, 70, 150])
    rows[1, 1:] = 10 ** 9  # rows past n_visible may hold anything: must not be read
    s = tri.indexer_scores(q, w, keys, rows, n_vis)
    vis = torch.arange(L)[None, :] < n_vis[:, None]
    assert torch.equal(torch.isinf(s), ~vis)
    s_rows = tri.indexer_scores(q, w, fmt.unpack(keys.data, dtype), rows, n_vis)
    assert torch.equal(s[vis], s_rows[vis])
    s_ref = ref.indexer_scores(q, w, keys, rows, n_vis)
    assert rel_err(s[vis], s_ref[vis]) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_tiny_v4_on_records_triton_backend_matches_torch(tmp_path) -> None:
    """The whole tiny V4 model on a record cache: the Triton backend (every kernel in the
    interpreter, the attention ops reading the 584-style records and the fp4 keys in place)
    against the torch backend, prefill then one decode step (ring mode).  numerics "bf16":
    official numerics would let 1e-7 differences flip FP8 activation roundings.

    The record cache still quantizes on write (e4m3 KV, fp4 keys): a compressed entry whose
    value sits at a rounding boundary can take another code from a 1-ulp difference upstream,
    and every later token then moves by ~1e-4.  Seen on a CPU where the torch backend alone
    moved by 1.7e-4 from token 7 on between MKL's default and AVX2 code paths (the first
    7 rows within 1e-6): so the bound is that of one flipped code, and the greedy tokens must
    agree.  (The kernels' exactness on records is checked op by op above.)"""
    from dsv4.cache.tensors import HybridCache
    from dsv4.model.context import StepContext
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=0)
    ids = torch.randint(20, 500, (10,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for backend in ("torch", "triton"):
        model = load_model(path, dtype=torch.float32, numerics="bf16", backend=backend)
        cache = HybridCache.allocate(model.cfg, 1, 1, 256, cf.RECORD_DTYPE)
        prefill = StepContext.single(ids, start_pos=0, page_size=256, all_logits=True)
        decode = StepContext.build(torch.tensor([5]), [1], [10], [0], [[0]])
        logits[backend] = torch.cat([model.compute_logits(model.forward(ctx, cache))
                                     for ctx in (prefill, decode)])
    assert logits["torch"].shape == (11, model.cfg.vocab_size)
    assert rel_err(logits["triton"], logits["torch"]) < 2e-3
    assert torch.equal(logits["triton"].argmax(-1), logits["torch"].argmax(-1))


@pytest.mark.parametrize("d,split", [(128, 1), (512, 2)])
def test_chunked_record_reads_match_element_reads(d: int, split: int) -> None:
    """fp8 records read chunk-wise (8-byte code vectors, one scale per chunk, the bf16 tail as
    vectors) give bit for bit what the per-element reads give, at V4's real 584-byte layout."""
    gen = torch.Generator().manual_seed(d)
    fmt = cf.v4_kv_record(d, 64)
    assert tri.chunked_records_ok(tri.record_meta(fmt), d, fmt.record_bytes)
    T, H = 2, 16
    q = torch.randn(T, H, d, generator=gen).bfloat16()
    kv_a, kv_b = _records(fmt, 40, gen), _records(fmt, 19, gen)
    idx_a, idx_b = random_indices(T, 33, 40, gen, 0.3), random_indices(T, 21, 19, gen, 0.3)
    idx_b[1] = -1
    sink = torch.randn(H, generator=gen)
    outs = [tri.sparse_attn_with_config(
        q, kv_a, idx_a, kv_b, idx_b, sink, d ** -0.5, torch.bfloat16,
        tri.AttnConfig(BH=16, BN=16, split_kv=split, chunked=chunked)) for chunked in (True, False)]
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])


def test_chunked_records_ok_refuses_other_layouts() -> None:
    assert not tri.chunked_records_ok(tri.record_meta(cf.fp8_record(128, 32)), 128, 124)
    assert not tri.chunked_records_ok(tri.record_meta(cf.fp4_record(128, 16, "e4m3")), 128, 72)
    v4 = tri.record_meta(cf.v4_kv_record(512, 64))
    assert tri.chunked_records_ok(v4, 512, 584)
    assert not tri.chunked_records_ok(v4, 512, 588)   # rows not 8-byte aligned
    assert not tri.chunked_records_ok(tri._DENSE_META, 512, 512)
