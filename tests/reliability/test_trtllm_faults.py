"""A TensorRT-LLM source beside the vLLM ones: its `/kv_cache_events` endpoint flapping (500s,
stalls, refusals while restarting), events lost to an answer that never arrived, each ending with
the convergence check (the TRT-LLM engine's pool == oracle == listener stream == routers)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.reliability.conftest import running_stack
from tests.reliability.harness import ENGINE_DOWN_AFTER_S, Stack, TrtllmTruthEngine
from tests.reliability.harness import messages as messages_of

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trt_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path_factory.mktemp("trtllm"), trtllm=True) as (st, _):
        await st.converge()
        yield st


def trt(stack: Stack) -> TrtllmTruthEngine:
    engine = stack.engine("trtllm-1")
    assert isinstance(engine, TrtllmTruthEngine)
    return engine


async def test_trtllm_baseline(trt_stack: Stack) -> None:
    t = trt(trt_stack)
    t.traffic(25, seed=90)
    held = await trt_stack.converge()
    assert held["trtllm-1"] >= 3 and t.core.pool.stats().evicted > 0


async def test_trtllm_endpoint_flapping(trt_stack: Stack) -> None:
    t = trt(trt_stack)
    for burst in range(6):  # runs of four failed polls, then a slow answer, six times over
        t.server.fail_next(500, times=2)
        t.server.fail_next(503, b"<html>busy</html>", times=2)
        t.server.stall_next(0.5)
        t.traffic(4, seed=91 + burst)
        await t.server.wait_polls(t.server.polls + 5, timeout_s=10)
    await trt_stack.converge()


async def test_trtllm_endpoint_restarting(trt_stack: Stack) -> None:
    t = trt(trt_stack)
    t.traffic(5, seed=100)
    running = t._running
    assert running is not None
    await running.close()  # connection refused for a moment, events still queued
    t.traffic(5, seed=101)
    t._running = await t.server.serve(port=t.port)
    await trt_stack.converge()
    assert ENGINE_DOWN_AFTER_S >= 3.0  # the outage above was shorter: no engine_down clear


async def test_trtllm_events_lost(trt_stack: Stack) -> None:
    t = trt(trt_stack)
    t.traffic(6, seed=110)
    await trt_stack.converge()
    for i in range(3):  # served by the engine, their events never delivered (an id gap)
        t.serve(messages_of(120 + i, i), 4, lost=True)
    t.forget()  # the listener clears at the gap; it can know what comes next
    t.traffic(10, seed=112)
    await trt_stack.converge()
    st = (await trt_stack.listener_stats())["sources"]["trtllm-1"]
    assert st["gaps"] == 1 and st["clears_by_reason"].get("gap") == 1, st
