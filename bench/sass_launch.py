"""Offline (no GPU) sm_90 SASS of recorded kernel launches: every launch of one
``tests/kernels/sm90_cases.py`` scenario whose description matches a pattern, compiled as the
H200 would compile it, with its registers, spill stack, instructions, and the instructions and
top opcodes of its longest loop (the longest backward branch, ``bench/moe_sass_count.py``).

    PYTHONPATH=. python bench/sass_launch.py SCENARIO PATTERN [--top 8]

e.g. ``glue_plans/v4_flash "_hc_post_mix_kernel.*BT=64, BD=16, PRECISION='tf32x3'"`` (the
mHC post + mixes of an 8K prefill, with and without the gates once) or
``norm_rope/v4_flash _norm_rope_kernel``; run it again with ``DSV4_HW_BF16_ROUND=1`` to see
that flag's code.  TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels"), str(ROOT / "bench")]

from compress_sass import _sass, sass_opcodes  # noqa: E402
from moe_sass_count import loop_body  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", help="a scenario of tests/kernels/sm90_cases.py (--list there)")
    ap.add_argument("pattern", help="regex on the launch's description")
    ap.add_argument("--top", type=int, default=8, help="opcodes shown a launch")
    ap.add_argument("--dump", help="append each matching launch's longest loop (SASS) here")
    args = ap.parse_args(argv)
    import sm90_cases as sc

    _per, launches, errors = sc.record([args.scenario])
    if errors:
        raise SystemExit(f"sass_launch: recording failed: {errors}")
    seen: set[str] = set()
    for launch in launches.values():
        desc = launch.describe()
        if not re.search(args.pattern, desc) or desc in seen:
            continue
        seen.add(desc)
        sass, res = _sass(sc.compile_launch(launch).asm["cubin"])
        body, _ops = sass_opcodes(sass)
        lines = loop_body(sass)
        # (The loop's instructions back in listing form, for the same opcode count.)
        loop, loop_ops = sass_opcodes("\n".join(f"        /*0000*/ {s};" for s in lines))
        usage = re.search(r"REG:(\d+) STACK:(\d+)", res)
        if args.dump:
            with open(args.dump, "a") as f:
                f.write(f"# {desc}\n" + "\n".join(lines) + "\n")
        print(desc[:desc.index(" num_warps")])
        # (A one-instruction "loop" is the branch-to-self after the kernel's exit.)
        tail = ("no loop" if len(loop) <= 1 else f"loop {len(loop)}: " + ", ".join(
            f"{op} {n}" for op, n in loop_ops.most_common(args.top)))
        print(f"    registers {usage.group(1)}, stack {usage.group(2)} B, {len(body)} "
              f"instructions; {tail}")
    if not seen:
        raise SystemExit(f"sass_launch: no launch of {args.scenario} matches {args.pattern!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
