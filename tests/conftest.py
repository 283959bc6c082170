"""Test-wide settings."""

import os

# fp32 CPU GEMMs through MKL are not bit-reproducible across buffer alignments (spec §6.13).
os.environ.setdefault("MKL_CBWR", "AVX2")
# The kernels not yet run on a GPU are off in the engine by default (dsv4.ops.UNVERIFIED_ON_GPU);
# the tests exercise them (interpreter, sm_90 compile, GPU checks).
os.environ.setdefault("DSV4_UNVERIFIED_KERNELS", "1")
# Under pytest-xdist (the README's command: ``-n 2`` on the 2-core CI machine) every worker, and
# the interpreter / torchrun children it starts, runs on one intra-op thread: two workers with a
# thread pool each oversubscribe the cores, and the pools' spinning makes every op several times
# slower (see ``one_thread`` below).  Set before torch is imported by any test module.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402

# Test files that take minutes (Triton-interpreter children, the sm_90 compiles; seconds on the
# 2-core CI machine, roughly): under xdist they are handed out first, so that the workers finish
# together instead of one of them starting a long file last.  Only the order changes; a file
# missing here just keeps its place.
_SLOW_FILES = {
    "test_interpreter.py": 560, "test_sm90_compile.py": 300, "test_moe_gemv.py": 130,
    "test_glue_plans.py": 150, "test_triton_compress.py": 105, "test_dense_prefill_interp.py": 80,
    "test_tp_static_decode.py": 60, "test_engine_tiny.py": 47, "test_triton_topk.py": 46,
    "test_static_shapes.py": 44, "test_fp8_gemv.py": 42, "test_tp_bench.py": 39,
    "test_compress_compact.py": 45,
}


def pytest_configure(config: pytest.Config) -> None:
    # xdist's --dist loadfile would hand files out by test count (--loadscope-reorder, its
    # default); the order of pytest_collection_modifyitems below is the better one here.
    if getattr(config.option, "dist", "no") != "no" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return                      # not an xdist worker: keep the files in their usual order
    items.sort(key=lambda item: -_SLOW_FILES.get(item.path.name, 0))   # stable: files stay whole


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
