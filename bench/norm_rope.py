"""Time the fused norm / RoPE kernels (``dsv4/ops/triton_norm.py``) at V4-Flash shapes against
the unfused torch code they replace, on one GPU.

    PYTHONPATH=. python bench/norm_rope.py [--out results.json]

Per op and T (1 / 64 decode rows, 8192 prefill tokens): the kernel's device time (CUDA-graph
replay, inputs rotated over enough copies to defeat L2; ``bench/kernels.py``'s timer), the
unfused torch sequence's device time measured the same way, the bytes the kernel must move and
the ratio to the floor ``bytes / 4.29 TB/s`` (the H200's measured copy bandwidth).  At T = 1
every op is a few KB: the floor is nanoseconds and the time is launch latency, so there the
number to read is the torch / kernel speed-up (kernels launched per step), not the ratio.
Not run in CI; no result is recorded in docs until measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import copies_for, time_graph  # noqa: E402  (bench/kernels.py)

from dsv4.formats import fake_quant_fp8  # noqa: E402
from dsv4.ops import torch_attn  # noqa: E402
from dsv4.ops import triton_norm as tri  # noqa: E402

BW = 4.29e12
DEV = "cuda"
H, D_HEAD, HALF, DIM, Q_LORA, EPS = 64, 512, 32, 4096, 1024, 1e-6


def _unfused_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + EPS)
    return torch_attn.apply_rope(q, cos, sin)


def _unfused_kv(kv: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fp8: bool) -> torch.Tensor:
    kv = torch_attn.apply_rope(torch_attn.rms_norm(kv, w, EPS), cos, sin)
    if fp8:
        kv = torch.cat((fake_quant_fp8(kv[:, :-2 * HALF], 64), kv[:, -2 * HALF:]), dim=-1)
    return kv


def _tables(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(T, 1, device=DEV) * 60000 * torch.logspace(0, -4, HALF, device=DEV)[None]
    return torch.cos(ang), torch.sin(ang)


def measure(op: str, T: int, make: Callable[[], tuple], kernel: Callable[..., object],
            unfused: Callable[..., object], nbytes: int) -> dict:
    sets = [make() for _ in range(copies_for(nbytes))]
    t_kernel = time_graph([lambda s=s: kernel(*s) for s in sets])
    t_torch = time_graph([lambda s=s: unfused(*s) for s in sets])
    floor = nbytes / BW * 1e6
    return dict(op=op, T=T, us=t_kernel, torch_us=t_torch, speedup=t_torch / t_kernel,
                bytes=nbytes, floor_us=floor, ratio=t_kernel / floor)


def run(T: int) -> list[dict]:
    bf = torch.bfloat16
    rows = []
    qn = T * H * D_HEAD * 2 + T * HALF * 8            # q read + written (in place), cos/sin

    def make_q() -> tuple:
        cos, sin = _tables(T)
        return torch.randn(T, H, D_HEAD, device=DEV).to(bf), cos, sin
    rows.append(measure(
        "head_norm_rope", T, make_q,
        lambda q, c, s: tri.head_norm_rope(q, c, s, EPS, True, inplace=True),
        _unfused_q, 2 * qn))
    rows.append(measure(
        "apply_rope inv", T, make_q,
        lambda o, c, s: tri.apply_rope(o, c, s, inverse=True),
        lambda o, c, s: torch_attn.apply_rope(o, c, s, inverse=True), 2 * qn))

    def make_kv() -> tuple:
        cos, sin = _tables(T)
        return (torch.randn(T, D_HEAD, device=DEV).to(bf), torch.rand(D_HEAD, device=DEV) + 0.5,
                cos, sin)
    kvn = 2 * T * D_HEAD * 2 + D_HEAD * 4 + T * HALF * 8
    for fp8 in (False, True):
        rows.append(measure(
            "norm_rope" + (" fp8" if fp8 else ""), T, make_kv,
            lambda x, w, c, s, f=fp8: tri.norm_rope(x, w, c, s, EPS, 64 if f else 0),
            lambda x, w, c, s, f=fp8: _unfused_kv(x, w, c, s, f), kvn))
    for name, width in (("rms_norm dim", DIM), ("rms_norm q_lora", Q_LORA)):
        def make_x(width: int = width) -> tuple:
            return torch.randn(T, width, device=DEV).to(bf), torch.rand(width, device=DEV) + 0.5
        rows.append(measure(
            name, T, make_x, lambda x, w: tri.rms_norm(x, w, EPS),
            lambda x, w: torch_attn.rms_norm(x, w, EPS), 2 * T * width * 2 + width * 4))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/norm_rope.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'op':<16} {'T':>5} {'us':>8} {'torch_us':>9} {'speedup':>8} {'MB':>8} "
          f"{'floor_us':>9} {'ratio':>6}")
    rows = []
    for T in (1, 64, 8192):
        for r in run(T):
            rows.append(r)
            print(f"{r['op']:<16} {r['T']:>5} {r['us']:8.2f} {r['torch_us']:9.2f} "
                  f"{r['speedup']:8.2f} {r['bytes'] / 1e6:8.3f} {r['floor_us']:9.3f} "
                  f"{r['ratio']:6.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
