"""dsv4.engine: the serving core (scheduler, cache manager, model runner, sampler, LLM).

Heavy modules (torch, the model) load lazily so that the control plane imports cheaply.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "SamplingParams": "dsv4.engine.sampling_params",
    "RequestOutput": "dsv4.engine.sampling_params",
    "CompletionOutput": "dsv4.engine.sampling_params",
    "Logprob": "dsv4.engine.sampling_params",
    "RequestMetrics": "dsv4.engine.sampling_params",
    "Scheduler": "dsv4.engine.scheduler",
    "LLMEngine": "dsv4.engine.llm_engine",
    "EngineOptions": "dsv4.engine.llm_engine",
    "LLM": "dsv4.engine.llm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dsv4.engine' has no attribute {name!r}")


__all__ = list(_LAZY)
