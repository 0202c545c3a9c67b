"""The demo as a package (issue 15): the child-process room (`demo.process`: the listener's file,
the wait for its subscriptions, the ports) and what `kv_listener.demo` still exports for its
callers (the CLI, `bench/soak.py`). The whole demo runs in `test_demo.py`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

import kv_listener.demo as demo
from kv_listener.demo.process import (
    DemoError,
    free_ports,
    listener_config,
    wait_for_subscriptions,
    write_listener_config,
)


class Publisher:
    """An engine's publisher whose subscription arrives when `subscribed` is set."""

    def __init__(self) -> None:
        self.subscribed = asyncio.Event()

    async def wait_for_subscriber(self, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            await self.subscribed.wait()


def engine_server(name: str, zmq_port: int, http_port: int) -> Any:
    """What `listener_config` reads of an `EngineServer`: its engine's name and endpoints, its
    URL."""
    engine = SimpleNamespace(name=name, endpoint=f"tcp://127.0.0.1:{zmq_port}",
                             replay_endpoint=f"tcp://127.0.0.1:{zmq_port + 1}")
    return SimpleNamespace(engine=engine, url=f"http://127.0.0.1:{http_port}")


def test_the_listener_file_is_the_listener_config(tmp_path: Path) -> None:
    servers = [engine_server("vllm-1", 5000, 8001), engine_server("vllm-2", 5002, 8002)]
    path = write_listener_config(tmp_path, 7000, servers, "/tok")
    assert path == tmp_path / "listener.yaml"
    loaded = yaml.safe_load(path.read_text())
    assert loaded == listener_config(7000, servers, "/tok")
    assert loaded["listen"] == "127.0.0.1:7000"
    assert [s["detokenize_endpoint"] for s in loaded["sources"]] == [
        "http://127.0.0.1:8001/detokenize", "http://127.0.0.1:8002/detokenize"]


async def test_wait_for_subscriptions_returns_once_every_engine_is_subscribed() -> None:
    pubs = [Publisher(), Publisher()]
    engines = [SimpleNamespace(publisher=p) for p in pubs]
    waiting = asyncio.create_task(wait_for_subscriptions(engines, 5.0))
    pubs[1].subscribed.set()
    await asyncio.sleep(0)
    assert not waiting.done()  # the first engine has no subscriber yet
    pubs[0].subscribed.set()
    await asyncio.wait_for(waiting, 5.0)


async def test_a_missing_subscription_is_one_demo_error() -> None:
    pubs = [Publisher(), Publisher()]
    pubs[0].subscribed.set()
    engines = [SimpleNamespace(publisher=p) for p in pubs]
    with pytest.raises(DemoError, match="did not subscribe to the engines' event sockets"):
        await wait_for_subscriptions(engines, 0.05)


def test_free_ports_are_distinct() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


def test_the_package_exports_what_its_callers_import() -> None:
    # The CLI imports run_demo; bench/soak.py these (its import list, kept as it was).
    for name in ["run_demo", "CONNECT_TIMEOUT_S", "ENGINE_BLOCKS", "FINISH_TIMEOUT_S",
                 "LISTENER_START_TIMEOUT_S", "LISTENER_STOP_TIMEOUT_S", "MAX_OUTSTANDING", "SEED",
                 "SIGINT_GRACE_S", "DemoError", "ListenerProcess", "Totals", "free_ports",
                 "listener_config", "run_unless_stopped", "summary_line"]:
        assert name in demo.__all__ and hasattr(demo, name), name
    assert all(hasattr(demo, name) for name in demo.__all__)
