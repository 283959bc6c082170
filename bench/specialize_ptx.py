"""What leaving the run-time lengths unspecialized (``DSV4_UNSPECIALIZED_LENGTHS=1``,
``dsv4/ops/specialize.py``) does to the code of the kernels it touches, found offline: each
launch of the top-k, sparse-attention and compressor scenarios of ``tests/kernels/sm90_cases.py``
is compiled for sm_90 (H200) with the knob off and on, and their PTX compared — global loads by
width (a vector load needs the mask constant across its lanes, which a length's divisibility by
16 proves) and all instructions.  No GPU; what the difference costs in time needs one
(bench/sessions/gpu_session_s26c.sh).

    PYTHONPATH=. python bench/specialize_ptx.py [--only topk/v4_flash] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ["topk/v4_flash", "sparse_attn/v4_record", "sparse_attn/dense",
             "compress/r4_overlap_d512", "compress/r128_d512"]
KERNELS = ("_topk_rows_kernel", "_topk_chunks_kernel", "_topk_merge_kernel",
           "_sparse_attn_kernel", "_compress_entries_kernel", "_compress_entries_split_kernel")

CHILD = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import sm90_cases as c
names, kernels = json.loads(sys.argv[2]), set(json.loads(sys.argv[3]))
out = {"errors": {}, "launches": []}
compiled = {}
with c.RECORDER.active():
    for name in names:
        c.RECORDER.launches.clear()
        try:
            c.SCENARIOS[name]()
        except Exception as e:
            out["errors"][name] = repr(e)
        # Every launch in order (not one per distinct key: the knob merges keys), so that the
        # two runs line up launch by launch.
        runs = [l for l in c.RECORDER.launches if l.kernel_name in kernels]
        for i, launch in enumerate(runs):
            key = launch.key()
            if key not in compiled:
                compiled[key] = c.compile_launch(launch)
            k = compiled[key]
            ins = [l.strip() for l in k.asm["ptx"].splitlines()]
            ins = [l for l in ins if l and not l.startswith(("//", ".", "{", "}", "$"))
                   and not l.endswith(":")]
            loads = {}
            for l in ins:
                if re.match(r"(?:@!?%p\d+ )?ld\.global", l):
                    w = re.search(r"\.v(\d)", l)
                    kind = "v" + w.group(1) if w else "v1"
                    loads[kind] = loads.get(kind, 0) + 1
            out["launches"].append({"scenario": name, "i": i, "kernel": launch.kernel_name,
                                    "key": key, "instructions": len(ins), "loads": loads})
print("JSON" + json.dumps(out))
"""


def run(knob: str, names: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(DSV4_UNSPECIALIZED_LENGTHS=knob, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "tests" / "kernels"),
                          json.dumps(names), json.dumps(KERNELS)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("JSON")]
    if res.returncode != 0 or not line:
        raise RuntimeError(f"compile child failed (knob {knob}):\n{res.stderr[-4000:]}")
    return json.loads(line[-1][4:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="scenario (repeatable)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    names = a.only or SCENARIOS
    off, on = run("0", names), run("1", names)
    for what, r in (("off", off), ("on", on)):
        if r["errors"]:
            print(f"recording errors with the knob {what}: {r['errors']}")
    print(f"{'scenario':<24} {'#':>2} {'kernel':<30} {'instr off':>9} {'on':>6} "
          f"{'loads off (v4/v2/v1)':>21} {'on':>12}")
    print(f"binaries: {len({x['key'] for x in off['launches']})} with the knob off, "
          f"{len({y['key'] for y in on['launches']})} on")
    seen = set()
    for x, y in zip(off["launches"], on["launches"]):
        assert (x["scenario"], x["i"], x["kernel"]) == (y["scenario"], y["i"], y["kernel"])
        if x["key"] in seen:       # one row per binary of the knob-off run
            continue
        seen.add(x["key"])

        def ld(d: dict[str, int]) -> str:
            return "/".join(str(d.get(k, 0)) for k in ("v4", "v2", "v1"))
        print(f"{x['scenario']:<24} {x['i']:>2} {x['kernel']:<30} {x['instructions']:>9} "
              f"{y['instructions']:>6} {ld(x['loads']):>21} {ld(y['loads']):>12}")
    if a.json:
        Path(a.json).write_text(json.dumps({"off": off, "on": on}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
