"""Fixtures: a FakeEngine served for real on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsv4.server.app import build_app
from dsv4.server.async_engine import AsyncEngine
from server_fakes import MODEL, FakeEngine, ServerThread, wait_until


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[FakeEngine, AsyncEngine, ServerThread]]:
    engine = FakeEngine()
    async_engine = AsyncEngine(engine, idle_poll_s=0.05)
    app = build_app(async_engine, model_name=MODEL)
    with ServerThread(app) as srv:
        yield engine, async_engine, srv
    assert not async_engine.running


@pytest.fixture()
def served(fake_server: tuple) -> Iterator[tuple[FakeEngine, AsyncEngine, ServerThread]]:
    """The shared server, with the fake engine reset and checked idle after the test."""
    engine, async_engine, srv = fake_server
    engine.script = lambda prompt, i: "Hello from the fake engine."
    engine.step_delay = 0.0
    engine.fail_next_step = False
    yield engine, async_engine, srv
    assert wait_until(lambda: not engine.has_unfinished_requests(), 10)
    engine.check_idle()
    assert len(engine.thread_ids) <= 1  # every engine call came from the one engine thread
