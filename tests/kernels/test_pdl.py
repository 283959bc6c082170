"""The programmatic-dependent-launch contract of ``dsv4.ops.pdl``, checked on the source.

With PDL a kernel's blocks may run while the previous kernel of the stream still does, so a
kernel that touches global memory before its grid dependency wait races with it; a launch that
passes ``launch_pdl=True`` to a kernel compiled without the wait loses the ordering altogether.
These tests read every Triton and Gluon module of ``dsv4.ops``: each kernel (a ``@triton.jit``
or ``@gluon.jit`` function named ``*_kernel``) takes ``PDL: tl.constexpr = False`` (Gluon:
``gl.constexpr``) and calls ``grid_dependency_sync(PDL)``
as its first statement, and each launch (``kernel[grid](...)``) passes ``**pdl_args(...)``.
The GPU side (same bits with PDL on and off, eager and in CUDA graphs) is
``tests/model/test_side_stream_gpu.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

OPS = Path(__file__).resolve().parents[2] / "dsv4" / "ops"
TRITON_MODULES = sorted(OPS.glob("triton_*.py")) + sorted(OPS.glob("gluon_*.py"))


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).startswith(("triton.jit", "gluon.jit", "jit"))
               for d in fn.decorator_list)


def _kernels(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and _is_jit(n) and n.name.endswith("_kernel")]


def _launches(tree: ast.Module) -> list[ast.Call]:
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]


def test_modules_found() -> None:
    assert len(TRITON_MODULES) >= 10
    assert sum(len(_kernels(ast.parse(p.read_text()))) for p in TRITON_MODULES) >= 30


@pytest.mark.parametrize("path", TRITON_MODULES, ids=lambda p: p.name)
def test_every_kernel_waits_first(path: Path) -> None:
    for fn in _kernels(ast.parse(path.read_text())):
        args = fn.args.args
        assert args and args[-1].arg == "PDL", f"{fn.name}: last parameter must be PDL"
        assert ast.unparse(args[-1].annotation) in ("tl.constexpr", "gl.constexpr"), fn.name
        assert fn.args.defaults and ast.unparse(fn.args.defaults[-1]) == "False", \
            f"{fn.name}: PDL must default to False (plain launches)"
        body = fn.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]                                   # the docstring
        assert ast.unparse(body[0]) == "grid_dependency_sync(PDL)", \
            f"{fn.name}: the first statement must be grid_dependency_sync(PDL)"


@pytest.mark.parametrize("path", TRITON_MODULES, ids=lambda p: p.name)
def test_every_launch_passes_pdl_args(path: Path) -> None:
    for call in _launches(ast.parse(path.read_text())):
        spread = [k for k in call.keywords if k.arg is None]
        assert any(ast.unparse(k.value).startswith("pdl_args(") for k in spread), \
            f"{path.name}:{call.lineno}: launch without **pdl_args(...)"
        assert not any(k.arg in ("launch_pdl", "PDL") for k in call.keywords), \
            f"{path.name}:{call.lineno}: PDL / launch_pdl only through pdl_args"


def test_pdl_args_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.ops import pdl

    x = torch.zeros(2)
    monkeypatch.setattr(pdl, "_FORCE", False)
    assert pdl.pdl_args(x) == {}                       # CPU tensor: plain launch
    monkeypatch.setattr(pdl, "_FORCE", True)           # the offline sm_90 compile's setting
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DSV4_PDL", "1")
    on = {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_args(x) == on
    with pdl.model_step(pdl.PDL_MAX_TOKENS):
        assert pdl.pdl_args(x) == on
        with pdl.model_step(pdl.PDL_MAX_TOKENS + 1):    # a large step: plain launches
            assert pdl.pdl_args(x) == {}
        assert pdl.pdl_args(x) == on
    monkeypatch.setenv("DSV4_PDL_MAX_TOKENS", "64")
    with pdl.model_step(64):
        assert pdl.pdl_args(x) == on
    monkeypatch.delenv("DSV4_PDL")
    with pdl.model_step(1, distributed=True):           # TP / EP: only when asked for
        assert pdl.pdl_args(x) == {}
    monkeypatch.setenv("DSV4_PDL", "1")
    with pdl.model_step(1, distributed=True):
        assert pdl.pdl_args(x) == on
    monkeypatch.setenv("DSV4_PDL", "0")
    assert pdl.pdl_args(x) == {}
    monkeypatch.setenv("DSV4_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")        # the interpreter has no inline asm
    assert pdl.pdl_args(x) == {}


def test_model_forward_is_one_model_step() -> None:
    """The model's forward sets the step size that decides PDL for its launches."""
    from types import SimpleNamespace

    from dsv4.model import transformer
    from dsv4.ops import pdl

    seen: list[bool | None] = []
    model = SimpleNamespace(cfg=SimpleNamespace(is_v41=False),
                            parallel=SimpleNamespace(enabled=False),
                            _forward_v4=lambda ctx, cache: seen.append(pdl._step_pdl))
    for tokens in (pdl.PDL_MAX_TOKENS, pdl.PDL_MAX_TOKENS + 1):
        ctx = SimpleNamespace(input_ids=torch.zeros(tokens, dtype=torch.long))
        transformer.Transformer.forward.__wrapped__(model, ctx, None)  # under torch.no_grad
    assert seen == [pdl.pdl_enabled(), False] and pdl._step_pdl is None
