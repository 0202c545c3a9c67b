"""The monitoring that ships in deploy/: the real `/metrics` of both processes, the alerting rules
and the Grafana dashboard, checked against each other.

One real deployment runs for the module: `python -m kv_listener --config FILE` with two sources
(a salted vLLM one fed a malformed payload, a sequence gap and a chain; an SGLang one whose
`/detokenize` answers 500) pushing to a real `python -m kv_listener router --config FILE`, which
consumes vllm-1 over SSE and sglang-1 over its event bus (TLS HTTP/2). Engine-format events come
from `kv_listener.sim`. Both `/metrics` outputs are scraped once that state is reached, then:

- `promtool check metrics` passes on each, with no lint problem;
- both carry the process metrics, and the listener its configured bounds;
- `promtool check rules` and `promtool test rules` pass on deploy/prometheus, the unit tests
  cover every alert firing and not firing;
- every metric an alert or a dashboard query names is one the processes expose (names parsed
  out of the PromQL, tested on its own so that a query naming a missing metric fails), and the
  dashboard's queries parse as PromQL.

`promtool` comes from Debian's `prometheus` package (.ci/install installs it): without it these
tests fail, they are not skipped.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
import subprocess
from array import array
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kv_listener.core import bus_protocol as bp
from kv_listener.core.model import BlockStored
from kv_listener.core.salt import issue_cache_salt
from kv_listener.resolver.template import load_tokenizer
from kv_listener.sim.encode import encode_sglang_batch, encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.conftest import FIXTURES, ROOT
from tests.support.bus import TOKEN_A, write_token
from tests.support.daemon import Daemon
from tests.support.detokenize_server import DetokenizeServer
from tests.support.ports import free_port
from tests.support.tls import TlsMaterial

pytestmark = pytest.mark.timeout(60)

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "continuum-kv-listener.rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "continuum-kv-listener.rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "continuum-kv-listener.json"

MODEL = "tiny-chat"
BLOCK = 16
SALT_SECRET = b"s3cret"
LIMITS = {"max_chain_tokens": 4096, "max_tracked_blocks": 5000, "max_retained_tokens": 200000}
#: Series Prometheus makes itself for every target (not in any /metrics output).
SYNTHETIC = frozenset({"up"})


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: install Debian's `prometheus` package (it ships "
                    "/usr/bin/promtool; .ci/install does), these checks are not optional",
                    pytrace=False)
    return path


def run_promtool(*args: str, stdin: str | None = None, cwd: Path | None = None
                 ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], input=stdin, capture_output=True, text=True,
                          timeout=30, cwd=cwd, check=False)


# --- a real listener and router ----------------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    listener: str  # GET /metrics of the listener
    router: str  # GET /metrics of the router (admin.listen)
    stats: dict[str, Any]  # GET /stats of the listener


async def eventually(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    """Another process's state, with nothing to await: poll its HTTP API, bounded."""
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not reached within {timeout_s} s: {what}") from None


def salted_chain(system: str, blocks: int = 3) -> bytes:
    """A vLLM chain whose root block carries a valid cache salt for vllm-1 (no detokenize)."""
    key = hashlib.sha256(MODEL.encode() + b"\x00S" + system.encode()).digest()
    hashes = tuple(int.from_bytes(hashlib.sha256(system.encode() + bytes([i])).digest()[-8:], "big")
                   for i in range(blocks))
    event = BlockStored(block_hashes=hashes, parent_hash=None,
                        token_ids=array("I", range(100, 100 + blocks * BLOCK)), block_size=BLOCK,
                        medium="GPU",
                        extra_keys=((issue_cache_salt(SALT_SECRET, "vllm-1", key),),)
                        + (None,) * (blocks - 1))
    return encode_vllm_batch([event], ts=1.0)


