"""Test-wide settings."""

import os

# fp32 CPU GEMMs through MKL are not bit-reproducible across buffer alignments (spec §6.13).
os.environ.setdefault("MKL_CBWR", "AVX2")
# The kernels not yet run on a GPU are off in the engine by default (dsv4.ops.UNVERIFIED_ON_GPU);
# the tests exercise them (interpreter, sm_90 compile, GPU checks).
os.environ.setdefault("DSV4_UNVERIFIED_KERNELS", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one intra-op thread: tiny GEMMs gain nothing from threads, and on a busy
    2-core machine the thread pool's spinning makes every op several times slower.  Opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")`` (engine/dist tests use it always)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
