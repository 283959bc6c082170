"""The worker loop of ranks > 0 in a tensor / expert parallel launch.

Rank 0 (the driver) runs the scheduler, the sampler and, for ``dsv4 serve``, the HTTP server.
For each step its model runner broadcasts a :class:`dsv4.engine.runner.StepPlan` over the control
group and then runs the forward; every other rank sits in :func:`run_worker`, receives the same
plan and runs the same forward, so the collectives inside the model (all-reduce of the attention
output and of the MoE partials, Engram rows) meet.  A plan marked ``static`` is a decode step
that every rank runs as the same bucket's static-shape step (CUDA-graph capture or replay with
``cuda_graphs_under_tp``; eagerly on CPUs).  The driver ends the loop with
:func:`stop_workers`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dsv4")

__all__ = ["Stop", "run_worker", "stop_workers"]


@dataclass(frozen=True)
class Stop:
    """The driver's last message: the workers leave their loop."""

    reason: str = "shutdown"


def run_worker(runner: Any) -> int:
    """Run the driver's steps on this rank until it sends :class:`Stop`; returns the number of
    steps run.  ``runner`` is this rank's :class:`dsv4.engine.runner.ModelRunner`.

    A step that raises is logged and skipped: the driver runs the same deterministic forward,
    hits the same error at the same point (before any collective the two would disagree on),
    and reports it to its caller while the engine keeps serving.
    """
    from dsv4.engine.runner import StepPlan

    par = runner.parallel
    if not par.enabled or par.is_driver:
        raise ValueError(f"run_worker: this process is {par.describe()}; only ranks > 0 of a "
                         "parallel launch run the worker loop")
    steps = 0
    while True:
        kind, msg = par.receive()
        if kind == "static":
            try:
                runner.run_worker_static(msg)
            except Exception:  # noqa: BLE001 - the driver reports the same error to its caller
                log.exception("dsv4 worker rank %d: static step failed", par.rank)
            steps += 1
            continue
        if isinstance(msg, Stop):
            log.info("dsv4 worker rank %d: %s after %d steps", par.rank, msg.reason, steps)
            return steps
        if not isinstance(msg, StepPlan):
            raise ValueError(f"run_worker: expected a StepPlan or Stop from rank 0; got "
                             f"{type(msg).__name__}")
        try:
            runner.run_worker_step(msg)
        except Exception:  # noqa: BLE001 - the driver reports the same error to its caller
            log.exception("dsv4 worker rank %d: step failed", par.rank)
        steps += 1


def stop_workers(parallel: Any, reason: str = "shutdown") -> None:
    """Driver side: tell every worker to leave :func:`run_worker` (no-op on one process)."""
    if parallel.enabled and parallel.is_driver:
        parallel.send(Stop(reason))
