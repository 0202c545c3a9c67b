"""A real Redis Cluster on 127.0.0.1 for tests (issue 16): three masters and three replicas of
Debian's `redis-server`, each a `RedisServer` in cluster mode with its own temp dir, joined by
`redis-cli --cluster create`. Never the system redis.

Owns: the nodes' cluster settings, cluster creation, the waits for a healthy cluster, and the
faults tests inject (a master crashed, a killed node restarted, a slot moved).

- `LocalRedisCluster(directory, *, tls=False, acl=False)`: `start()` returns once every node says
  `cluster_state:ok`, all agree on who serves which slots, and every master has a replica whose
  replication link is up (so `WAIT 1 <ms>` can succeed); `stop()` terminates every node. Also a
  context manager, and `redis_cluster_fixture(...)` makes a pytest fixture of it.
- `urls` (every node's, any one is a startup node), `client_kwargs()` (TLS trust anchor and ACL
  credentials for redis-py), `masters()` / `replicas()` (`Member`: node, id, slot ranges).
- `kill_master_of(key)` SIGKILLs the master of the key's slot; `wait_failover(killed)` returns the
  replica once it is promoted and the cluster is ok again; `restart(node)` brings a killed node
  back (it rejoins as a replica: its nodes.conf survives, its data does not, there is none).
- `migrate_slot(slot, to)` moves one slot for real (`CLUSTER SETSLOT ... IMPORTING/MIGRATING`,
  `MIGRATE`, `SETSLOT ... NODE`); `begin_migration(slot, to)` stops half way so that a test sees
  ASK (`move_keys(limit)`, then `finish()`: MOVED).

Settings that make faults quick: `cluster-node-timeout` 1000 ms (a failover takes about 2.5 s),
`repl-diskless-sync-delay 0` (the default 5 s would delay every replica's first sync), and
`shutdown-timeout 0` (a stopped master does not wait for replicas). The cluster bus port is chosen
free (`cluster-port`): port + 10000 may be taken or above 65535. TLS (`tls=True`): certificates
from `trustme`, clients, the cluster bus (`tls-cluster`) and replication (`tls-replication`) all
over TLS. ACL (`acl=True`): the default user is off, user `router` has a random password, written
to `acl.password_file` (what a router config's `password_file` names); replicas authenticate with
it (`masteruser`/`masterauth`), so does `MIGRATE` (`AUTH2`).

All methods are blocking (subprocesses, a sync redis client): async tests call the slow ones
through `asyncio.to_thread` so that their own traffic goes on meanwhile.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import RedisError
from redis.retry import Retry

from tests.support.lifecycle import StartStop
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer, TlsFiles
from tests.support.tls import TlsMaterial

SLOTS = 16384
NODE_TIMEOUT_MS = 1000
WAIT_TIMEOUT_S = 20.0
POLL_S = 0.05
CREATE_TIMEOUT_S = 30.0
ACL_USER = "router"
MIGRATE_BATCH = 100
MIGRATE_TIMEOUT_MS = 5000

SlotRange = tuple[int, int]  # first and last slot, both included


@dataclass(frozen=True)
class ClusterAcl:
    user: str
    password: str
    password_file: Path  # the password alone, for `read_secret` (trailing newline stripped)
    acl_file: Path  # the servers' `aclfile`

    @classmethod
    def create(cls, directory: Path) -> ClusterAcl:
        password = secrets.token_urlsafe(18)
        password_file = directory / "redis-password"
        password_file.write_text(password + "\n")
        acl_file = directory / "users.acl"
        # `&*`: Redis 7 gives new users no pub/sub channel unless told (acl-pubsub-default).
        acl_file.write_text(f"user default off\nuser {ACL_USER} on >{password} ~* &* +@all\n")
        return cls(ACL_USER, password, password_file, acl_file)


class ClusterServer(RedisServer):
    """One node: a `RedisServer` started with a per-node config file that turns cluster mode on.
    `kill()` is a crash (SIGKILL); `start()` again reuses its ports and nodes.conf."""

    def __init__(self, directory: Path, *, tls: TlsMaterial | None, acl: ClusterAcl | None,
                 node_timeout_ms: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        files = TlsFiles(Path(tls.server.cert), Path(tls.server.key)) if tls else None
        super().__init__(directory, tls=files)
        self.bus_port = free_port()
        self._bus_for_port = self.port
        lines = [
            "cluster-enabled yes",
            f"cluster-config-file {directory / 'nodes.conf'}",
            f"cluster-node-timeout {node_timeout_ms}",
            "cluster-announce-ip 127.0.0.1",
            "repl-diskless-sync yes",
            "repl-diskless-sync-delay 0",
            "shutdown-timeout 0",
        ]
        if tls is not None:
            lines += ["tls-cluster yes", "tls-replication yes", f"tls-ca-cert-file {tls.ca_file}"]
        if acl is not None:
            lines += [f"aclfile {acl.acl_file}", f"masteruser {acl.user}", f"masterauth {acl.password}"]
        self.config_file = directory / "redis.conf"
        self.config_file.write_text("\n".join(lines) + "\n")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _args(self) -> list[str]:
        if self.port != self._bus_for_port:  # RedisServer picked a new port after a clash
            self.bus_port, self._bus_for_port = free_port(), self.port
        args = super()._args()
        # The config file first: options on the command line come after it and extend it.
        return [args[0], str(self.config_file), *args[1:], "--cluster-port", str(self.bus_port)]

    def kill(self) -> None:
        if self._proc is None:
            raise RuntimeError(f"node {self.address} is not running")
        self._proc.kill()
        self._proc.wait()
        self.stop()  # reaps the output reader; terminate() skips a process already waited for

    def __repr__(self) -> str:
        return f"ClusterServer({self.address}, {'running' if self.running else 'stopped'})"


@dataclass(frozen=True)
class Member:
    """A node as the cluster sees it: a master with the slot ranges it serves, or a replica with
    its master (`slots` are then its master's)."""

    node: ClusterServer
    node_id: str
    slots: tuple[SlotRange, ...]
    master: ClusterServer | None = None


@dataclass(frozen=True)
class _Entry:  # one line of CLUSTER NODES
    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[SlotRange, ...]


@dataclass(frozen=True)
class _Crash:  # what a killed master served, to recognise its failover
    slots: tuple[SlotRange, ...]
    replicas: tuple[ClusterServer, ...]


class LocalRedisCluster(StartStop):
    def __init__(self, directory: Path, *, tls: bool = False, acl: bool = False, masters: int = 3,
                 replicas_per_master: int = 1, node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
        self.cli = cli
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.tls = TlsMaterial.create(directory / "tls") if tls else None
        self.acl = ClusterAcl.create(directory) if acl else None
        self.master_count = masters
        self.replicas_per_master = replicas_per_master
        self.nodes = [
            ClusterServer(directory / f"node{i}", tls=self.tls, acl=self.acl,
                          node_timeout_ms=node_timeout_ms)
            for i in range(masters * (1 + replicas_per_master))
        ]
        self._admins: dict[int, redis.Redis] = {}
        self._crashes: dict[int, _Crash] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            self._create()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for admin in self._admins.values():
            admin.close()
        self._admins.clear()
        for node in self.nodes:
            node.stop()

    def _create(self) -> None:
        args = [self.cli, *self._cli_options(), "--cluster", "create",
                *(node.address for node in self.nodes),
                "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
        env = dict(os.environ)
        if self.acl is not None:
            env["REDISCLI_AUTH"] = self.acl.password  # not on the command line (ps, its warning)
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=CREATE_TIMEOUT_S,
                                  env=env, check=False)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"redis-cli --cluster create did not finish within "
                               f"{CREATE_TIMEOUT_S:g} s:\n{exc.stdout!s}") from None
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    def _cli_options(self) -> list[str]:
        options = []
        if self.tls is not None:
            options += ["--tls", "--cacert", self.tls.ca_file]
        if self.acl is not None:
            options += ["--user", self.acl.user]
        return options

    # --- what clients need -------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Every node's URL (`redis://` or `rediss://127.0.0.1:<port>/0`); any is a startup node."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return next(node.url for node in self.nodes if node.running)

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for redis-py's clients besides the URL: the CA and the credentials."""
        kwargs: dict[str, Any] = {}
        if self.tls is not None:
            kwargs["ssl_ca_certs"] = self.tls.ca_file
        if self.acl is not None:
            kwargs |= {"username": self.acl.user, "password": self.acl.password}
        return kwargs

    def admin(self, node: ClusterServer) -> redis.Redis:
        """A plain (not cluster-aware) client of one node: it sees MOVED and ASK as errors."""
        client = self._admins.get(id(node))
        if client is None:
            # No retries: a wait polls again anyway, and a retry's backoff would blur its timing.
            client = redis.Redis(
                host="127.0.0.1", port=node.port, ssl=self.tls is not None, protocol=2,
                decode_responses=True, socket_timeout=2, socket_connect_timeout=2,
                retry=Retry(NoBackoff(), 0), **self.client_kwargs(),
            )
            self._admins[id(node)] = client
        return client

    def flushall(self) -> None:
        """Empty every master (tests sharing a module-scoped cluster start from no keys)."""
        for member in self.masters():
            self.admin(member.node).execute_command("FLUSHALL")

    # --- topology ----------------------------------------------------------------------------

    def masters(self) -> list[Member]:
        """The masters serving slots (in slot order), as a running node sees them."""
        entries = self._view(self._running()[0])
        nodes = self._by_port()
        return sorted(
            (Member(nodes[e.port], e.node_id, e.slots) for e in entries
             if "master" in e.flags and e.slots and not e.flags & {"fail", "fail?"}),
            key=lambda m: m.slots[0],
        )

    def replicas(self) -> list[Member]:
        """The replicas that are up, each with its master and its master's slot ranges."""
        entries = self._view(self._running()[0])
        nodes = self._by_port()
        by_id = {e.node_id: e for e in entries}
        return [
            Member(nodes[e.port], e.node_id, by_id[e.master_id].slots, nodes[by_id[e.master_id].port])
            for e in entries
            if "slave" in e.flags and e.master_id in by_id and not e.flags & {"fail", "fail?"}
        ]

    def master_of(self, key: str | bytes) -> Member:
        return self.master_of_slot(slot_of(key))

    def master_of_slot(self, slot: int) -> Member:
        for member in self.masters():
            if any(first <= slot <= last for first, last in member.slots):
                return member
        raise LookupError(f"no master serves slot {slot}")

    def node_id(self, node: ClusterServer) -> str:
        return str(self.admin(node).execute_command("CLUSTER", "MYID"))

    # --- faults ------------------------------------------------------------------------------

    def kill_master_of(self, key: str | bytes) -> ClusterServer:
        """SIGKILL the master serving `key`'s slot; returns it (for `wait_failover`, `restart`)."""
        member = self.master_of(key)
        replicas = tuple(r.node for r in self.replicas() if r.master is member.node)
        if not replicas:
            raise RuntimeError(f"master {member.node.address} has no replica: it cannot fail over")
        self._crashes[id(member.node)] = _Crash(member.slots, replicas)
        self.admin_close(member.node)
        member.node.kill()
        return member.node

    def wait_failover(self, killed: ClusterServer, timeout_s: float = WAIT_TIMEOUT_S) -> ClusterServer:
        """Wait until a replica of the killed master serves its slots in every running node's
        view and the cluster is ok; returns the promoted node."""
        crash = self._crashes.get(id(killed))
        if crash is None:
            raise RuntimeError(f"{killed.address} was not killed by kill_master_of")
        promoted: list[ClusterServer] = []

        def problem() -> str | None:
            for replica in crash.replicas:
                if replica.running and self.admin(replica).execute_command("ROLE")[0] == "master":
                    break
            else:
                return f"no replica of {killed.address} has been promoted"
            for node in self._running():
                owner = {e.port for e in self._view(node) if "master" in e.flags and e.slots == crash.slots}
                if owner != {replica.port}:
                    return f"{node.address} does not see {replica.address} serving {crash.slots}"
            promoted[:] = [replica]
            return self._problem(require_replicas=False)

        self._wait(f"failover of {killed.address}", problem, timeout_s)
        return promoted[0]

    def restart(self, node: ClusterServer, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Start a killed node again and wait until it is a replica in sync and the cluster is
        healthy (every master with a replica)."""
        node.start()

        def problem() -> str | None:
            info = self._info(node, "INFO", "replication")
            if info.get("role") != "slave" or info.get("master_link_status") != "up":
                return f"{node.address} is not a replica in sync yet ({info.get('role')})"
            return self._problem(require_replicas=True)

        self._wait(f"{node.address} rejoining as a replica", problem, timeout_s)
        self._crashes.pop(id(node), None)

    def begin_migration(self, slot: int, to: ClusterServer) -> SlotMigration:
        """Mark `slot` as migrating from its master to `to` (another master); no key moved yet."""
        source = self.master_of_slot(slot).node
        if source is to:
            raise ValueError(f"slot {slot} is already served by {to.address}")
        if to not in {m.node for m in self.masters()}:
            raise ValueError(f"{to.address} is not a master serving slots")
        # Importing first, then migrating (the order of the cluster tutorial): a client sent by an
        # ASK to the target must find the slot importing there.
        self.admin(to).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        self.admin(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to))
        return SlotMigration(self, slot, source, to)

    def migrate_slot(self, slot: int, to: ClusterServer) -> None:
        """Move `slot` and its keys to the master `to`; returns once every node agrees."""
        self.begin_migration(slot, to).finish()

    # --- waits -------------------------------------------------------------------------------

    def wait_slot_owner(self, slot: int, owner: ClusterServer, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Wait until every running node sees `owner` serving `slot` and the cluster is ok."""
        owner_id = self.node_id(owner)

        def problem() -> str | None:
            for node in self._running():
                if not any(e.node_id == owner_id and _covers(e.slots, slot) for e in self._view(node)):
                    return f"{node.address} does not see {owner.address} serving slot {slot}"
            return self._problem(require_replicas=False)

        self._wait(f"slot {slot} served by {owner.address}", problem, timeout_s)

    def wait_healthy(self, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        self._wait("cluster ok, every master with a replica in sync",
                   lambda: self._problem(require_replicas=True), timeout_s)

    def _wait(self, what: str, problem: Callable[[], str | None], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                found = problem()
            except RedisError as exc:  # a node still starting, a link not up yet
                found = f"{type(exc).__name__}: {exc}"
            if found is None:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"redis cluster: {what}: not reached within {timeout_s:g} s "
                                   f"(last seen: {found})")
            # Cluster state travels by gossip and nothing announces it: a poll of CLUSTER INFO /
            # NODES is a few in-memory reads per node, so a 50 ms period costs nothing and keeps
            # the measured failover time within 50 ms of the real one.
            time.sleep(POLL_S)

    def _problem(self, *, require_replicas: bool) -> str | None:
        """What keeps the cluster from being healthy, as running nodes see it; None if nothing."""
        views: dict[str, dict[int, tuple[SlotRange, ...]]] = {}
        running = self._running()
        ports = {node.port for node in running}
        for node in running:
            info = self._info(node, "CLUSTER", "INFO")
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
                return f"{node.address}: cluster_state {info.get('cluster_state')}, " \
                       f"slots_ok {info.get('cluster_slots_ok')}"
            if info.get("cluster_known_nodes") != str(len(self.nodes)):
                return f"{node.address} knows {info.get('cluster_known_nodes')} nodes"
            entries = self._view(node)
            if flagged := [e.port for e in entries if e.port in ports and e.flags & {"fail", "fail?"}]:
                return f"{node.address} flags running nodes {flagged} as failing"
            masters = {e.port: e.slots for e in entries if "master" in e.flags and e.slots}
            views[node.address] = masters
            if len(masters) != self.master_count:
                return f"{node.address} sees {len(masters)} masters serving slots"
            if require_replicas:
                by_id = {e.node_id: e.port for e in entries}
                served = {by_id.get(e.master_id or "") for e in entries
                          if "slave" in e.flags and e.port in ports}
                if lonely := sorted(set(masters) - served):
                    return f"{node.address} sees masters without a running replica: {lonely}"
        if len({tuple(sorted(v.items())) for v in views.values()}) > 1:
            return f"the nodes disagree on the slot owners: {views}"
        if require_replicas:
            for node in running:
                info = self._info(node, "INFO", "replication")
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return f"replica {node.address}: master_link_status {info.get('master_link_status')}"
        return None

    # --- helpers -----------------------------------------------------------------------------

    def admin_close(self, node: ClusterServer) -> None:
        client = self._admins.pop(id(node), None)
        if client is not None:
            client.close()

    def _running(self) -> list[ClusterServer]:
        running = [node for node in self.nodes if node.running]
        if not running:
            raise RuntimeError("no node of the cluster is running")
        return running

    def _by_port(self) -> dict[int, ClusterServer]:
        return {node.port: node for node in self.nodes}

    def _info(self, node: ClusterServer, *command: str) -> dict[str, str]:
        reply = self.admin(node).execute_command(*command)
        if isinstance(reply, dict):  # redis-py parses INFO itself (CLUSTER INFO it leaves as text)
            return {key: str(value) for key, value in reply.items()}
        return dict(line.split(":", 1) for line in str(reply).splitlines() if ":" in line)

    def _view(self, node: ClusterServer) -> list[_Entry]:
        text = str(self.admin(node).execute_command("CLUSTER", "NODES"))
        return [_parse_node_line(line) for line in text.splitlines() if line.strip()]


@dataclass
class SlotMigration:
    """A slot half way between two masters: keys not moved yet are on `source`, the moved ones
    on `target`; clients asking `source` for a moved (or new) key get ASK."""

    cluster: LocalRedisCluster
    slot: int
    source: ClusterServer
    target: ClusterServer

    def move_keys(self, limit: int | None = None) -> int:
        """MIGRATE up to `limit` keys (all by default) of the slot to the target; returns how many."""
        moved = 0
        src = self.cluster.admin(self.source)
        auth: list[str] = []
        if self.cluster.acl is not None:
            auth = ["AUTH2", self.cluster.acl.user, self.cluster.acl.password]
        while limit is None or moved < limit:
            batch = MIGRATE_BATCH if limit is None else min(MIGRATE_BATCH, limit - moved)
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, batch)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", self.target.port, "", 0, MIGRATE_TIMEOUT_MS,
                                *auth, "KEYS", *keys)
            moved += len(keys)
        return moved

    def finish(self) -> None:
        """Move the remaining keys and give the slot to the target on every master (the target
        first: it then answers for the slot before the source starts sending MOVED there)."""
        self.move_keys()
        target_id = self.cluster.node_id(self.target)
        others = [m.node for m in self.cluster.masters() if m.node not in (self.source, self.target)]
        for node in (self.target, self.source, *others):
            self.cluster.admin(node).execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", target_id)

        self.cluster.wait_slot_owner(self.slot, self.target)


def slot_of(key: str | bytes) -> int:
    """The hash slot of a key (hash tags included), as redis-py and the servers compute it."""
    return key_slot(key.encode() if isinstance(key, str) else key)


def redis_cluster_fixture(
    *, name: str = "redis_cluster", scope: Literal["function", "module", "session"] = "module",
    tls: bool = False, acl: bool = False,
) -> Any:
    """A pytest fixture yielding a started `LocalRedisCluster`; assign it in a test module:
    `redis_cluster = redis_cluster_fixture()`. Module scope by default: starting one costs about
    1.5 s, so the tests of a module share it (`flushall()`, and leave it healthy: `restart`)."""

    @pytest.fixture(name=name, scope=scope)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
        with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), tls=tls, acl=acl) as cluster:
            yield cluster

    return fixture


def _parse_node_line(line: str) -> _Entry:
    # <id> <ip:port@cport[,hostname]> <flags> <master> <ping> <pong> <epoch> <link> <slot>...
    fields = line.split()
    port = int(fields[1].split("@", 1)[0].rsplit(":", 1)[1])
    slots = []
    for item in fields[8:]:
        if item.startswith("["):  # [slot->-id] / [slot-<-id]: a migration in progress, not owned
            continue
        first, _, last = item.partition("-")
        slots.append((int(first), int(last or first)))
    master_id = None if fields[3] == "-" else fields[3]
    return _Entry(fields[0], port, frozenset(fields[2].split(",")), master_id, tuple(slots))


def _covers(ranges: tuple[SlotRange, ...], slot: int) -> bool:
    return any(first <= slot <= last for first, last in ranges)