def unsalted_chat_chain() -> bytes:
    """An SGLang chain of a chat prompt: resolving it needs /detokenize."""
    tok = load_tokenizer(FIXTURES / "tokenizers" / "chatml")
    text = tok.apply_chat_template([{"role": "system", "content": "You answer operators."},
                                    {"role": "user", "content": "Which backend is warm?"}],
                                   tokenize=False, add_generation_prompt=True)
    tokens = list(tok.encode(text, add_special_tokens=False))
    n = len(tokens) - len(tokens) % BLOCK
    hashes = tuple(range(1, n // BLOCK + 1))
    event = BlockStored(block_hashes=hashes, parent_hash=None, token_ids=array("I", tokens[:n]),
                        block_size=BLOCK, medium="GPU")
    return encode_sglang_batch([event], ts=1.0)


async def deploy_and_scrape(tmp: Path) -> Scrape:
    tls = TlsMaterial.create(tmp / "tls")
    secret = tmp / "salt.secret"
    secret.write_bytes(SALT_SECRET + b"\n")
    vport, sport, lport, aport, bus_port = (free_port() for _ in range(5))
    detok = await DetokenizeServer(load_tokenizer(FIXTURES / "tokenizers" / "chatml"),
                                   engine="sglang").start()
    detok.script = [500] * 1000  # every /detokenize call fails; /health answers
    listener_cfg = {
        "listen": f"127.0.0.1:{lport}",
        "log": {"level": "info", "format": "json"},
        "limits": LIMITS,
        "cache_salt": {"secret_file": str(secret)},
        "event_bus": {"url": f"https://127.0.0.1:{bus_port}", "ca_file": tls.ca_file,
                      "client_id": "kv-listener-a",
                      "credential_file": str(write_token(tmp, TOKEN_A, "bus.token")),
                      "reconnect_backoff": {"initial": "50ms", "max": "200ms"}},
        "sources": [
            {"backend_name": "vllm-1", "engine": "vllm", "model": MODEL,
             "zmq_endpoint": f"tcp://127.0.0.1:{vport}"},
            {"backend_name": "sglang-1", "engine": "sglang", "model": MODEL,
             "zmq_endpoint": f"tcp://127.0.0.1:{sport}", "detokenize_endpoint": detok.url},
        ],
    }
    router_cfg = {
        "kv_cache_index": {"event_sources": [
            {"backend_name": "vllm-1", "endpoint": f"http://127.0.0.1:{lport}/events/vllm-1",
             "reconnect_interval_ms": 50},
            {"backend_name": "sglang-1", "transport": "event_bus", "reconnect_interval_ms": 50},
        ]},
        "dynamo": {"event_bus": {
            "enabled": True, "listen": f"127.0.0.1:{bus_port}",
            "tls": {"cert": tls.server.cert, "key": tls.server.key, "client_ca": None},
            "brokers": [{"id": "kv-listener-a", "role": "kv_listener",
                         "token_hash": bp.token_hash(TOKEN_A),
                         "backends": ["vllm-1", "sglang-1"]}]}},
        "admin": {"listen": f"127.0.0.1:{aport}"},
        "log": {"level": "info", "format": "json"},
    }
    listener_url, router_url = f"http://127.0.0.1:{lport}", f"http://127.0.0.1:{aport}"
    try:
        async with Daemon(router_cfg, tmp, command=("router",), name="router",
                          started="router_started"), \
                Daemon(listener_cfg, tmp) as listener, \
                SimPublisher(f"tcp://127.0.0.1:{vport}", mode="connect") as vllm, \
                SimPublisher(f"tcp://127.0.0.1:{sport}", mode="connect") as sglang, \
                aiohttp.ClientSession() as http:
            await listener.wait_log("source_started", backend="vllm-1")
            await vllm.wait_for_subscriber()
            await sglang.wait_for_subscriber()
            vllm.publish(b"\xc1 not msgpack")  # dropped: invalid_msgpack
            vllm.drop_next(1, replayable=False)
            vllm.publish(salted_chain("lost"))  # never on the wire: the next one reveals a gap
            vllm.publish(salted_chain("You are a fleet assistant."))
            sglang.publish(unsalted_chat_chain())

            async def get(url: str) -> Any:
                async with http.get(url) as resp:
                    assert resp.status == 200, (url, resp.status)
                    return await (resp.json() if url.endswith("/stats") else resp.text())

            async def listener_state_reached() -> bool:
                src = (await get(f"{listener_url}/stats"))["sources"]
                v, s = src["vllm-1"], src["sglang-1"]
                return bool(v["prefixes_live"] == 1 and v["events_dropped"]
                            and v["clears_by_reason"].get("gap") and s["detokenize_errors"])

            async def router_connected() -> bool:
                text = await get(f"{router_url}/metrics")
                return all(f'continuum_kv_consumer_connected{{backend="{b}"}} 1.0' in text
                           for b in ("vllm-1", "sglang-1"))

            await eventually("the listener counted the drop, the gap, the prefix and the "
                             "detokenize errors", listener_state_reached)
            await eventually("the router's consumers of vllm-1 (SSE) and sglang-1 (event bus) "
                             "are connected", router_connected)
            return Scrape(await get(f"{listener_url}/metrics"), await get(f"{router_url}/metrics"),
                          await get(f"{listener_url}/stats"))
    finally:
        await detok.close()


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Scrape:
    return asyncio.run(deploy_and_scrape(tmp_path_factory.mktemp("deployment")))


# --- reading /metrics --------------------------------------------------------------------------

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
             "summary": ("_count", "_sum"), "info": ("_info",)}


def exposed_names(text: str) -> set[str]:
    """Every series name `text` exposes: its samples' names, and for a family with no sample yet
    (a labelled counter before its first increment) the names its type gives it."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


def test_promtool_check_metrics_passes_on_both_outputs(scrape: Scrape) -> None:
    for process, text in (("listener", scrape.listener), ("router", scrape.router)):
        result = run_promtool("check", "metrics", stdin=text)
        problems = (result.stdout + result.stderr).strip()
        assert result.returncode == 0 and not problems, f"{process} /metrics: {problems}"


def test_both_outputs_carry_process_metrics(scrape: Scrape) -> None:
    for process, text in (("listener", scrape.listener), ("router", scrape.router)):
        for name in ("process_resident_memory_bytes", "process_open_fds", "process_max_fds",
                     "process_start_time_seconds"):
            values = [v for _, v in samples(text, name)]
            assert len(values) == 1 and values[0] > 0, (process, name, values)
        assert len(samples(text, "process_cpu_seconds_total")) == 1, process
        assert [labels["implementation"] for labels, _ in samples(text, "python_info")] \
            == ["CPython"], process


def test_listener_exposes_its_configured_bounds_per_backend(scrape: Scrape) -> None:
    for metric, limit in (("limit_max_tracked_blocks", "max_tracked_blocks"),
                          ("limit_max_retained_tokens", "max_retained_tokens"),
                          ("limit_max_chain_tokens", "max_chain_tokens")):
        got = {labels["backend"]: v
               for labels, v in samples(scrape.listener, f"continuum_kv_listener_{metric}")}
        assert got == {"vllm-1": LIMITS[limit], "sglang-1": LIMITS[limit]}, metric
        for backend in ("vllm-1", "sglang-1"):
            assert scrape.stats["sources"][backend]["tracker"][metric] == LIMITS[limit]


def test_the_scenario_made_the_alerted_series_exist(scrape: Scrape) -> None:
    """The series the alerts divide or compare exist with values, not only as families."""
    text = scrape.listener

    def value(name: str, **labels: str) -> float:
        hits = [v for ls, v in samples(text, name) if all(ls.get(k) == x for k, x in labels.items())]
        assert len(hits) == 1, (name, labels, hits)
        return hits[0]

    assert value("continuum_kv_listener_events_dropped_total", backend="vllm-1",
                 reason="invalid_msgpack") == 1
    assert value("continuum_kv_listener_sequence_gaps_total", backend="vllm-1") == 1
    assert value("continuum_kv_listener_source_clears_total", backend="vllm-1", reason="gap") == 1
    assert value("continuum_kv_listener_blocks_tracked", backend="vllm-1") == 3
    assert value("continuum_kv_listener_engine_up", backend="sglang-1") == 1
    assert value("continuum_kv_listener_detokenize_errors_total", backend="sglang-1",
                 reason="http_5xx") >= 1
    assert value("continuum_kv_listener_bus_connected") == 1
    assert [v for _, v in samples(scrape.router, "continuum_kv_consumer_connected")] == [1.0, 1.0]


# --- PromQL metric names -----------------------------------------------------------------------

_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                       "group_right", "bool", "offset", "inf", "nan", "start", "end"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")  # label matchers (their strings are gone by then)
_BRACKETS = re.compile(r"\[[^\[\]]*\]")  # ranges and subqueries
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z_$]+|@\s*[0-9.()a-z]+")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")  # Grafana's $__rate_interval, ${backend}, $backend
_NUMBER = re.compile(r"(?<![\w:.])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*$", re.S)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana `label_values(selector, label)`): the
    identifiers left once strings, label matchers, ranges, grouping label lists, offsets,
    numbers and Grafana variables are gone, minus keywords and function or aggregation names
    (an identifier followed by `(`)."""
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group(1)
    for pattern in (_STRING, _BRACES, _BRACKETS, _VARIABLE):
        expr = pattern.sub(" ", expr)
    expr = _LABEL_LIST.sub(" ", expr)  # `sum by (le) (x)` -> `sum  (x)`: sum is followed by `(`
    expr = _OFFSET.sub(" ", expr)
    expr = _NUMBER.sub(" ", expr)
    names = set()
    for ident in _IDENT.finditer(expr):
        rest = expr[ident.end():].lstrip()
        if ident.group() in _KEYWORDS or rest.startswith("("):
            continue
        names.add(ident.group())
    return names


def test_promql_metric_names_parser() -> None:
    expr = ('sum by (job, instance) (rate(a_total{reason!~"x|y", b="{c}"}[5m] offset 1h))\n'
            '/ on (job) group_left (version) b_info > 0.5e-3 or histogram_quantile(0.9, sum by (le)'
            ' (rate(c_bucket{backend=~"$backend"}[$__rate_interval]))) and d:recorded unless '
            'max_over_time(e[1h:5m]) - time() * 550 + (f)')
    assert promql_metric_names(expr) == {"a_total", "b_info", "c_bucket", "d:recorded", "e", "f"}
    assert promql_metric_names("label_values(g_ready{job=\"x\"}, backend)") == {"g_ready"}
    assert promql_metric_names("count(h) by (le)") == {"h"}


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard_panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))  # collapsed rows hold theirs


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expression) of every panel target and query variable of the dashboard."""
    dash = dashboard()
    out = [(f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
           for p in dashboard_panels(dash["panels"]) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out.append((f"variable {var['name']}",
                        query["query"] if isinstance(query, dict) else query))
    return out


def missing_metrics(queries: Iterable[tuple[str, str]], exposed: set[str]) -> dict[str, set[str]]:
    """Per query, the metric names it uses that no process exposes."""
    out = {}
    for where, expr in queries:
        missing = promql_metric_names(expr) - exposed - SYNTHETIC
        if missing:
            out[where] = missing
    return out


def test_a_query_naming_a_missing_metric_is_caught(scrape: Scrape) -> None:
    exposed = exposed_names(scrape.listener) | exposed_names(scrape.router)
    assert missing_metrics([("typo", "sum(rate(continuum_kv_listener_event_received_total[5m]))"),
                            ("fine", "continuum_kv_listener_events_received_total")], exposed) \
        == {"typo": {"continuum_kv_listener_event_received_total"}}


def test_every_metric_in_the_alerts_and_the_dashboard_is_exposed(scrape: Scrape) -> None:
    exposed = exposed_names(scrape.listener) | exposed_names(scrape.router)
    queries = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()] + dashboard_queries()
    assert len(queries) > 40
    assert missing_metrics(queries, exposed) == {}


# --- the rules ---------------------------------------------------------------------------------

ALERTS = {
    "ContinuumKvListenerDown", "ContinuumKvRouterDown", "ContinuumKvConsumerDisconnected",
    "ContinuumKvListenerEventsDropped", "ContinuumKvRouterEventsDropped",
    "ContinuumKvListenerGapNotReplayed", "ContinuumKvListenerDetokenizeFailing",
    "ContinuumKvListenerTrackedBlocksNearLimit", "ContinuumKvListenerRetainedTokensNearLimit",
    "ContinuumKvListenerMemoryNearBound", "ContinuumKvListenerEngineDown",
    "ContinuumKvListenerEngineFlapping", "ContinuumKvListenerSourceNotReady",
    "ContinuumKvListenerNoPublisher",
    "ContinuumKvListenerEventBusDisconnected", "ContinuumKvRouterRedisFallbackActive",
}


def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout, result.stdout


def test_promtool_test_rules() -> None:
    result = run_promtool("test", "rules", RULE_TESTS.name, cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


def test_every_alert_is_labelled_annotated_and_unit_tested_both_ways() -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert set(rule["annotations"]) == {"summary", "description"}, name
    cases: dict[str, set[bool]] = {}
    labels: dict[str, set[str]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
            for alert in case["exp_alerts"]:
                labels.setdefault(case["alertname"], set()).update(alert["exp_labels"])
    assert cases == {name: {True, False} for name in ALERTS}
    for rule in rules:  # who is affected: the backend when the alert has one, else the instance
        who = "backend" if "backend" in labels[rule["alert"]] else "instance"
        assert f"$labels.{who}" in rule["annotations"]["summary"], rule["alert"]


# --- the dashboard -----------------------------------------------------------------------------


def test_dashboard_uses_the_datasource_and_backend_variables() -> None:
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    backend = variables["backend"]
    assert backend["datasource"]["uid"] == "${datasource}"
    assert backend["query"]["query"].startswith("label_values(")
    panels = list(dashboard_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]


def test_dashboard_shows_what_an_operator_needs() -> None:
    used = set().union(*(promql_metric_names(e) for _, e in dashboard_queries()))
    L = "continuum_kv_listener_"
    wanted = {L + n for n in (
        "events_received_total", "events_decoded_total", "events_dropped_total",
        "sequence_gaps_total", "replays_total", "source_clears_total", "blocks_tracked",
        "limit_max_tracked_blocks", "tokens_retained", "limit_max_retained_tokens",
        "prefixes_live", "detokenize_calls_total", "detokenize_errors_total", "sse_clients",
        "records_total", "bus_connected", "engine_up", "source_ready")} | {
        "continuum_kv_event_dropped_total", "continuum_kv_index_routing_decisions_total",
        "continuum_kv_index_overlap_score_bucket", "continuum_kv_consumer_connected",
        "continuum_cache_fallback_active", "process_resident_memory_bytes",
        "process_cpu_seconds_total", "process_open_fds"}
    assert wanted - used == set()
    # the process panels show both processes
    process_queries = [e for _, e in dashboard_queries() if "process_" in e]
    assert any("continuum_kv_listener_build_info" in e for e in process_queries)
    assert any("continuum_cache_fallback_active" in e for e in process_queries)


def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    """promtool has no expression checker: the queries become recording rules, Grafana's
    variables replaced by values, and `promtool check rules` parses them."""
    rules = []
    for n, (_, query) in enumerate(dashboard_queries()):
        expr = query.replace("$__rate_interval", "5m").replace("$backend", ".*")
        if (m := _LABEL_VALUES.match(expr)) is not None:
            expr = m.group(1)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
