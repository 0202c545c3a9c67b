"""Faults on the engine side, each ending with the convergence check (engine pool == oracle ==
listener stream == both router indexes). One pipeline for the module; see harness.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.reliability.harness import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


async def test_baseline_traffic_converges(stack: Stack) -> None:
    for e in stack.engines.values():
        e.traffic(30, seed=1)
    held = await stack.converge()
    assert all(n >= 3 for n in held.values()), held
    # the small pool evicted: the convergence covered removals, not only stores
    assert all(e.core.pool.stats().evicted > 0 for e in stack.engines.values())


async def test_engine_restart_mid_stream(stack: Stack) -> None:
    a = stack.engine("vllm-1")
    a.traffic(10, seed=2)
    a.restart()  # empty cache, seq 0 again: the listener must clear, then follow the new engine
    a.traffic(12, seed=3)
    stack.engine("vllm-2").traffic(5, seed=3)
    held = await stack.converge()
    assert held["vllm-1"] >= 3


async def test_engine_restart_whose_first_batches_were_lost(stack: Stack) -> None:
    # The restarted engine's first batches never reached the listener (a subscriber not yet
    # connected again, a high-water mark): its first batch seen is above 0. They are in the
    # engine's replay buffer, so the listener must fetch them, not start from the third.
    a = stack.engine("vllm-1")
    a.traffic(6, seed=13)
    a.restart()
    a.publisher.drop_next(2)  # replayable
    a.traffic(10, seed=14)
    await stack.converge()


async def test_gap_covered_by_replay(stack: Stack) -> None:
    a = stack.engine("vllm-1")
    before = (await stack.listener_stats())["sources"]["vllm-1"]["replays"]
    a.publisher.drop_next(3)  # lost on the wire, still in the engine's replay buffer
    a.traffic(10, seed=4)
    await stack.converge()
    assert (await stack.listener_stats())["sources"]["vllm-1"]["replays"] == before + 1


async def test_gap_without_replay_resyncs(stack: Stack) -> None:
    a = stack.engine("vllm-1")
    a.publisher.drop_next(3, replayable=False)  # gone from the wire and the buffer
    a.traffic(3, seed=5)
    a.forget()  # the listener can only know what is stored from now on
    a.traffic(12, seed=6)
    await stack.converge()


async def test_replay_covering_only_part_of_the_gap_resyncs(stack: Stack) -> None:
    a = stack.engine("vllm-2")
    a.publisher.drop_next(2)  # replayable
    a.traffic(2, seed=7)
    a.publisher.drop_next(1, replayable=False)  # a hole in the buffer
    a.traffic(1, seed=7)
    a.forget()
    a.traffic(12, seed=8)
    await stack.converge()


async def test_engine_killed_then_back(stack: Stack) -> None:
    a = stack.engine("vllm-2")
    a.traffic(8, seed=9)
    await stack.converge()
    await a.die()
    await stack.listener.wait_log("engine_down", backend="vllm-2", timeout_s=15)
    await stack.converge()  # cleared everywhere: nothing of vllm-2 left
    assert not stack.views["vllm-2"].state
    await a.revive()
    a.traffic(10, seed=10)
    held = await stack.converge()
    assert held["vllm-2"] >= 3


DETOKENIZE_FAULTS = ["down", "500", "wrong_shape", "giant", "deep", "slow"]


@pytest.mark.parametrize("mode", DETOKENIZE_FAULTS)
async def test_detokenize_fault_then_back(stack: Stack, mode: str) -> None:
    # New system prompts need /detokenize: their chains wait (bounded) and resolve once it
    # answers again; the other backend and the HTTP server are not held meanwhile.
    a, b = stack.engine("vllm-1"), stack.engine("vllm-2")
    http = a.http
    if mode == "down":
        await http.down()
    else:
        http.faulted.clear()
        http.mode = mode
    try:
        # system prompts never served before: each needs /detokenize
        a.traffic(8, systems=4, seed=11, first=100 + 10 * DETOKENIZE_FAULTS.index(mode))
        b.traffic(8, seed=12)
        assert await stack.healthz() == 200
        # The fault lasts until the listener met it.
        if mode == "down":
            await stack.listener.wait_log("detokenize_failed", backend="vllm-1", timeout_s=15)
        else:
            async with asyncio.timeout(15):
                await http.faulted.wait()
    finally:
        if mode == "down":
            await http.up()
        http.mode = None
    await stack.converge(timeout_s=45)



async def test_chain_evicted_while_its_detokenize_is_slow(stack: Stack) -> None:
    # Chains whose /detokenize answer is late get evicted before it arrives (and other chains
    # take their blocks): the late answers must not bring back prefixes the engine dropped.
    a = stack.engine("vllm-1")
    a.http.faulted.clear()
    a.http.delay_s = 1.0
    a.http.mode = "slow"
    try:
        a.traffic(6, systems=6, seed=20, first=200)
        async with asyncio.timeout(15):
            await a.http.faulted.wait()
        a.traffic(40, systems=8, seed=21, first=300)  # evicts most of the 200s' blocks
    finally:
        a.http.mode = None
    await stack.converge(timeout_s=45)
