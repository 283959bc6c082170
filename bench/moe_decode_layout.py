"""The decode expert GEMMs under two changes that target their memory stream rather than their
instructions (docs/PERFORMANCE.md twelfth session: with the MXFP4 decode stripped out they are
only 3-7% faster, so the in-register decode is not what holds them at ~1.5 TB/s):

* the stream-K schedule (``MoeConfig.streamk`` programs per SM, dsv4.ops.triton_moe_streamk):
  a fixed grid of evenly loaded programs instead of 768 short split-K programs in 1.45 waves;
* K-chunk-major MXFP4 stacks (``ExpertWeights.kchunk``): each K step's [rows, 64-byte] weight
  tile one contiguous run of bytes instead of 64-byte pieces 2 KB apart.

V4-Flash widths, official numerics, CUDA-graph replay of rotated routings, as bench/moe_decode.py.

    PYTHONPATH=. python bench/moe_decode_layout.py [--tokens 1,2,4,16,64] [--per-sm 2,3,4]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/moe_decode_layout.py --tiny   # CPU smoke run

Columns: µs per call, the weight-streaming floor, the ratio, GB/s, the relative difference to
the torch twin, finite.
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

from moe_decode import (BW, FLASH, TINY, _device, _time_plan, expert_bytes,  # noqa: E402
                        fmt_us, mxfp4_stacks, routing)

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def kchunk_stacks(ex: ref.ExpertWeights, bk: int) -> ref.ExpertWeights:
    """The same experts stored K-chunk-major with chunks of the K step ``bk``."""
    w = [ref.rows_kchunk(t.view(torch.uint8), bk // 2).view(t.dtype) for t in (ex.w1, ex.w3,
                                                                               ex.w2)]
    s = [ref.rows_kchunk(t.view(torch.uint8), bk // 32).view(t.dtype) for t in (ex.s1, ex.s3,
                                                                                ex.s2)]
    return dataclasses.replace(ex, w1=w[0], w3=w[1], w2=w[2], s1=s[0], s3=s[1], s2=s[2],
                               kchunk=bk)


def variants(base: tri.MoeConfig, per_sm: list[int]) -> list[tuple[str, tri.MoeConfig, bool]]:
    """(name, plan, K-chunk-major) of the timed variants: the default plan on both layouts, then
    stream-K at each ``per_sm`` on both."""
    out = [("grouped (default)", base, False), ("grouped, kchunk", base, True)]
    for n in per_sm:
        sk = dataclasses.replace(base, streamk=n)
        out += [(f"stream-K {n}/SM", sk, False), (f"stream-K {n}/SM, kchunk", sk, True)]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,16,64")
    ap.add_argument("--per-sm", default="2,3,4", help="stream-K programs per SM to time")
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
    ex_ch = kchunk_stacks(ex, bk)
    replays = 1 if args.tiny else args.replays
    rotate = 1 if args.tiny else args.rotate
    per_sm = [int(v) for v in args.per_sm.split(",") if v]
    rows: list[dict[str, Any]] = []
    print(f"# decode experts: E {E}, D {D}, I {inter}, top-{k}, MXFP4, official numerics; "
          f"graph replay of {rotate} routings")
    print("| tokens | variant | µs | floor µs | ratio | GB/s | rel vs twin | finite |")
    print("|---|---|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        calls = []
        for _ in range(rotate):
            x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
            ids, w = routing(T, E, k, gen, dev)
            calls.append((x, ids, w))
        distinct = statistics.mean(int(torch.unique(c[1]).numel()) for c in calls)
        nbytes = distinct * expert_bytes(D, inter)
        floor_us = nbytes / BW * 1e6
        x, ids, w = calls[0]
        twin = ref.moe_experts(x, ids, w, ex, 10.0)
        base = tri.pick_moe_config(T * k, E, D, inter, bk)
        for name, cfg, chunked in variants(base, per_sm):
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
