"""SGLang's REAL KV-event publisher code, driven like SGLang's scheduler drives it, for the
`engines` tests (issue #10). Two halves in one file:

- the **driver** (`python -m tests.engines.sglang_real --sglang-dir DIR` from the repository
  root, run with `.venv-engines/bin/python`, never the project's `.venv`): loads SGLang 0.5.23's
  own modules from the unpacked wheel in `.venv-engines/sglang-0.5.23/` without SGLang's
  top-level package `__init__` (it imports the whole server): `sglang.srt.disaggregation.
  kv_events` (`ZmqEventPublisher` built by `EventPublisherFactory` from a `--kv-events-config`
  JSON, `KVEventBatch`, the replay ROUTER), `sglang.srt.mem_cache.events`
  (`KVCacheEventRecorder`: per-page hashing with SGLang's native C++ hash, parent links,
  `cache_salt`, coalescing) and `sglang.srt.mem_cache.radix_cache` (`RadixCache.
  create_simulated`, the real radix tree that calls the recorder). It reads JSON commands on
  stdin and answers one JSON line each on its own copy of stdout. `--self-check` only loads the
  modules, builds the native hash (cached in `.venv-engines/torch-extensions/`) and checks it
  against wire-formats §7.7;
- the **host side** (`SglangDriver`, `SglangEngine`, `connect_engine`), imported by the tests
  in the project's `.venv`: it starts the driver and opens engine instances in it; the tests
  tap the live stream with `tests.engines.tap.ZmqTap`.

How SGLang 0.5.23 drives the recorder (read from the wheel; the driver does the same):

- `RadixCache.__init__` -> `reset()` -> `record_all_cleared()`: an engine's first batch (seq 0)
  is `[AllBlocksCleared]`. `flush_cache` calls `reset()` again.
- A request arriving: `match_prefix` (`_match_prefix_helper`) splits the node where the match
  ends inside it (`_split_node`: the hash lists are split, no event).
- Prefill done: `checkpoint_kv_cache` -> `RadixCache.checkpoint(up_to=extend_end)` ->
  `_insert_cache(split_prompt=True)`: `insert` of the page-aligned key; `_insert_helper` splits
  nodes on the way and `record_store(new_node)` only for the new leaf (one `BlockStored` per
  page, coalesced into one event per node: parent = the parent node's last page hash, or None
  under the root).
- Request finished: `release_kv_cache(checkpoint=True)` -> `checkpoint(up_to=owned_kv_len)`
  (prompt + output without its last token, which has no KV), then the prompt re-inserted so the
  leaf splits at the prompt boundary.
- Memory pressure: `evict(EvictParams(num_tokens))` pops LRU leaves, `record_remove(leaf)` each
  (the parent becomes a leaf and may go next).
- Each scheduler step: `SchedulerKvEventsPublisher.publish_kv_events`: `take_events()`, and one
  `KVEventBatch(ts=time.time(), events=...)` when there are any.

What the driver stubs, and nothing else: the package object `sglang` (its `__init__` imports the
frontend language and the server); `sglang.srt.mem_cache.memory_pool` (imported by
`base_prefix_cache` for one type name; the real module imports every model config, which needs
torchvision) and `sglang.srt.observability.metrics_collector` (its names are only used when
metrics are on). Token IDs never leave the driver except inside the engine's own ZMQ payloads;
errors are reported by type and location only (SGLang's `RadixKey` repr shows token IDs).

Not covered: SGLang 0.5.23's default server cache is `UnifiedRadixCache`, whose default
TreeCore is a bundled Rust extension that records events in Rust (`record_store_event`); this
harness runs the Python recorder of `mem_cache/events.py` that `RadixCache` (and the Python
TreeCore) call.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.engines.paths import ENGINES_PYTHON, ENGINES_VENV, ROOT, SGLANG_DIR

if TYPE_CHECKING:
    from tests.engines.tap import ZmqTap

SGLANG_VERSION = SGLANG_DIR.name.removeprefix("sglang-")
SGLANG_MARKER = ENGINES_VENV / f".installed-sglang-{SGLANG_VERSION}"
#: Where torch's JIT builds SGLang's native hash (`mem_cache/cpp_utils/hash_binding.cpp`) once;
#: kept with the engine venv so a test run does not rebuild it (about 7 s on 2 cores).
TORCH_EXTENSIONS_DIR = ENGINES_VENV / "torch-extensions"
#: Wire-formats §7.7: SGLang's hashes of pages [1,2,3,4], [5,6,7,8] (first 8 bytes, signed).
HASH_VECTOR = ([1, 2, 3, 4, 5, 6, 7, 8], 4, [-3488128144981237669, 5674439469042975057])
START_TIMEOUT_S = 90.0  # imports (~3 s) plus a first native-hash build (~7 s) on 2 shared cores
CALL_TIMEOUT_S = 20.0


# =============================================================================================
# Driver side: runs in .venv-engines/bin/python. Standard library at module level only.
# =============================================================================================


class DriverError(Exception):
    """A command the driver refuses; its message holds no token IDs or salts."""


def _load_sglang(sglang_dir: Path) -> types.SimpleNamespace:
    """Import SGLang's real modules from the unpacked wheel (see the module docstring)."""
    sys.path.insert(0, str(sglang_dir))  # dist-info for importlib.metadata lookups
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(sglang_dir / "sglang")]
    pkg.__file__ = None
    sys.modules["sglang"] = pkg
    memory_pool = types.ModuleType("sglang.srt.mem_cache.memory_pool")
    memory_pool.ReqToTokenPool = type("ReqToTokenPool", (), {})  # type: ignore[attr-defined]
    sys.modules[memory_pool.__name__] = memory_pool
    metrics = types.ModuleType("sglang.srt.observability.metrics_collector")
    for name in ("STAT_LOGGER_ROLE_RADIX_CACHE", "RadixCacheMetricsCollector",
                 "radix_cache_metric_labels", "resolve_collector_class"):
        setattr(metrics, name, None)
    sys.modules[metrics.__name__] = metrics

    import importlib  # noqa: PLC0415 - after the stubs are in place

    kv_events = importlib.import_module("sglang.srt.disaggregation.kv_events")
    events = importlib.import_module("sglang.srt.mem_cache.events")
    utils = importlib.import_module("sglang.srt.mem_cache.utils")
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    for mod in (kv_events, events, radix):
        if not str(getattr(mod, "__file__", "")).startswith(str(sglang_dir)):
            raise DriverError(f"{mod.__name__} did not load from {sglang_dir}")
    return types.SimpleNamespace(kv_events=kv_events, events=events, utils=utils, radix=radix,
                                 base=base)


