"""bench/prefill_attrib.py on the CPU (tiny widths): every op-table entry and module forward of
the model is wrapped in a named range, the op rows name the model's ops (the MoE, attention,
mHC) and the module rows its layers."""

from __future__ import annotations

import pytest

from bench import prefill_attrib as pa

pytestmark = pytest.mark.usefixtures("one_thread")


def test_attributes_a_tiny_prefill(capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.ops import get_ops
    monkeypatch.setattr(pa.fb, "DEV", pa.fb.DEV)     # main sets it: restored afterwards
    table = dict(vars(get_ops("triton")))
    assert pa.main(["--device", "cpu", "--tiny", "--layers", "3", "--tokens", "32",
                    "--rows", "50"]) == 0
    out = capsys.readouterr().out
    ops = {line.split(" | ")[0].strip("| ") for line in out.splitlines()
           if line.startswith("| op:")}
    assert {"op:sparse_attn", "op:hc_post_pre"} <= ops
    assert any(op.startswith("op:moe_experts") for op in ops)
    assert "| mod:layers.#.attn |" in out and "| mod:layers.#.ffn |" in out
    # The process's shared op table is left as it was.
    assert dict(vars(get_ops("triton"))) == table
