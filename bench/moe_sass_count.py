"""Offline (no GPU) SASS instruction counts of the K loop of the MXFP4 expert kernels
(``_moe_up_kernel``, ``_moe_down_kernel``) compiled for sm_90, per opcode: the measure used to
make the in-register MXFP4 decode cheaper (the kernels are partly issue-bound).

    PYTHONPATH=. python bench/moe_sass_count.py [--fold 0|1|both] [--stripped]
        [--dump DIR]

Plans: BM 16 / BN 128 / 4 warps (decode) and BM 128 / BN 128 / 8 warps (prefill), BK 128,
unsplit, e8m0 scales, bf16.  Pointers, strides, N and K get the divisibility-16 attribute a real
launch gets (else the loads are not vectorized).  The loop is the longest backward branch;
each row also counts its register copies (``IMAD.MOV``, part of the ``IMAD`` total).
``--stripped``: the kernels with the decode of ``bench/moe_decode_nodecode.py`` (what the rest
of the K step costs).  TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsv4.ops import triton_moe as tm  # noqa: E402

_PTR = {"xs_ptr": "*bf16", "act_ptr": "*bf16", "y_ptr": "*bf16", "wt_ptr": "*fp32",
        "part_ptr": "*fp32", "part1_ptr": "*fp32", "part3_ptr": "*fp32"}
PLANS = ((16, 128, 4), (128, 128, 8))


def compile_kernel(which: str, BM: int, BN: int, warps: int, fold: bool) -> object:
    """The sm_90 compiled kernel ``which`` ("up" / "down") at one plan."""
    fn = tm._moe_up_kernel if which == "up" else tm._moe_down_kernel
    consts = dict(FMT=1, SB=32, SW_E8M0=True, HAS_LIMIT=True, FAST_FP4=True, SCALE_LE_128=fold,
                  SPLIT=False, KCHUNK=True, NBP=8, BM=BM, BN=BN, BK=128,
                  TOKEN_ROWS=False, TOPK=6, PREP_ACT=False, QUANT_ACT=False, COMBINE=False,
                  SHARED=False, PDL=False)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = _PTR.get(n, "*u8" if n[0] in "ws" else "*i32")
        else:
            sig[n] = "fp32" if n == "limit" else "i32"
        if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=3))


def loop_counts(cubin: bytes) -> tuple[int, collections.Counter, str]:
    """(instructions, opcode counts) of the longest backward-branch loop, and the SASS."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    body = loop_body(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", s).split()[0].split(".")[0]
                              for s in body)
    return len(body), ops, sass


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest backward-branch loop of ``sass``."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           for m in [re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)] if m]
    back = [(a, int(t.group(1), 16)) for a, s in ins if "BRA" in s
            for t in [re.search(r"0x([0-9a-f]+)", s)] if t and int(t.group(1), 16) <= a]
    end, start = max(back, key=lambda p: p[0] - p[1])
    return [s for a, s in ins if start <= a <= end]


def moves_in_loop(sass: str) -> int:
    """``IMAD.MOV`` register copies in the loop of :func:`loop_body`."""
    return sum(1 for s in loop_body(sass) if "IMAD.MOV" in s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fold", choices=("0", "1", "both"), default="both")
    ap.add_argument("--stripped", action="store_true",
                    help="the MXFP4 decode stripped as in bench/moe_decode_nodecode.py")
    ap.add_argument("--dump", help="write each kernel's SASS into this folder")
    args = ap.parse_args()
    if args.stripped:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from moe_decode_nodecode import strip_decode
        strip_decode()
    folds = {"0": (False,), "1": (True,), "both": (False, True)}[args.fold]
    for fold in folds:
        for which in ("down", "up"):
            for BM, BN, warps in PLANS:
                k = compile_kernel(which, BM, BN, warps, fold)
                n, ops, sass = loop_counts(k.asm["cubin"])
                if args.dump:
                    Path(args.dump).mkdir(parents=True, exist_ok=True)
                    Path(args.dump, f"{which}_bm{BM}_fold{int(fold)}.sass").write_text(sass)
                top = ", ".join(f"{o} {c}" for o, c in ops.most_common(8))
                # LDGSTS in the loop: the software pipeliner's async copies (0: unpipelined).
                print(f"fold={int(fold)} {which:4s} BM{BM:<3d} BN{BN} w{warps}: {n:5d} instr "
                      f"per K step ({moves_in_loop(sass)} IMAD.MOV, {ops['LDGSTS']} LDGSTS)"
                      f" | {top}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
