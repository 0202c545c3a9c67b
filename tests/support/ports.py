"""TCP ports on 127.0.0.1 for the tests' servers (and for addresses where nothing may listen), safe
when pytest-xdist runs several workers at once.

Binding port 0, closing and handing the number on races: that port comes from the Linux ephemeral
range (`net.ipv4.ip_local_port_range`), the same range every outgoing connection's local port and
every other server on port 0 (another worker's, a child process's) is drawn from, so it can be
taken before the test's server binds it. Here instead:

- each xdist worker (`PYTEST_XDIST_WORKER` = gw0, gw1, ...; `PYTEST_XDIST_WORKER_COUNT` of them)
  draws from its own band of the ports below the ephemeral range, so no two workers, and no
  OS-chosen port, ever meet;
- within a run a worker never hands the same port out twice (a server restarted on "its" port
  keeps that number itself);
- each port is checked bindable when handed out, without `SO_REUSEADDR`: a port something listens
  on, or with a connection of an earlier run still in TIME_WAIT, is skipped.

Without xdist the whole band belongs to the one process. A Redis Cluster node's bus port is one
more port from here (`--cluster-port`), never port + 10000.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

LOWEST = 10000  # below: ports of well-known and registered services more often in use
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default range


def ephemeral_range() -> tuple[int, int]:
    try:
        first, last = (int(p) for p in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return first, last


def worker() -> tuple[int, int]:
    """This process's xdist worker index and the number of workers ((0, 1) without xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(name[2:]) if name.startswith("gw") else 0
    return index, max(count, index + 1)


def band(index: int, count: int) -> range:
    """Worker `index`'s ports: its share of the ports outside the ephemeral range (below it, or
    above it when the range starts too low to leave room)."""
    first, last = ephemeral_range()
    lo, hi = (LOWEST, first) if first - LOWEST >= 1000 * count else (last + 1, 65536)
    size = (hi - lo) // count
    if size < 100:
        raise RuntimeError(f"no room for {count} port bands outside the ephemeral range "
                           f"{first}-{last} ({EPHEMERAL_RANGE})")
    return range(lo + index * size, lo + (index + 1) * size)


class PortBand:
    """Hands out the ports of one band in order, each once, each bindable at that moment."""

    def __init__(self, ports: range) -> None:
        self.ports = ports
        self._next = iter(ports)
        self._lock = threading.Lock()  # the cluster helper is driven from threads too

    def take(self) -> int:
        with self._lock:
            for port in self._next:
                if bindable(port):
                    return port
        raise RuntimeError(f"every port of this worker's band {self.ports.start}-"
                           f"{self.ports.stop - 1} was handed out or busy")


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_BAND = PortBand(band(*worker()))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no other test of this run gets and nothing was bound to a
    moment ago (for servers that cannot bind port 0, and for addresses nothing may listen on)."""
    return _BAND.take()


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]