class _HostAllocator:
    """`RadixCache.create_simulated(mock_allocator=...)`: the tree frees KV slots of evicted
    nodes here; no memory pool exists without a GPU."""

    device = "cpu"

    def free_segment(self, *_args: Any, **_kwargs: Any) -> None:
        return None


class _Engine:
    """One SGLang engine instance: a real RadixCache with KV events on, and a real
    ZmqEventPublisher made by EventPublisherFactory from a --kv-events-config JSON."""

    def __init__(self, sgl: types.SimpleNamespace, tokenizer: Any, *, endpoint: str,
                 replay_endpoint: str | None, page_size: int, topic: str,
                 buffer_steps: int) -> None:
        self.sgl = sgl
        self.tokenizer = tokenizer
        self.page_size = page_size
        self.tree = sgl.radix.RadixCache.create_simulated(
            mock_allocator=_HostAllocator(), page_size=page_size, enable_kv_cache_events=True)
        config = {"publisher": "zmq", "endpoint": endpoint, "topic": topic,
                  "buffer_steps": buffer_steps}
        if replay_endpoint is not None:
            config["replay_endpoint"] = replay_endpoint
        self.publisher = sgl.kv_events.EventPublisherFactory.create(json.dumps(config), 0)
        # The scheduler's first loop iteration publishes the tree's AllBlocksCleared (seq 0).
        self.first_seqs = self.step()

    @property
    def replay_endpoint(self) -> str | None:
        # Bound by SGLang's own code: a `tcp://127.0.0.1:*` request resolves to the real port.
        return self.publisher._local_replay_endpoint  # type: ignore[no-any-return]

    def step(self) -> list[int]:
        """`SchedulerKvEventsPublisher.publish_kv_events`, then wait until the publisher thread
        has sent the batch (it appends to its replay buffer after `send_multipart`)."""
        events = self.tree.take_events()
        if not events:
            return []
        batch = self.sgl.kv_events.KVEventBatch(ts=time.time(), events=events)
        self.publisher.publish(batch)
        q = self.publisher._event_queue
        with q.all_tasks_done:
            if not q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout=10):
                raise DriverError("SGLang's publisher thread did not send the batch in 10 s")
        return [self.publisher._buffer[-1][0]]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token IDs as SGLang's chat server makes them. 0.5.23 renders the template to text and
        encodes it (`_render_and_encode_chat_template`, without added specials when the tokenizer
        adds them itself), or `apply_chat_template(tokenize=True, return_dict=False)` when that
        round trip is lossy; the two must agree for the fixture tokenizers."""
        tok = self.tokenizer
        ids = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                           return_dict=False))
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       return_dict=False)
        auto_specials = len(tok.encode("")) > 0
        via_text = list(tok.encode(text, **({"add_special_tokens": False} if auto_specials else {})))
        if via_text != ids:
            raise DriverError("apply_chat_template(tokenize=True) and SGLang's render+encode "
                              "path disagree for this tokenizer")
        return ids

    def _key(self, token_ids: Sequence[int], cache_salt: str | None) -> Any:
        # Req.full_untruncated_fill_ids is an array('q'); RadixKey compares typecodes.
        return self.sgl.radix.RadixKey(array("q", token_ids), None, is_bigram=False,
                                       cache_salt=cache_salt)

    def _insert_cache(self, token_ids: list[int], prompt_len: int, cache_salt: str | None) -> None:
        """`RadixCache._insert_cache(req, token_ids, split_prompt=True)` without a Req: the
        page-aligned key goes in, then the prompt's, so the leaf splits at the prompt end."""
        base = self.sgl.base
        key = self._key(token_ids, cache_salt).page_aligned(self.page_size)
        self.tree.insert(base.InsertParams(key=key, value=None, priority=0))
        prompt_key = self._key(token_ids[:prompt_len], cache_salt).page_aligned(self.page_size)
        if 0 < len(prompt_key) < len(key):
            self.tree.insert(base.InsertParams(key=prompt_key, value=None, priority=1))

    def chat(self, messages: list[dict[str, Any]], reply: str,
             cache_salt: str | None) -> dict[str, Any]:
        prompt = self.prompt_ids(messages)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DriverError("tokenizer has no eos_token_id")
        output = [*self.tokenizer.encode(reply, add_special_tokens=False), int(eos)]
        base = self.sgl.base
        # Arrival: the scheduler matches the prompt (splitting a node where the match ends).
        self.tree.match_prefix(base.MatchPrefixParams(key=self._key(prompt, cache_salt)))
        # Prefill done: checkpoint(up_to=len(prompt)).
        self._insert_cache(prompt, len(prompt), cache_salt)
        seqs = self.step()
        # Finished: release_kv_cache -> checkpoint(up_to=owned_kv_len); the last output token
        # was sampled but never run through the model, so it has no KV.
        full = prompt + output[:-1]
        self._insert_cache(full, len(prompt), cache_salt)
        seqs += self.step()
        cached = len(full) // self.page_size * self.page_size
        return {"seqs": seqs, "prompt_tokens": len(prompt), "cached_tokens": cached}

    def evict(self, num_tokens: int) -> dict[str, Any]:
        result = self.tree.evict(self.sgl.base.EvictParams(num_tokens=num_tokens))
        return {"seqs": self.step(), "evicted_tokens": result.num_tokens_evicted}

    def flush(self) -> dict[str, Any]:
        self.tree.reset()  # Scheduler.flush_cache -> tree_cache.reset()
        return {"seqs": self.step()}

    def close(self) -> None:
        self.publisher.shutdown()
        # SGLang registers shutdown() with atexit; a second one at exit waits its 1 s again.
        atexit.unregister(self.publisher.shutdown)


