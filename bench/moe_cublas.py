"""Would the prefill experts' FP8 GEMMs run faster through cuBLAS?  The FP8-MMA expert call on
kept FP8 codes (``triton_moe_fp8.moe_experts_fp8mma``: Triton kernels, one wgmma per 128-wide K
step rescaled in fp32, ~25–28% of the FP8 peak at 8K tokens) against a prototype that runs each
expert's gate+up and down GEMMs through cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm``
with 1×128 scales on both operands, CUDA >= 12.9, sm_90: the same per-step scaling, the form
that gave 950–1,230 TFLOP/s for the dense prefill GEMMs).  V4-Flash widths (D 4096, I 2048,
top-6), MXFP4 stacks re-encoded losslessly to e4m3 codes + per-(column, 128-step) factors.

    PYTHONPATH=. python bench/moe_cublas.py [--tokens 8192,32768] [--experts 256]
        [--streams 1,4] [--out f.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/moe_cublas.py --tiny   # CPU smoke run

The prototype: the call's plan and prep kernels (rows sorted by expert in blocks of 64, codes in
the kernels' MMA K order — the kept codes share it, so every dot is unchanged), then one
``_scaled_mm`` per active expert for gate+up (the w1 and w3 codes side by side: N = 2·I) and one
for down (in order on one stream, or round-robin over ``--streams`` streams so that several of
the small GEMMs can fill the GPU together), the clamped SwiGLU × routing weight and the combine
in torch.  Its cuBLAS calls need each expert's activation scales packed (one copy an expert,
made before the timing: a real kernel would write them so); the host must know every expert's
rows (one sync a call).

Printed per token count and stream count: the Triton call's µs; the prototype's up and down
GEMM loops (GPU µs between CUDA events, the host's µs issuing them, TFLOP/s of the GEMMs) and
its whole call; the relative difference of the outputs (both round gate / up to bf16 before the
SwiGLU, as the twin does; they differ only where the two sum a 128-wide step's products
differently).  First a probe picks the layout of the weight scales cuBLAS reads (checked
against an fp32 product; the run stops if no layout matches).  On the CPU (``--tiny``, the
Triton interpreter for the prep kernel) the scaled GEMM is an fp32 emulation with the same
layout checks: a smoke run of the glue, no speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_decode import routing  # noqa: E402
from moe_prefill_fp8 import bench_setup, prepped, rel_diff, time_us  # noqa: E402

from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402

BM = 64          # plan rows per block (a multiple of 4, as cuBLAS wants M)
STEP = 128       # the K step: one activation scale and one weight factor per step
LIMIT = 10.0     # V4's SwiGLU clamp


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                       scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp32 emulation of cuBLAS's 1×128 block-scaled FP8 GEMM (CPU smoke runs): a [M, K]
    e4m3, b [K, N] e4m3 column-major, scale_a (M, K/128) M-major, scale_b (K/128, N)."""
    M, K = a.shape
    N = b.shape[1]
    if scale_a.shape != (M, K // STEP) or scale_b.shape != (K // STEP, N):
        raise ValueError(f"scales {tuple(scale_a.shape)} / {tuple(scale_b.shape)} for a "
                         f"{M}x{K} by {K}x{N} product")
    if scale_a.stride(0) != 1 or b.stride(0) != 1:
        raise ValueError("scale_a must be M-major and b column-major")
    af = a.float() * scale_a.repeat_interleave(STEP, dim=1)
    bf = b.float() * scale_b.repeat_interleave(STEP, dim=0)
    return (af @ bf).to(out_dtype)


def scaled_mm(device: str) -> Callable[..., torch.Tensor]:
    """``mm(a, b, scale_a, scale_b, out_dtype)``: cuBLAS's (torch._scaled_mm) or the emulation."""
    if device == "cuda":
        return lambda a, b, sa, sb, out_dtype: torch._scaled_mm(
            a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return emulated_scaled_mm


def scaled_mm_into(device: str) -> Callable[..., None]:
    """``mm_into(a, b, scale_a, scale_b, out)``: the bf16 product written into ``out`` (a row
    range of the call's buffer) — through ``_scaled_mm``'s out= form where torch has it, else
    computed and copied."""
    mm = scaled_mm(device)
    direct = [device == "cuda"]

    def into(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
             out: torch.Tensor) -> None:
        if direct[0]:
            try:
                torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out.dtype, out=out)
                return
            except (TypeError, RuntimeError) as e:
                print(f"_scaled_mm(out=...) not usable ({type(e).__name__}): copying")
                direct[0] = False
        out.copy_(mm(a, b, sa, sb, out.dtype))

    return into


def weight_scale_layouts(f: torch.Tensor) -> dict[str, torch.Tensor]:
    """Candidate strides of one expert's factors f [K/128, N] for cuBLAS's scale_b: as stored
    (N contiguous) and K/128-contiguous."""
    return {"N-major": f, "K-major": f.t().contiguous().t()}


def probe_layout(mm: Callable[..., torch.Tensor], codes: f8.Fp8Codes, gen: torch.Generator,
                 device: str) -> str | None:
    """The scale_b layout whose product matches the fp32 one (relative 1e-2), or None."""
    q, f = codes.q1[0], codes.f1[0]               # [N, K], [K/128, N]
    N, K = q.shape
    M = 64
    a = (torch.randn(M, K, generator=gen, device=device) * 4).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-4, 4, (M, K // STEP), generator=gen, device=device).float())
    want = (a.float() * sa.repeat_interleave(STEP, dim=1)) @ \
        (q.float() * f.t().repeat_interleave(STEP, dim=1)).t()
    sa_mm = sa.t().contiguous().t()
    for name, sb in weight_scale_layouts(f).items():
        try:
            got = mm(a, q.t(), sa_mm, sb, torch.bfloat16)
        except (RuntimeError, ValueError) as e:
            print(f"scale_b {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        err = rel_diff(got.float(), want)
        print(f"scale_b {name}: relative difference to the fp32 product {err:.2e}")
        if err < 1e-2:
            return name
    return None


class CublasExperts:
    """The prototype expert call on kept codes (see the module docstring)."""

    def __init__(self, codes: f8.Fp8Codes, layout: str, device: str, streams: int = 1) -> None:
        self.E, self.inter, self.D = codes.q1.shape
        # gate+up side by side: codes [E, 2I, D], factors [E, D/128, 2I].
        self.q13 = torch.cat([codes.q1, codes.q3], dim=1)
        self.f13 = torch.cat([codes.f1, codes.f3], dim=2)
        self.q2, self.f2 = codes.q2, codes.f2
        self.sb13 = [weight_scale_layouts(self.f13[e])[layout] for e in range(self.E)]
        self.sb2 = [weight_scale_layouts(self.f2[e])[layout] for e in range(self.E)]
        self.mm_into = scaled_mm_into(device)
        self.device = device
        # streams > 1: the experts' calls go round-robin over that many CUDA streams, so that
        # several small GEMMs (~192 rows an expert at 8K tokens) can fill the GPU together.
        self.side = ([torch.cuda.Stream() for _ in range(streams - 1)]
                     if device == "cuda" else [])

    def _per_expert(self, calls: list[Callable[[], None]]) -> None:
        """Run ``calls`` in order on the current stream, or round-robin over it and the side
        streams (each forked from and joined back into the current one)."""
        if not self.side:
            for call in calls:
                call()
            return
        main = torch.cuda.current_stream()
        lanes = [main] + self.side
        for s in self.side:
            s.wait_stream(main)
        for i, call in enumerate(calls):
            with torch.cuda.stream(lanes[i % len(lanes)]):
                call()
        for s in self.side:
            main.wait_stream(s)

    def plan(self, x: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
        """The call's plan and prep: sorted rows, e4m3 codes in MMA order, each expert's row
        range (host) and packed activation scales."""
        E = self.E
        T, k = ids.shape
        pl = prepped(x, ids, E, BM, STEP)
        pairs, block_expert, xq, xs, P, nb = (pl[n] for n in ("pairs", "block_expert", "xq",
                                                               "xs", "P", "nb"))
        blocks = block_expert.tolist()                        # the host sync
        ranges: list[tuple[int, int, int]] = []
        b = 0
        while b < nb:
            e = blocks[b]
            b1 = b
            while b1 < nb and blocks[b1] == e:
                b1 += 1
            if 0 <= e < E:
                ranges.append((e, b * BM, b1 * BM))
            b = b1
        experts = [e for e, _, _ in ranges]
        if len(set(experts)) != len(experts):
            raise RuntimeError("moe_cublas: an expert's blocks are not contiguous in the plan")
        return {"pairs": pairs, "block_expert": block_expert, "xq": xq, "ranges": ranges,
                "sa": [xs[r0:r1].t().contiguous().t() for _, r0, r1 in ranges], "P": P,
                "k": k, "T": T}

    def up(self, plan: dict[str, Any]) -> torch.Tensor:
        """gate|up [rows, 2I] bf16, one cuBLAS call an expert."""
        out = torch.empty(plan["xq"].shape[0], 2 * self.inter, dtype=torch.bfloat16,
                          device=plan["xq"].device)
        def call(e: int, r0: int, r1: int, sa: torch.Tensor) -> Callable[[], None]:
            return lambda: self.mm_into(plan["xq"][r0:r1], self.q13[e].t(), sa, self.sb13[e],
                                        out[r0:r1])

        self._per_expert([call(e, r0, r1, sa) for (e, r0, r1), sa
                          in zip(plan["ranges"], plan["sa"])])
        return out

    def act(self, plan: dict[str, Any], gate_up: torch.Tensor, wts: torch.Tensor
            ) -> dict[str, Any]:
        """The clamped SwiGLU × routing weight (bf16, as the twin rounds it), quantized per
        128 in MMA order; each expert's packed scales."""
        pairs, P = plan["pairs"], plan["P"]
        valid = pairs < P
        w_row = torch.where(valid, wts[pairs.clamp_max(P - 1).long()], 0.0)
        gate = gate_up[:, :self.inter].float().clamp(max=LIMIT)
        upv = gate_up[:, self.inter:].float().clamp(-LIMIT, LIMIT)
        a = (F.silu(gate) * upv * w_row[:, None]).to(torch.bfloat16)
        rows = a.shape[0]
        aq = torch.zeros(rows, self.inter, dtype=torch.float8_e4m3fn, device=a.device)
        as_ = torch.zeros(rows, self.inter // STEP, dtype=torch.float32, device=a.device)
        nb = plan["block_expert"].shape[0]
        f8._fp8_prep_kernel[(nb, self.inter // STEP)](
            a, pairs, plan["block_expert"], aq, as_, P, self.E, plan["k"], a.stride(0),
            aq.stride(0), as_.stride(0), GATHER=False, BM=BM, AB=STEP, num_warps=4)
        return {"aq": aq, "sa": [as_[r0:r1].t().contiguous().t()
                                 for _, r0, r1 in plan["ranges"]]}

    def down(self, plan: dict[str, Any], act: dict[str, Any]) -> torch.Tensor:
        """y [rows, D] bf16, one cuBLAS call an expert."""
        out = torch.zeros(act["aq"].shape[0], self.D, dtype=torch.bfloat16,
                          device=act["aq"].device)
        def call(e: int, r0: int, r1: int, sa: torch.Tensor) -> Callable[[], None]:
            return lambda: self.mm_into(act["aq"][r0:r1], self.q2[e].t(), sa, self.sb2[e],
                                        out[r0:r1])

        self._per_expert([call(e, r0, r1, sa) for (e, r0, r1), sa
                          in zip(plan["ranges"], act["sa"])])
        return out

    def combine(self, plan: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
        """Per token the fp32 sum of its picks."""
        pairs, P = plan["pairs"], plan["P"]
        valid = pairs < P
        out = torch.zeros(plan["T"], self.D, dtype=torch.float32, device=y.device)
        tok = (pairs[valid].long() // plan["k"])
        out.index_add_(0, tok, y[valid].float())
        return out

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        plan = self.plan(x, ids)
        return self.combine(plan, self.down(plan, self.act(plan, self.up(plan),
                                                           wts.reshape(-1).float())))


def timed_loop(fn: Callable[[], Any], device: str, reps: int = 5) -> tuple[float, float]:
    """(GPU µs between CUDA events, host µs issuing) of ``fn``, the medians of ``reps``."""
    gpu, host = [], []
    for _ in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        if device == "cuda":
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
        else:
            gpu.append(host[-1])
    gpu, host = sorted(gpu[1:]), sorted(host[1:])
    return gpu[len(gpu) // 2], host[len(host) // 2]


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape, device, tokens, gen, ex = bench_setup(args, "moe_cublas", "8192,32768", "40",
                                                 args.experts)
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    codes = f8.encode_fp8_codes(ex)
    if codes is None:
        raise SystemExit("moe_cublas: the random stacks do not take the FP8-MMA path")
    kept = replace(ex, fp8_codes=codes)
    mm = scaled_mm(device)
    layout = probe_layout(mm, codes, gen, device)
    if layout is None:
        raise SystemExit("moe_cublas: no scale_b layout gives the fp32 product: cuBLAS's 1x128 "
                         "block-scaled GEMM is not usable here")
    streams = [int(v) for v in args.streams.split(",")] if device == "cuda" else [1]
    rows: list[dict[str, Any]] = []
    print(f"{E} experts, D {D}, I {inter}, top-{k}; scale_b {layout}; µs")
    print("| tokens | streams | Triton call | cuBLAS up GPU / host | cuBLAS down GPU / host | "
          "GEMM TFLOP/s | prototype call | rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for T in tokens:
        x = torch.randn(T, D, generator=gen, device=device).to(torch.bfloat16)
        ids, w = routing(T, E, k, gen, device)
        y_tri = f8.moe_experts_fp8mma(x, ids, w, kept, LIMIT, predecode=True)
        t_tri = time_us(lambda: f8.moe_experts_fp8mma(x, ids, w, kept, LIMIT, predecode=True),
                        device)
        for S in streams:
            rows.append(time_prototype(CublasExperts(codes, layout, device, S), x, ids, w,
                                       y_tri, t_tri))
    result = {"shape": shape, "device": device, "scale_b": layout, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def time_prototype(proto: CublasExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                   y_tri: torch.Tensor, t_tri: float) -> dict[str, Any]:
    """One table row: the prototype's loops and call against the Triton call's output / µs."""
    T, D = x.shape
    k, device = ids.shape[1], proto.device
    S = len(proto.side) + 1
    y_pro = proto(x, ids, w)
    plan = proto.plan(x, ids)
    gate_up = proto.up(plan)
    act = proto.act(plan, gate_up, w.reshape(-1).float())
    up_gpu, up_host = timed_loop(lambda: proto.up(plan), device)
    dn_gpu, dn_host = timed_loop(lambda: proto.down(plan, act), device)
    call_gpu, _ = timed_loop(lambda: proto(x, ids, w), device)
    flops = 2 * 3 * T * k * D * proto.inter
    row = {"tokens": T, "streams": S, "triton_us": t_tri, "up_gpu_us": up_gpu,
           "up_host_us": up_host, "down_gpu_us": dn_gpu, "down_host_us": dn_host,
           "gemm_tflops": flops / ((up_gpu + dn_gpu) * 1e-6) / 1e12,
           "prototype_us": call_gpu, "rel_diff": rel_diff(y_pro, y_tri),
           "finite": bool(torch.isfinite(y_pro).all())}
    print(f"| {T} | {S} | {t_tri:.0f} | {up_gpu:.0f} / {up_host:.0f} | {dn_gpu:.0f} / "
          f"{dn_host:.0f} | {row['gemm_tflops']:.0f} | {call_gpu:.0f} | "
          f"{row['rel_diff']:.2e}{'' if row['finite'] else ' (not finite)'} |", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry (see the module docstring); returns the results."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--experts", type=int, default=0, help="routed experts (default 256)")
    ap.add_argument("--streams", default="1,4",
                    help="comma-separated CUDA stream counts the experts' calls go over")
    ap.add_argument("--tiny", action="store_true", help="toy widths on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
