"""The bounded load test of issue 6: 64 concurrent streaming clients × 3 rounds on loopback
against the real server and the tiny model; every response well formed, no leaked pages
(``bench/server_load.py`` checks both and returns non-zero otherwise)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "server_load.py"


def test_64_clients_3_rounds_well_formed_and_no_leak(capsys) -> None:
    spec = importlib.util.spec_from_file_location("server_load", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["server_load"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    rc = mod.main(["--clients", "64", "--rounds", "3", "--max-tokens", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "192/192 responses well formed; no pages leaked" in out
    assert "req/s" in out and "TTFT ms" in out
