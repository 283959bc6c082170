"""Prefill glue at V4-Flash widths, each form against the one it replaced (µs a call, and whether
the outputs agree):

* the output's inverse RoPE ([T, 64, 512] bf16, 64 rotated channels): a new tensor (every
  channel copied) against in place (the tail only);
* wo_a (8 groups of 4,096 -> 1,024, bf16): einsum then wo_b's reshape (a copy of the
  batch-major result) against one batched GEMM written into [T, G, o_lora];
* the routing plan (256 experts, top-6, 128-row blocks): the Triton kernel (one program per
  expert) against its torch twin (a stable sort and ~10 small ops) and the chunked kernels
  (``moe_plan(..., chunked=True)``: three launches over chunks of 128 pairs).

    PYTHONPATH=. python bench/prefill_glue.py [--tokens 2048,8192,32768]

GPU only.  Bytes-floor ratios use the H200's 4.29 TB/s (shared/GPU.md).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from dsv4.ops import triton_moe_plan, triton_norm

BW = 4.29e12


def us(fn) -> float:
    return do_bench(fn, warmup=5, rep=50) * 1e3


def row(T: int, what: str, form: str, t: float, nbytes: float, same: str) -> None:
    print(f"| {T} | {what} | {form} | {t:.1f} | {nbytes / BW * 1e6:.1f} | {same} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192,32768")
    args = ap.parse_args(argv)
    dev = "cuda"
    H, hd, half, G, r, E, k = 64, 512, 32, 8, 1024, 256, 6
    print("| tokens | op | form | µs | bytes floor µs | output |\n|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device=dev).manual_seed(T)
        o = torch.randn(T, H, hd, generator=gen, device=dev).to(torch.bfloat16)
        ang = torch.rand(T, half, generator=gen, device=dev) * 6.28
        cos, sin = ang.cos(), ang.sin()
        ref = triton_norm.apply_rope(o, cos, sin, inverse=True)
        work = o.clone()
        triton_norm.apply_rope(work, cos, sin, inverse=True, inplace=True)
        same = "bits" if torch.equal(work, ref) else "DIFFERENT"
        row(T, "inverse RoPE", "new tensor", us(lambda: triton_norm.apply_rope(
            o, cos, sin, inverse=True)), 2 * o.nbytes, "reference")
        # (Rotating the same buffer again each call: the bytes are what is timed.)
        row(T, "inverse RoPE", "in place", us(lambda: triton_norm.apply_rope(
            work, cos, sin, inverse=True, inplace=True)), 2 * o.nbytes * 2 * half / hd, same)
        del work, ref

        ow = o.view(T, G, -1)
        w = (torch.randn(G, r, H * hd // G, generator=gen, device=dev) * 0.02).to(torch.bfloat16)

        def einsum_form() -> torch.Tensor:
            return torch.einsum("tgd,grd->tgr", ow, w).reshape(T, G * r)

        def bmm_form() -> torch.Tensor:
            u = torch.empty(T, G, r, dtype=w.dtype, device=dev)
            torch.bmm(ow.transpose(0, 1), w.transpose(1, 2), out=u.transpose(0, 1))
            return u.reshape(T, G * r)

        a, b = einsum_form(), bmm_form()
        diff = (a.float() - b.float()).abs().max().item()
        same = "bits" if torch.equal(a, b) else f"max |diff| {diff:.2e}"
        wbytes = o.nbytes + w.nbytes + T * G * r * 2
        row(T, "wo_a", "einsum + reshape", us(einsum_form), wbytes, "reference")
        row(T, "wo_a", "bmm into [T, G, r]", us(bmm_form), wbytes, same)
        del o, a, b

        ids = torch.rand(T, E, generator=gen, device=dev).topk(k, dim=-1).indices
        p1, b1 = triton_moe_plan.moe_plan(ids, E, 128)
        p2, b2 = triton_moe_plan.moe_plan_torch(ids, E, 128)
        same = "bits" if torch.equal(p1, p2) and torch.equal(b1, b2) else "DIFFERENT"
        pbytes = ids.nbytes + p1.nbytes + b1.nbytes
        row(T, "routing plan", "Triton kernel", us(lambda: triton_moe_plan.moe_plan(ids, E, 128)),
            pbytes, "reference")
        row(T, "routing plan", "torch twin", us(lambda: triton_moe_plan.moe_plan_torch(
            ids, E, 128)), pbytes, same)
        p3, b3 = triton_moe_plan.moe_plan(ids, E, 128, chunked=True)
        same = "bits" if torch.equal(p1, p3) and torch.equal(b1, b3) else "DIFFERENT"
        row(T, "routing plan", "Triton, chunks of 128 pairs", us(
            lambda: triton_moe_plan.moe_plan(ids, E, 128, chunked=True)), pbytes, same)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
