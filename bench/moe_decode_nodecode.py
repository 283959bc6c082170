"""Diagnostic: the decode expert kernels with the MXFP4 decode stripped to ~0.5 instructions
per weight (wrong values, the same loads, layouts, MMAs and epilogues), timed as
``bench/moe_decode.py`` times the real ones.  The gap between the two is what the in-register
decode costs; what remains is the kernels' memory pipeline, MMAs and split-K structure.

    python bench/moe_decode_nodecode.py [--tokens 1,16,64]       # the stripped kernels
    python bench/moe_decode.py --tokens 1,16,64                   # the real ones

The outputs are garbage by design (the table's error and finite columns say so); only the times
mean something.  The patch replaces the one-multiply decode's inline PTX before anything is
compiled, so the real kernels must be timed in another process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import triton_moe as tri  # noqa: E402

# Four packed bytes -> the four "planes" registers with one byte permute each, the group scales
# folded in by one AND (so their loads stay live): 4 instructions per 8 weights against ~18.
_STRIPPED = tl.constexpr("""{
prmt.b32 $0, $4, 0, 0x1404;
prmt.b32 $1, $4, 0, 0x3424;
and.b32 $2, $0, $5;
and.b32 $3, $1, $6;
}""")


def strip_decode() -> None:
    """Replace both inline-PTX decode variants (every stack takes one of them) before any
    expert kernel compiles (also used by ``bench/moe_sass_count.py --stripped``)."""
    tri._FP4_TO_BF16_FOLD_ASM = _STRIPPED
    tri._FP4_TO_BF16_ASM = _STRIPPED


def main(argv: list[str] | None = None) -> dict:
    """Strip the decode, then run bench/moe_decode.py with ``argv``."""
    strip_decode()
    import moe_decode
    args = list(sys.argv[1:] if argv is None else argv)
    if "--tokens" not in args:
        args += ["--tokens", "1,16,64"]
    return moe_decode.main(args)


if __name__ == "__main__":
    main()
