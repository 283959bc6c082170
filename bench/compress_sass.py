"""``compress_entries`` at decode sizes: the loop plan against the split plan
(dsv4/ops/triton_compress.py), offline (SASS for sm_90, no GPU) and on the GPU (µs per call).

    PYTHONPATH=. python bench/compress_sass.py [--dump DIR]          # offline SASS (CPU only)
    PYTHONPATH=. python bench/compress_sass.py --time [--out r.json] # timings (needs CUDA)

Offline: each plan's launch for one V4-Flash static decode entry (bf16 out, RoPE 64, a valid
mask) is recorded through the sm_90 compile machinery of tests/kernels/sm90_cases.py (the
signature, constexprs, specializations and PDL a launch on the H200 compiles with), compiled,
and its SASS counted: registers, spill bytes, instructions, and the instructions one thread of
the entry's finishing program executes (the loop plan: prologue + channel-block loop body ×
trips + norm pass; the split plan: straight-line code), split into float64 ops, shuffles,
barriers, global loads / stores, atomics / fences.  TRITON_INTERPRET must be unset.

--time: µs per call at E = 1, 16, 64 entries (every entry valid: the worst case; and every entry
masked) for the three V4-Flash compressors, each plan and the tile alternatives of the split
plan; a CUDA graph of 20 back-to-back calls replayed (inputs hot in L2) and
``triton.testing.do_bench`` (L2 flushed between calls: cold inputs).  Also checks each result
against the torch twin (bf16: 1 ulp) on the way.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "kernels"))

# (name, ratio, overlap, d): the V4-Flash compressors of CSA / HCA layers.
SHAPES = (("csa_attn r4 d512", 4, True, 512), ("csa_index r4 d128", 4, True, 128),
          ("hca r128 d512", 128, False, 512))
# Tile alternatives of the split plan (DSV4_COMPRESS_TILE = BLOCK_D,WARPS); None: the default.
ALTERNATIVES = {512: (None, "64,2", "16,1", "512,16"), 128: (None, "128,4", "128,8", "32,1")}
ALTERNATIVES_R128 = (None, "16,4", "4,4")


def _env(plan: str, tile: str | None):
    """Context: DSV4_COMPRESS_PLAN / DSV4_COMPRESS_TILE set for the block."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        saved = {k: os.environ.get(k) for k in ("DSV4_COMPRESS_PLAN", "DSV4_COMPRESS_TILE")}
        os.environ["DSV4_COMPRESS_PLAN"] = plan
        if tile:
            os.environ["DSV4_COMPRESS_TILE"] = tile
        else:
            os.environ.pop("DSV4_COMPRESS_TILE", None)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx()


