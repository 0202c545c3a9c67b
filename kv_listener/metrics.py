"""Prometheus metrics of the listener (`continuum_kv_listener_` prefix).

Metrics are read at scrape time from the same plain counters that `/stats` shows
(`kv_listener.stats.SourceStats`, the tracker's counters, the stream hub's counters), through a
custom collector: nothing is counted twice and the hot path pays no Prometheus locking.

Label values come from fixed sets only: `backend` from the configured sources, `reason` from the
drop/clear Enums, `event` from the SSE event names.

Also owns the process metrics every `/metrics` of ours carries (`add_process_collectors`: the
listener's registry here, the router's in `kv_listener.router.app`): prometheus_client's own
`process_*` (RSS, CPU seconds, open and max fds, start time) and `python_info`, under their
standard names so that stock dashboards and alerts work on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kv_listener import __version__
from kv_listener.core.decode import DropReason
from kv_listener.core.model import ClearReason
from kv_listener.core.sequence import SourceDropReason
from kv_listener.resolver.detokenize import DetokenizeErrorReason
from kv_listener.sources.trtllm import PollErrorReason
from kv_listener.stats import SourceStats

PREFIX = "continuum_kv_listener_"


@dataclass(slots=True)
class SourceView:
    """What one source exposes to the collector."""

    backend: str
    stats: SourceStats
    tracker: Mapping[str, int] = field(default_factory=dict)  # blocks_tracked, tokens_retained, ...
    queue_depth: int = 0  # batches in the source's queue when the view was taken


@dataclass(slots=True)
class StreamView:
    """What the SSE/push side exposes per backend."""

    backend: str
    clients: int = 0
    overflows: int = 0
    records: Mapping[str, int] = field(default_factory=dict)  # event name -> records written


# name, help, SourceStats attribute (counters)
_SOURCE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("events_received", "KV events received from the engine (before decoding).", "events_received"),
    ("events_decoded", "KV events decoded into the normalized model.", "events_decoded"),
    ("batches_received", "Event batches received from the engine.", "batches_received"),
    ("sequence_gaps", "Gaps detected in the engine's sequence numbers.", "gaps"),
    ("replays", "Gaps covered by a replay from the engine.", "replays"),
    ("replay_failures", "Replays that could not cover a gap.", "replay_failures"),
    (
        "refused_publishers",
        "Connections refused because the peer is not an allowed publisher.",
        "refused_publishers",
    ),
    (
        "zmq_disconnects",
        "ZMQ connections to the engine lost (engine gone, or a frame over the socket's size cap).",
        "zmq_disconnects",
    ),
    ("detokenize_calls", "Calls to /detokenize or the local tokenizer.", "detokenize_calls"),
    ("salt_rejected", "Chains discarded because their cache salt failed verification.", "salt_rejected"),
    ("source_restarts", "Times a crashed source task was restarted.", "source_restarts"),
)
# name, help, SourceStats attribute (Counter[str] by reason)
_SOURCE_REASON_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("events_dropped", "KV events or frames dropped, by reason.", "events_dropped"),
    ("source_clears", "Times a source's whole state was cleared, by reason.", "clears"),
    ("poll_errors", "Failed TRT-LLM polls, by reason.", "poll_errors"),
    ("detokenize_errors", "Failed detokenize calls, by reason.", "detokenize_errors"),
)


_CLEAR_REASONS = tuple(r.value for r in ClearReason)
_DETOKENIZE_REASONS = tuple(r.value for r in DetokenizeErrorReason)
_POLL_REASONS = tuple(r.value for r in PollErrorReason)
_DROP_REASONS = tuple(r.value for r in DropReason) + tuple(r.value for r in SourceDropReason)


def _known_reasons(attr: str, engine: str) -> tuple[str, ...]:
    """The reason label values a source of `engine` can count under `attr` (fixed sets)."""
    trtllm = engine == "trtllm"
    return {"clears": _CLEAR_REASONS, "events_dropped": _DROP_REASONS,
            "detokenize_errors": () if trtllm else _DETOKENIZE_REASONS,
            "poll_errors": _POLL_REASONS if trtllm else ()}.get(attr, ())


def _engine_up(v: SourceView) -> float | None:
    if v.stats.engine_state == "off":
        return None  # not watched: no series rather than a made-up value
    return 0.0 if v.stats.engine_state == "down" else 1.0


# name, help, the value of a source (None: no sample for it); in the order they are exposed
_SOURCE_GAUGES: tuple[tuple[str, str, Callable[[SourceView], float | None]], ...] = (
    ("source_ready", "1 when the source is connected (ZMQ) or polled successfully (TRT-LLM).",
     lambda v: 1.0 if v.stats.ready else 0.0),
    ("last_event_timestamp_seconds", "Wall-clock time of the last decoded batch.",
     lambda v: v.stats.last_event_at),
    ("queue_depth", "Batches waiting between a source and the tracker.",
     lambda v: v.queue_depth),
    ("engine_up",
     "1 while the engine shows signs of life (health check, batches, polls), 0 once it was "
     "declared down (engine_down_after); absent for sources whose engine is not watched.",
     _engine_up),
    ("publishers_connected",
     "ZMQ connections of the engine whose handshake succeeded and that are still up (one "
     "per DP rank publishing); 0: no engine connected (GET /readyz/{backend} is 503).",
     lambda v: None if v.stats.engine == "trtllm" else v.stats.publishers_connected),
)
_TRACKER_GAUGES: tuple[tuple[str, str], ...] = (
    ("blocks_tracked", "Block records held by the tracker."),
    ("tokens_retained", "Token IDs retained for detokenization (4 bytes each)."),
    ("prefixes_live", "Prefixes currently live on the backend."),
    ("chains_pending", "Chains waiting for more blocks or a detokenize answer."),
)
# The configured bounds (SPEC §4), beside the gauges they bound: "near the limit" is a ratio.
_LIMIT_GAUGES: tuple[tuple[str, str], ...] = (
    ("limit_max_tracked_blocks", "Configured bound of blocks_tracked (limits.max_tracked_blocks)."),
    ("limit_max_retained_tokens",
     "Configured bound of tokens_retained (limits.max_retained_tokens)."),
    ("limit_max_chain_tokens",
     "Longest chain whose tokens are kept for detokenization (limits.max_chain_tokens)."),
)
_TRACKER_COUNTERS: tuple[tuple[str, str], ...] = (
    ("token_count_mismatch", "Events whose token count does not fit their block size."),
    ("blocks_pruned", "Block records pruned to stay within the configured bounds."),
)


@dataclass(slots=True)
class BusView:
    """What the push-mode client exposes (see outputs.bus_client.BusClientStats)."""

    connected: bool = False
    connects: int = 0
    sessions: int = 0
    failures: Mapping[str, int] = field(default_factory=dict)  # BusFailure -> n
    streams_opened: int = 0
    streams_ended: Mapping[str, int] = field(default_factory=dict)  # PushEnd -> n
    bytes_pushed: int = 0


class ListenerCollector(Collector):
    def __init__(
        self,
        sources: Callable[[], Iterable[SourceView]],
        streams: Callable[[], Iterable[StreamView]] = lambda: (),
        bus: Callable[[], BusView | None] = lambda: None,
    ) -> None:
        self._sources = sources
        self._streams = streams
        self._bus = bus

    def collect(self) -> Iterator[Metric]:
        views = list(self._sources())
        info = GaugeMetricFamily(PREFIX + "build_info", "Build information.", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info

        for name, doc, attr in _SOURCE_COUNTERS:
            yield _by_backend(CounterMetricFamily, name, doc,
                              [(v.backend, getattr(v.stats, attr)) for v in views])
        for name, doc, attr in _SOURCE_REASON_COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["backend", "reason"])
            for v in views:
                # Every reason of the source's kind shows from the start at 0, so `increase()`
                # sees the first one (a series born at 1 has no earlier sample to rise from).
                by_reason = dict.fromkeys(_known_reasons(attr, v.stats.engine), 0)
                by_reason.update(getattr(v.stats, attr))
                for reason, n in sorted(by_reason.items()):
                    c.add_metric([v.backend, str(reason)], float(n))
            yield c

        for name, doc, read in _SOURCE_GAUGES:
            yield _by_backend(GaugeMetricFamily, name, doc, [(v.backend, read(v)) for v in views])
        for name, doc in _TRACKER_GAUGES + _LIMIT_GAUGES:
            yield _by_backend(GaugeMetricFamily, name, doc,
                              [(v.backend, v.tracker.get(name)) for v in views])
        for name, doc in _TRACKER_COUNTERS:
            yield _by_backend(CounterMetricFamily, name, doc,
                              [(v.backend, v.tracker.get(name)) for v in views])

        streams = list(self._streams())
        yield _by_backend(GaugeMetricFamily, "sse_clients", "Open event streams (SSE and push).",
                          [(s.backend, s.clients) for s in streams])
        yield _by_backend(CounterMetricFamily, "buffer_overflows",
                          "Consumers cut off for lagging more than max_lag records.",
                          [(s.backend, s.overflows) for s in streams])
        records = CounterMetricFamily(
            PREFIX + "records",
            "Prefix event records written to the backend's event log, by event.",
            labels=["backend", "event"],
        )
        for s in streams:
            for event, n in sorted(s.records.items()):
                records.add_metric([s.backend, event], float(n))
        yield records

        bus = self._bus()
        if bus is None:
            return
        g = GaugeMetricFamily(PREFIX + "bus_connected", "1 while a push-mode session with the "
                              "router's event bus is welcome.")
        g.add_metric([], 1.0 if bus.connected else 0.0)
        yield g
        for name, doc, value in (
            ("bus_connects", "Connection attempts to the router's event bus.", bus.connects),
            ("bus_sessions", "Push-mode sessions welcomed by the router.", bus.sessions),
            ("bus_streams_opened", "Streams pushed on the router's request.", bus.streams_opened),
            ("bus_bytes_pushed", "SSE bytes pushed to the router.", bus.bytes_pushed),
        ):
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], float(value))
            yield c
        for name, doc, counts in (
            ("bus_failures", "Push-mode connection or session failures, by reason.", bus.failures),
            ("bus_streams_ended", "Pushed streams ended, by reason.", bus.streams_ended),
        ):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["reason"])
            for reason, n in sorted(counts.items()):
                c.add_metric([str(reason)], float(n))
            yield c


def _by_backend(family: type[CounterMetricFamily | GaugeMetricFamily], name: str, doc: str,
                samples: Iterable[tuple[str, float | None]]) -> Metric:
    """One metric family labelled by backend; a None value is no sample for that backend."""
    metric = family(PREFIX + name, doc, labels=["backend"])
    for backend, value in samples:
        if value is not None:
            metric.add_metric([backend], float(value))
    return metric


def add_process_collectors(registry: CollectorRegistry) -> CollectorRegistry:
    """Register the process metrics (`process_resident_memory_bytes`, `process_open_fds`,
    `process_cpu_seconds_total`, `process_start_time_seconds`, ...; read from /proc at scrape
    time, absent where there is none) and `python_info` on `registry`; returns it.

    For registries of our own only: prometheus_client's global registry already has them, and
    registering them twice on one registry raises (duplicated timeseries)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def new_registry(collector: Collector | None = None) -> CollectorRegistry:
    """A registry of our own (not the global one), so several listeners can live in one process
    (tests, the demo) without clashing; it carries the process metrics."""
    registry = add_process_collectors(CollectorRegistry(auto_describe=True))
    if collector is not None:
        registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
