"""bench/glue_count.py: the per-source kernel count of a static decode step (torch table, so no
interpreter): every layer is attributed, views are not counted, and the MoE's counts are the
ones its code launches (gate: cast + GEMM + one routing op; the fused ops' twins run torch ops
attributed to their own functions)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "glue_count.py"
pytestmark = pytest.mark.usefixtures("one_thread")


def _load():
    spec = importlib.util.spec_from_file_location("glue_count", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["glue_count"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_counts_a_static_decode_step_by_source(capsys: pytest.CaptureFixture) -> None:
    gc = _load()
    model = gc.build(3, "torch")                 # window+hash, window+hash, CSA r4+hash
    tally = gc.count_step(model, 2, 20)
    kinds = gc.layer_kinds(model.cfg)
    assert list(kinds.values()) == ["0:window+hash", "1:window+hash", "2:CSAr4+hash"]
    ops = {op for (_m, _f, op) in tally.kernels}
    assert not ops & {f"aten.{n}" for n in ("view", "empty", "expand", "t", "as_strided")}
    assert all(op.startswith("aten.") for op in ops)       # torch table: no Triton launch
    gate: dict[str, int] = {}
    for (m, f, op), n in tally.kernels.items():
        if f.endswith("Gate.forward") or (m.endswith(".gate") and f.endswith(
                (":linear_fp32", ":batch_invariant_linear"))):
            gate[op] = gate.get(op, 0) + n
    # x.float(), w.float() (the bf16-held gate weight of quantized storage) and the GEMM per
    # layer, in linear_fp32's twin (which on CPU pads 2 rows to 4).
    assert gate == {"aten._to_copy": 6, "aten.mm": 3, "aten.new_zeros": 3, "aten.cat": 3}
    route = sum(n for (m, f, op), n in tally.kernels.items() if "torch_route.py:moe_route" in f)
    assert route > 3 * 5                                      # the unfused twin: many kernels
    data = gc.report(tally, top=5)
    assert data["total"] == sum(tally.kernels.values())
    assert set(kinds.values()) <= set(data["per_layer"])
    assert all(v > 0 for v in data["per_layer"].values())
    assert "per layer kind" in capsys.readouterr().out
    # Host reads: only the torch expert twin's (the CPU path; the Triton table has none).
    assert {f for (_m, f, _op) in tally.syncs} <= {"ops/torch_dense.py:moe_experts"}