def _decode_call(ratio: int, overlap: bool, d: int, E: int, device: str = "cpu",
                 live: bool = True) -> tuple:
    """compress_entries arguments of a static decode step of E sequences (one candidate entry
    each, all valid when ``live``, else all masked)."""
    import torch
    gen = torch.Generator().manual_seed(0)
    coff = 2 if overlap else 1
    W = coff * d
    starts = [(1000 + 7 * k) * ratio + (ratio - 1 if live else 0) for k in range(E)]
    start = torch.tensor(starts)
    kv = torch.randn(E, W, generator=gen)
    score = torch.randn(E, W, generator=gen) * 2
    state_kv = torch.randn(E + 2, coff * ratio, W, generator=gen)
    state_score = torch.randn(E + 2, coff * ratio, W, generator=gen) * 2
    cu = torch.arange(E + 1)
    slots = torch.randperm(E + 2, generator=gen)[:E]
    req = torch.arange(E)
    ent = torch.clamp((start + 1) // ratio - 1, min=0)
    valid = (start + 1) % ratio == 0
    angles = torch.rand(E, 32, generator=gen) * 6.3
    weight = torch.rand(d, generator=gen) + 0.5
    t = [kv, score, state_kv, state_score, req, ent, valid, start, cu, slots]
    t = [x.to(device) for x in t]
    cos, sin = torch.cos(angles).to(device), torch.sin(angles).to(device)
    return (*t[:10], ratio, overlap, weight.to(device), 1e-6, cos, sin, torch.bfloat16)


# ---------------------------------------------------------------------------------- offline
def _sass(cubin: bytes) -> tuple[str, str]:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    return sass, res


def sass_opcodes(sass: str) -> tuple[list[str], collections.Counter]:
    """The instructions of a ``cuobjdump --dump-sass`` listing and their opcodes (predicate and
    modifiers dropped: ``@!P0 SHFL.BFLY`` counts as ``SHFL``)."""
    body = [m.group(1) for ln in sass.splitlines()
            for m in [re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", ln)] if m]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0]
                              for b in body)
    return body, ops


_KINDS = (("fp64", re.compile(r"^D(FMA|ADD|MUL|SETP|MNMX)|^MUFU\.RCP64H|^F2F\.F(64|32\.F64)")),
          ("shfl", re.compile(r"^SHFL")), ("bar", re.compile(r"^BAR")),
          ("ldg", re.compile(r"^LDG")), ("stg", re.compile(r"^STG")),
          ("lds/sts", re.compile(r"^(LDS|STS|LDSM)")),
          ("atom/fence", re.compile(r"^(ATOM|RED|MEMBAR)")))


def _path_counts(sass: str, trips: int) -> dict:
    """Counts along one thread's path of the finishing program: the main body (up to the last
    EXIT before the slow-path subroutines), the longest backward-branch loop counted ``trips``
    times."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           for m in [re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)] if m]
    ops = [(a, re.sub(r"^@!?U?P\w+\s+", "", s)) for a, s in ins]
    # Subroutines (division / sqrt slow paths, reached by CALL) follow the main body.
    exits = [a for a, s in ops if s.startswith("EXIT")]
    calls = [int(m.group(1), 16) for _, s in ops
             for m in [re.search(r"CALL\.REL\S* 0x([0-9a-f]+)", s)] if m]
    sub_start = min(calls) if calls else max(exits) + 16
    main = [(a, s) for a, s in ops if a < sub_start]
    back = [(a, int(t.group(1), 16)) for a, s in main if s.startswith("BRA")
            for t in [re.search(r"0x([0-9a-f]+)", s)] if t and int(t.group(1), 16) <= a]
    loop = max(back, key=lambda p: p[0] - p[1]) if back else None
    counts = collections.Counter()
    for a, s in main:
        w = trips if loop and loop[1] <= a <= loop[0] else 1
        counts["instr"] += w
        for kind, rx in _KINDS:
            if rx.search(s):
                counts[kind] += w
    counts["loop_body"] = (loop[0] - loop[1]) // 16 + 1 if loop else 0
    return dict(counts)


def offline(dump: str | None) -> int:
    import sm90_cases as sc
    import torch  # noqa: F401

    from dsv4.ops import triton_compress as tc
    rows = []
    for name, ratio, overlap, d in SHAPES:
        alts = ALTERNATIVES_R128 if ratio == 128 else ALTERNATIVES[d]
        for plan, tile in [("loop", None)] + [("split", t) for t in alts]:
            with _env(plan, tile), sc.RECORDER.active():
                sc.RECORDER.launches.clear()
                tc.compress_entries(*_decode_call(ratio, overlap, d, 1))
                launch = sc.RECORDER.launches[-1]
                if plan == "loop":
                    s_block, block_d, _, warps = tc.entries_tiles(ratio, overlap, d)
                    trips, programs = -(-d // block_d), 1
                else:
                    s_block, block_d, _, warps = tc.split_tiles(ratio, overlap, d)
                    trips, programs = 1, -(-d // block_d)
            kern = sc.compile_launch(launch)
            sass, res = _sass(kern.asm["cubin"])
            regs = int(re.search(r"REG:(\d+)", res).group(1))
            spill = int(re.search(r"LOCAL:(\d+)", res).group(1))
            n_all = len(re.findall(r"/\*[0-9a-f]{4}\*/\s+\S", sass))
            path = _path_counts(sass, trips)
            label = plan if tile is None else f"{plan} tile={tile}"
            if plan == "split" and tile is None:
                label = "split (default)"
            row = dict(shape=name, plan=label, block_d=block_d, warps=warps, programs=programs,
                       trips=trips, regs=regs, local_bytes=spill, sass_instr=n_all, **path)
            rows.append(row)
            print(f"{name:18s} {label:22s} prog/entry {programs:3d} warps {warps:2d} "
                  f"BLOCK_D {block_d:3d} loop trips {trips:2d} | regs {regs:3d} local {spill} | "
                  f"path: {path['instr']:5d} instr, fp64 {path.get('fp64', 0):4d}, shfl "
                  f"{path.get('shfl', 0):3d}, bar {path.get('bar', 0):3d}, ldg "
                  f"{path.get('ldg', 0):3d}, stg {path.get('stg', 0):3d}, atom/fence {path.get('atom/fence', 0)}",
                  flush=True)
            if dump:
                Path(dump).mkdir(parents=True, exist_ok=True)
                tag = label.replace(" ", "_").replace("=", "").replace(",", "x")
                Path(dump, f"{name.split()[0]}_{tag}.sass").write_text(sass)
    return 0


# -------------------------------------------------------------------------------------- GPU
def timed(out_path: str | None) -> int:
    import torch
    import triton

    from dsv4.ops import torch_compress as twin
    from dsv4.ops import triton_compress as tc
    sys.path.insert(0, str(REPO))
    from tests.kernels.test_triton_compress import assert_within_ulp
    results = []
    print(f"device: {torch.cuda.get_device_name(0)}")
    for name, ratio, overlap, d in SHAPES:
        alts = ALTERNATIVES_R128 if ratio == 128 else ALTERNATIVES[d]
        for E in (1, 16, 64):
            for live in (True, False):
                args = _decode_call(ratio, overlap, d, E, device="cuda", live=live)
                want = twin.compress_entries(*args)
                for plan, tile in [("loop", None)] + [("split", t) for t in alts]:
                    with _env(plan, tile):
                        got = tc.compress_entries(*args)
                        torch.cuda.synchronize()
                        assert not got.float().isnan().any()
                        assert_within_ulp(got, want)
                        n = 20
                        g = torch.cuda.CUDAGraph()
                        s = torch.cuda.Stream()
                        s.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(s):
                            for _ in range(2):
                                tc.compress_entries(*args)
                        torch.cuda.current_stream().wait_stream(s)
                        with torch.cuda.graph(g):
                            for _ in range(n):
                                tc.compress_entries(*args)
                        g.replay()
                        torch.cuda.synchronize()
                        t0, t1 = torch.cuda.Event(True), torch.cuda.Event(True)
                        reps = 50
                        t0.record()
                        for _ in range(reps):
                            g.replay()
                        t1.record()
                        torch.cuda.synchronize()
                        hot = t0.elapsed_time(t1) * 1e3 / (reps * n)
                        cold = triton.testing.do_bench(lambda: tc.compress_entries(*args)) * 1e3
                        again = tc.compress_entries(*args)   # counters clean after replays
                        torch.cuda.synchronize()
                        assert_within_ulp(again, want)
                    label = plan if tile is None else f"{plan} tile={tile}"
                    results.append(dict(shape=name, E=E, live=live, plan=label, graph_us=hot,
                                        do_bench_us=cold))
                    print(f"{name:18s} E={E:3d} {'live  ' if live else 'masked'} {label:20s} "
                          f"graph {hot:7.2f} µs/call   do_bench {cold:7.2f} µs", flush=True)
    if out_path:
        Path(out_path).write_text(json.dumps(results, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time", action="store_true", help="time on the GPU (needs CUDA)")
    ap.add_argument("--dump", help="offline: write each kernel's SASS into this folder")
    ap.add_argument("--out", help="--time: write the results as JSON")
    args = ap.parse_args()
    if args.time:
        return timed(args.out)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET for the offline SASS counts")
    return offline(args.dump)


if __name__ == "__main__":
    sys.exit(main())
