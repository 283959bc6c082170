"""``DSV4_UNSPECIALIZED_LENGTHS`` (dsv4.ops.specialize): off by default the kernels are decorated
as before; on, each named length is a real parameter of its kernel (Triton ignores a name it
does not know) and leaves it unspecialized."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = {"dsv4.ops.triton_topk": ["_topk_rows_kernel", "_topk_chunks_kernel",
                                    "_topk_merge_kernel"],
           "dsv4.ops.triton_attn": ["_sparse_attn_kernel"],
           "dsv4.ops.triton_compress": ["_compress_entries_kernel",
                                        "_compress_entries_split_kernel"],
           "dsv4.ops.triton_records": ["_write_records_kernel"]}
PROBE = """
import importlib, inspect, json, sys
out = {}
for mod, names in json.loads(sys.argv[1]).items():
    m = importlib.import_module(mod)
    for n in names:
        k = getattr(m, n)
        sig = inspect.signature(k.fn).parameters
        params = [p for p, v in sig.items() if "constexpr" not in str(v.annotation)]
        dns = list(getattr(k, "do_not_specialize", None)
                   or getattr(k, "kwargs", {}).get("do_not_specialize") or [])
        out[n] = {"dns": dns, "params": params}
print(json.dumps(out))
"""


def _probe(knob: str) -> dict:
    env = dict(os.environ, DSV4_UNSPECIALIZED_LENGTHS=knob, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(KERNELS)], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_lengths_are_parameters_and_off_by_default() -> None:
    on = _probe("1")
    for name, k in on.items():
        assert k["dns"], name
        assert set(k["dns"]) <= set(k["params"]), (name, k["dns"])
        # Run-time lengths: neither constexpr plans (not in params) nor pointers.
        assert not any(n.endswith("_ptr") for n in k["dns"]), (name, k["dns"])
    off = _probe("0")
    assert all(not k["dns"] for k in off.values()), off
