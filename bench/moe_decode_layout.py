"""The MXFP4 expert GEMMs on row-major against K-chunk-major stacks (``ExpertWeights.kchunk``,
the model's layout on the GPU since the twelfth session): with chunks of the K step each
program's [rows, 64-byte] weight tile of one K step is one contiguous run of bytes instead of
64-byte pieces K/2 bytes apart.  Same kernels and plans (``pick_moe_config``), same bits.

V4-Flash widths, official numerics, CUDA-graph replay of rotated routings (<= 256 tokens), as
bench/moe_decode.py.

    PYTHONPATH=. python bench/moe_decode_layout.py [--tokens 1,2,4,16,64,256,8192]
        [--plans BN_up/BN_down/warps/split_up/split_down,...]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/moe_decode_layout.py --tiny   # CPU smoke run

Columns: µs per call, the floor (weight bytes / 4.29 TB/s or FLOPs / 1459 TFLOP/s), the ratio,
GB/s, the relative difference to the torch twin (first 256 rows), finite.  Twelfth session
(H200, an earlier form of this script that also timed a stream-K schedule, since removed):
1 token 57.7 -> 57.1 µs, 2: 97.9 -> 87.4, 4: 173.0 -> 151.4, 16: 491.8 -> 444.3, 64: 1,195 ->
1,063.  Its ``--units`` option timed a K-step unit path in the thirteenth session (slower at
1 / 2 tokens: 97-130 / 151-194 µs against 55.6 / 86.5; removed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_decode import (BW, FLASH, PEAK_FP8, TINY, _device, _time_plan, expert_bytes,  # noqa: E402
                        fmt_us, mxfp4_stacks, routing)

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402

def parse_plan(spec: str) -> dict[str, int]:
    """``BN_up/BN_down/warps/split_up/split_down`` -> MoeConfig fields (``--plans``)."""
    try:
        bn_up, bn_down, warps, su, sd = (int(v) for v in spec.split("/"))
    except ValueError:
        raise SystemExit(f"moe_decode_layout: --plans wants BN_up/BN_down/warps/split_up/"
                         f"split_down entries; found {spec!r}")
    return dict(BN_up=bn_up, BN_down=bn_down, warps_up=warps, warps_down=warps, split_up=su,
                split_down=sd)


def variants(base: tri.MoeConfig, extra: list[dict[str, int]]
             ) -> list[tuple[str, tri.MoeConfig, bool]]:
    """(name, plan, K-chunk-major) of the timed variants: the default plan on both layouts,
    then each ``extra`` plan (fields replaced in the default one), K-chunk-major."""
    out = [("row-major (default plan)", base, False), ("K-chunk-major", base, True)]
    for fields in extra:
        cfg = dataclasses.replace(base, **fields)
        out.append((f"K-chunk-major, BN {cfg.BN_up}/{cfg.BN_down} w{cfg.warps_up} split "
                    f"{cfg.split_up}/{cfg.split_down}", cfg, True))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,16,64,256,8192")
    ap.add_argument("--plans", default="", help="extra decode plans, comma-separated "
                    "BN_up/BN_down/warps/split_up/split_down (K-chunk-major stacks)")
    ap.add_argument("--rotate", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="toy widths (CPU smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = _device(args.tiny)
    shape = TINY if args.tiny else FLASH
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    gen = torch.Generator(device=dev).manual_seed(0)
    ex = mxfp4_stacks(E, D, inter, gen, dev)
    bk = tri._block_k(ex, D, inter)
    ex_ch = ref.kchunk_experts(ex, bk)
    replays = 1 if args.tiny else args.replays
    rotate = 1 if args.tiny else args.rotate
    rows: list[dict[str, Any]] = []
    print(f"# MXFP4 experts: E {E}, D {D}, I {inter}, top-{k}, MXFP4, official numerics; "
          f"graph replay of {rotate} routings")
    print("| tokens | variant | µs | floor µs | ratio | GB/s | rel vs twin | finite |")
    print("|---|---|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        calls = []
        for _ in range(rotate if T <= 256 else 1):
            x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
            ids, w = routing(T, E, k, gen, dev)
            calls.append((x, ids, w))
        distinct = statistics.mean(int(torch.unique(c[1]).numel()) for c in calls)
        nbytes = distinct * expert_bytes(D, inter)
        floor_us = max(nbytes / BW, 2 * 3 * D * inter * T * k / PEAK_FP8) * 1e6
        x, ids, w = calls[0]
        twin = ref.moe_experts(x[:256], ids[:256], w[:256], ex, 10.0)
        base = tri.pick_moe_config(T * k, E, D, inter, bk)
        extra = [parse_plan(p) for p in args.plans.split(",") if p] if T <= 16 else []
        for name, cfg, chunked in variants(base, extra):
            res = _time_plan(cfg, calls, ex_ch if chunked else ex, twin, dev, replays)
            res.update(T=T, variant=name, plan=dataclasses.asdict(cfg), floor_us=floor_us)
            rows.append(res)
            if "error" in res:
                print(f"| {T} | {name} | error: {res['error'][:90]} | | | | | |", flush=True)
                continue
            print(f"| {T} | {name} | {fmt_us(res['us'])} | {fmt_us(floor_us)} | "
                  f"{res['us'] / floor_us:.2f} | {nbytes / res['us'] / 1e3:.0f} | "
                  f"{res['rel_twin']:.2e} | {res['finite']} |", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    return {"rows": rows}


if __name__ == "__main__":
    main()