class _Driver:
    def __init__(self, sgl: types.SimpleNamespace) -> None:
        self.sgl = sgl
        self.engines: dict[int, _Engine] = {}
        self.tokenizers: dict[str, Any] = {}
        self.closers: list[threading.Thread] = []
        self.next_id = 1

    def tokenizer(self, directory: str) -> Any:
        if directory not in self.tokenizers:
            from transformers import AutoTokenizer  # noqa: PLC0415 - the engine venv's

            self.tokenizers[directory] = AutoTokenizer.from_pretrained(directory,
                                                                       local_files_only=True)
        return self.tokenizers[directory]

    def engine(self, cmd: dict[str, Any]) -> _Engine:
        try:
            return self.engines[int(cmd["engine"])]
        except (KeyError, ValueError, TypeError):
            raise DriverError("unknown engine id") from None

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("op")
        if op == "open":
            engine = _Engine(self.sgl, self.tokenizer(str(cmd["tokenizer"])),
                             endpoint=str(cmd["endpoint"]),
                             replay_endpoint=cmd.get("replay_endpoint"),
                             page_size=int(cmd["page_size"]), topic=str(cmd.get("topic", "")),
                             buffer_steps=int(cmd.get("buffer_steps", 10_000)))
            eid, self.next_id = self.next_id, self.next_id + 1
            self.engines[eid] = engine
            return {"engine": eid, "replay_endpoint": engine.replay_endpoint,
                    "seqs": engine.first_seqs}
        if op == "chat":
            return self.engine(cmd).chat(list(cmd["messages"]), str(cmd["reply"]),
                                         cmd.get("cache_salt"))
        if op == "evict":
            return self.engine(cmd).evict(int(cmd["num_tokens"]))
        if op == "flush":
            return self.engine(cmd).flush()
        if op == "close":
            engine = self.engines.pop(int(cmd["engine"]))
            if cmd.get("wait"):  # an engine restart: its ports must be free again
                replay = engine.replay_endpoint
                engine.close()
                _wait_port_free(replay)
                return {}
            # SGLang's shutdown() can wait its full 1 s timeout (its thread may exit before
            # taking the sentinel); nothing depends on it, so it runs beside the next commands.
            closer = threading.Thread(target=engine.close, name="sglang-close")
            closer.start()
            self.closers.append(closer)
            return {}
        raise DriverError(f"unknown op {op!r}")


