"""dsv4: a compact Python + Triton inference engine for the DeepSeek-V4 family."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": ("dsv4.config", "ModelConfig"),
    "load_model": ("dsv4.model.transformer", "load_model"),
    "LLM": ("dsv4.engine.llm", "LLM"),
    "SamplingParams": ("dsv4.engine.sampling_params", "SamplingParams"),
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import dsv4` stays cheap and the control plane imports without a model.
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")


__all__ = list(_LAZY)
