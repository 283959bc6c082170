"""``picked_rows`` (top-k entry ids -> pool rows through the per-token row tables): the Triton
kernel against its torch twin in the interpreter (a child process, as the other interpreter
files), and on the GPU at decode / prefill shapes (skipped without CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsv4.ops import torch_index as twin


def _case(T: int, L: int, k: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.randint(-1, 10_000, (T, L), generator=gen, device=device, dtype=torch.int32)
    table = torch.cat((rows, rows.new_full((T, 1), -1)), dim=1)
    ids = torch.randint(-1, L, (T, k), generator=gen, device=device)
    return table, ids


def test_twin_maps_blanks_to_minus_one() -> None:
    table, ids = _case(3, 5, 4, "cpu", 0)
    ids[0, 0] = -1
    out = twin.picked_rows(table, ids)
    assert out.dtype == torch.int32 and out[0, 0] == -1
    assert torch.equal(out[1], table[1, ids[1]])
    with pytest.raises(ValueError, match="picked_rows"):
        twin.picked_rows(table[0], ids)


_CHILD = """
import torch
from dsv4.ops import torch_index as twin, triton_index as tri
from tests.kernels.test_picked_rows import _case
for T, L, k, seed in ((1, 7, 4, 1), (5, 300, 64, 2), (2, 2048, 512, 3), (3, 9, 1, 4)):
    table, ids = _case(T, L, k, "cpu", seed)
    assert torch.equal(tri.picked_rows(table, ids), twin.picked_rows(table, ids)), (T, L, k)
    # non-contiguous ids (a column slice), int32 ids
    wide = torch.cat((ids, ids), dim=1)[:, ::2]
    assert torch.equal(tri.picked_rows(table, wide), twin.picked_rows(table, wide))
    assert torch.equal(tri.picked_rows(table, ids.int()), twin.picked_rows(table, ids))
assert tri.picked_rows(*_case(0, 4, 3, "cpu", 5)).shape == (0, 3)
print("ok")
"""


def test_kernel_equals_twin_in_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,L,k", [(1, 2048, 512), (64, 2048, 512), (4096, 8192, 512)])
def test_kernel_equals_twin_gpu(T: int, L: int, k: int) -> None:
    from dsv4.ops import triton_index as tri
    table, ids = _case(T, L, k, "cuda", T)
    assert torch.equal(tri.picked_rows(table, ids), twin.picked_rows(table, ids))
