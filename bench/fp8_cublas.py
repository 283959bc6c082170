"""cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1×128 activation and 128×128
weight scales, CUDA 12.9+) against dsv4's Triton FP8 GEMM (``triton_dense.fp8_linear``) at
V4-Flash's prefill shapes (dsv4 issue #5: the attention-side FP8 GEMMs ran at ~670 TFLOP/s).

Per shape (M tokens × the Linear's N, K): µs of the Triton GEMM (its activation quantization
fused or separate, as it picks), of cuBLAS alone on codes quantized by ``act_quant``, of
``act_quant`` alone, TFLOP/s, and the relative difference of the outputs (both sum each
128-wide K block's exact FP8 products in the tensor core's precision, then in fp32).

    PYTHONPATH=. python bench/fp8_cublas.py [--tokens 512,2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import triton_dense as td  # noqa: E402

# (name, N, K) of V4-Flash's FP8 Linears that a prefill step runs (spec §1; wq_a and wkv fused).
SHAPES = [("wq_a+wkv", 1536, 4096), ("wq_b", 32768, 1024),
          ("wo_b", 4096, 8192), ("indexer wq_b", 8192, 1024), ("shared w1+w3", 4096, 4096),
          ("shared w2", 4096, 2048)]
BLOCK = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192", help="comma-separated row counts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_cublas: needs a GPU")
    from triton.testing import do_bench
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"µs per call (triton.testing.do_bench, median); torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}; the Triton column is _fp8_gemm_kernel's own plan")
    print("| M | Linear | N | K | Triton fp8_linear | TFLOP/s | act_quant | cuBLAS block FP8 | "
          "TFLOP/s | cuBLAS + act_quant | rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for M, (name, N, K) in ((int(m), shape) for m in args.tokens.split(",") for shape in SHAPES):
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        w8 = (torch.randn(N, K, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
        exps = torch.randint(118, 128, (N // BLOCK, K // BLOCK), device="cuda", generator=g)
        sw_e8m0 = exps.to(torch.uint8).view(torch.float8_e8m0fnu)
        sw = torch.exp2(exps.float() - 127)
        flops = 2 * M * N * K
        y_tri = td.fp8_linear_with_config(x, w8, sw_e8m0, BLOCK, torch.bfloat16, None)
        t_tri = do_bench(lambda: td.fp8_linear_with_config(x, w8, sw_e8m0, BLOCK,
                                                           torch.bfloat16, None),
                         warmup=5, rep=50, return_mode="median") * 1e3
        a, sa = td.act_quant(x, BLOCK)
        t_q = do_bench(lambda: td.act_quant(x, BLOCK), warmup=5, rep=50,
                       return_mode="median") * 1e3
        try:
            y_cub = td.cublas_block_fp8_mm(a, sa, w8, sw)
            t_cub = do_bench(lambda: td.cublas_block_fp8_mm(a, sa, w8, sw), warmup=5, rep=50,
                             return_mode="median") * 1e3
            rel = ((y_cub.float() - y_tri.float()).norm() / y_tri.float().norm()).item()
            cub = (f"{t_cub:.1f} | {flops / t_cub / 1e6:.0f} | {t_cub + t_q:.1f} | {rel:.2e}"
                   + ("" if torch.isfinite(y_cub).all() else " NaN"))
        except Exception as e:  # report an unsupported build / layout, keep the table going
            cub = f"failed: {type(e).__name__}: {str(e)[:150]} | | |"
        print(f"| {M} | {name} | {N} | {K} | {t_tri:.1f} | {flops / t_tri / 1e6:.0f} | {t_q:.1f} | "
              f"{cub} |", flush=True)


if __name__ == "__main__":
    main()