def _wait_port_free(endpoint: str | None, timeout_s: float = 5.0) -> None:
    """Until nothing listens on a `tcp://host:port` endpoint (bounded). pyzmq's `close()`
    returns before libzmq's I/O thread has closed the socket, so the next engine's bind of the
    same replay port could fail (EADDRINUSE: seen once on CI, 2026-12-04). The probe sets
    SO_REUSEADDR as libzmq does: a connection left in TIME_WAIT does not hold it up."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, int(port)))
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise DriverError(f"replay port still in use {timeout_s:.0f} s after "
                                      "the publisher closed") from None
        time.sleep(0.01)  # libzmq's I/O thread gives no signal to wait on: bounded above


def _describe(exc: BaseException, *, messages: bool = False) -> str:
    """Type and code locations only: messages may carry token IDs (RadixKey's repr). With
    `messages` (loading, before any token exists) the messages of the whole cause chain too:
    a failed native-hash build names the missing compiler or header there."""
    where = [f"{Path(f.filename).name}:{f.lineno}:{f.name}"
             for f in traceback.extract_tb(exc.__traceback__)[-6:]]
    detail = str(exc) if messages or isinstance(exc, DriverError) else ""
    text = f"{type(exc).__name__}({detail}) at {' <- '.join(reversed(where))}"
    cause = exc.__cause__ or exc.__context__
    if messages and cause is not None:
        text += f"; caused by {type(cause).__name__}: {str(cause)[-2000:]}"
    return text


def _self_check(sgl: types.SimpleNamespace) -> None:
    """SGLang's native page hash against wire-formats §7.7 (also builds it on first use)."""
    tokens, page, want = HASH_VECTOR
    got = [sgl.utils.hash_str_to_int64(h) for h in sgl.utils.get_hash_str(tokens, None, page)]
    if got != want:
        raise DriverError("SGLang's native hash does not match the wire-formats vector")


def driver_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sglang-dir", type=Path, default=SGLANG_DIR)
    parser.add_argument("--self-check", action="store_true",
                        help="load the modules, build the native hash, check it, and exit")
    args = parser.parse_args(argv)
    # The protocol gets its own copy of stdout; anything SGLang or torch prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))

    def reply(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    try:
        sgl = _load_sglang(args.sglang_dir)
        _self_check(sgl)
    except Exception as exc:
        reply({"ok": False, "error": _describe(exc, messages=True)})
        return 1
    if args.self_check:
        reply({"ok": True, "ready": SGLANG_VERSION})
        return 0
    driver = _Driver(sgl)
    reply({"ok": True, "ready": SGLANG_VERSION, "python": sys.version.split()[0]})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            reply({"ok": True, **driver.handle(cmd)})
        except Exception as exc:
            reply({"ok": False, "error": _describe(exc)})
    for engine in driver.engines.values():
        engine.close()
    for closer in driver.closers:
        closer.join(5)
    reply({"ok": True, "bye": True})
    return 0


# =============================================================================================
# Host side: the tests' process (the project's .venv).
# =============================================================================================


class SglangDriver:
    """The driver subprocess. Blocking calls (`call`) for fixtures; `acall` from async tests.
    Its stderr goes to `log_path` (SGLang's and torch's own messages)."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._log: Any = None
        self.version: str | None = None

    def start(self) -> SglangDriver:
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                       str(TORCH_EXTENSIONS_DIR)))
        env.pop("PYTHONPATH", None)  # nothing of the project's venv leaks into SGLang's
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [str(ENGINES_PYTHON), "-m", "tests.engines.sglang_real", "--sglang-dir", str(SGLANG_DIR)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            cwd=str(ROOT))
        self._reader = threading.Thread(target=self._read, daemon=True, name="sglang-driver")
        self._reader.start()
        hello = self._next(START_TIMEOUT_S)
        if not hello.get("ok"):
            self.close()
            raise RuntimeError(f"SGLang driver failed to start: {hello.get('error')}; "
                               f"see {self.log_path}")
        self.version = hello.get("ready")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"SGLang driver silent for {timeout_s} s; see {self.log_path}") \
                from None
        if line is None:
            raise RuntimeError(f"SGLang driver exited; see {self.log_path}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, cmd: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        with self._lock:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            answer = self._next(timeout_s)
        if not answer.get("ok"):
            raise RuntimeError(f"SGLang driver: {cmd.get('op')} failed: {answer.get('error')}")
        return answer

    async def acall(self, cmd: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        return await asyncio.to_thread(self.call, cmd, timeout_s)

    def close(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        if proc.poll() is None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.flush()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self._reader is not None:
            self._reader.join(5)
        if self._log is not None:
            self._log.close()


class SglangEngine:
    """One engine instance inside the driver: its RadixCache, recorder and publisher.

    `endpoint` is the PUB endpoint given to SGLang's `--kv-events-config` (a `tcp://host:port`
    form makes SGLang connect; see `sglang_binds`); the replay ROUTER binds `replay_endpoint`
    (default: an OS-chosen port on 127.0.0.1, read back into `self.replay_endpoint`).
    Each method returns the seqs of the batches the step published (empty when none)."""

    def __init__(self, driver: SglangDriver, engine_id: int, replay_endpoint: str | None,
                 first_seqs: list[int]) -> None:
        self.driver = driver
        self.id = engine_id
        self.replay_endpoint = replay_endpoint
        self.first_seqs = first_seqs
        self.closed = False

    @classmethod
    async def open(cls, driver: SglangDriver, *, endpoint: str, page_size: int,
                   tokenizer: Path, replay_endpoint: str | None = "tcp://127.0.0.1:*",
                   topic: str = "") -> SglangEngine:
        cmd: dict[str, Any] = {"op": "open", "endpoint": endpoint, "page_size": page_size,
                               "tokenizer": str(tokenizer), "topic": topic}
        if replay_endpoint is not None:
            cmd["replay_endpoint"] = replay_endpoint
        answer = await driver.acall(cmd)
        return cls(driver, int(answer["engine"]), answer.get("replay_endpoint"),
                   list(answer["seqs"]))

    async def chat(self, messages: list[dict[str, Any]], reply: str,
                   cache_salt: str | None = None) -> dict[str, Any]:
        """A chat request from arrival to finish (two scheduler steps: prefill, finish)."""
        return await self.driver.acall({"op": "chat", "engine": self.id, "messages": messages,
                                        "reply": reply, "cache_salt": cache_salt})

    async def evict(self, num_tokens: int) -> dict[str, Any]:
        return await self.driver.acall({"op": "evict", "engine": self.id,
                                        "num_tokens": num_tokens})

    async def flush(self) -> list[int]:
        return list((await self.driver.acall({"op": "flush", "engine": self.id}))["seqs"])

    async def close(self, *, wait: bool = False) -> None:
        """Shut the publisher down (`wait`: until its sockets are closed, for a restart on the
        same ports)."""
        if not self.closed:
            self.closed = True
            await self.driver.acall({"op": "close", "engine": self.id, "wait": wait})


def sglang_binds(endpoint: str) -> bool:
    """SGLang 0.5.23 `ZmqEventPublisher._socket_setup` without a `bind` override: bind for
    `*`, `::`, `0.0.0.0`, ipc:// and inproc://; otherwise (`tcp://127.0.0.1:P`) connect."""
    return ("*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


async def connect_engine(engine: SglangEngine, tap: ZmqTap, *, since: int = 0, tries: int = 40,
                         wait_s: float = 0.25) -> int:
    """Until a batch of `engine` has come through `tap` (more than `since` messages in all);
    returns how many flushes it took.

    SGLang's PUB connects, and drops what it sends before the tap's subscription has reached it
    (its first batch, seq 0, usually): nothing on SGLang's side can be awaited, so the engine is
    flushed (a real `flush_cache`: one `[AllBlocksCleared]` batch) until one arrives. Bounded:
    `tries` flushes, `wait_s` each."""
    if tap.count() > since:
        return 0
    for n in range(1, tries + 1):
        await engine.flush()
        if await asyncio.to_thread(tap.wait_count, since + 1, wait_s):
            return n
    raise TimeoutError(f"no SGLang batch reached the tap after {tries} flushes")


if __name__ == "__main__":
    sys.exit(driver_main(sys.argv[1:]))
