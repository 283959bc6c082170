"""bench/sass_launch.py: one recorded launch compiled for sm_90 offline and counted (skipped
where Triton's CUDA tools are not installed)."""

from __future__ import annotations

import os

import pytest
import triton

from bench import sass_launch

TOOL = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


@pytest.mark.skipif(not os.path.exists(TOOL) or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton's cuobjdump and no interpreter")
def test_counts_one_launch(capsys: pytest.CaptureFixture, tmp_path) -> None:
    pattern = "_hc_post_mix_kernel.*BT=64, BD=16, PRECISION='tf32x3'.*GATES_ONCE=False"
    dump = tmp_path / "loop.sass"
    assert sass_launch.main(["glue_plans/v4_flash", pattern, "--top", "3",
                             "--dump", str(dump)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "_hc_post_mix_kernel" in out[0]
    assert "instructions; loop " in out[1] and "FFMA" in out[1]
    loop = dump.read_text().splitlines()
    assert loop[0].startswith("# dsv4.ops.triton_mhc._hc_post_mix_kernel")
    assert any("HGMMA" in line for line in loop[1:])
    with pytest.raises(SystemExit, match="no launch"):
        sass_launch.main(["glue_plans/v4_flash", "no_such_kernel"])
