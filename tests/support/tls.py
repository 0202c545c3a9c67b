"""Real TLS material for tests, from `trustme`: a CA, a server certificate, and client
certificates with chosen DNS SANs (mTLS identities of the event bus), written to files because
the code under test reads file paths from its config.

`TlsMaterial.create(tmp_path)` makes a trusted CA plus a server certificate for `localhost`,
`127.0.0.1` and `bus.test` (a name only usable through `tls_server_name`). `client_cert("id")`
issues a client certificate whose DNS SAN is `id`; `untrusted_client_cert("id")` issues one from
another CA the server does not trust.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import trustme

SERVER_NAMES = ("localhost", "127.0.0.1", "bus.test")


@dataclass(frozen=True)
class CertFiles:
    cert: str
    key: str


@dataclass
class TlsMaterial:
    directory: Path
    ca: trustme.CA
    ca_file: str  # trust anchor for clients (server certificate) and the server (client certs)
    server: CertFiles
    _other_ca: trustme.CA = field(default_factory=trustme.CA)
    _n: itertools.count[int] = field(default_factory=itertools.count)

    @classmethod
    def create(cls, directory: Path, server_names: tuple[str, ...] = SERVER_NAMES) -> TlsMaterial:
        directory.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        ca_file = directory / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        server = _write(ca.issue_cert(*server_names), directory, "server")
        return cls(directory, ca, str(ca_file), server)

    def client_cert(self, *dns_names: str) -> CertFiles:
        """A client certificate signed by the trusted CA, with exactly these DNS SANs."""
        return _write(self.ca.issue_cert(*dns_names), self.directory, f"client{next(self._n)}")

    def untrusted_client_cert(self, *dns_names: str) -> CertFiles:
        """A client certificate from a CA the server does not trust."""
        return _write(self._other_ca.issue_cert(*dns_names), self.directory,
                      f"rogue{next(self._n)}")

    def untrusted_server(self, *names: str) -> CertFiles:
        """A server certificate from a CA clients do not trust."""
        return _write(self._other_ca.issue_cert(*(names or SERVER_NAMES)), self.directory,
                      f"rogue-server{next(self._n)}")


def _write(cert: trustme.LeafCert, directory: Path, stem: str) -> CertFiles:
    cert_file = directory / f"{stem}.crt"
    key_file = directory / f"{stem}.key"
    # Leaf first, then the chain to the CA (what a server or client presents).
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_file))
    return CertFiles(str(cert_file), str(key_file))
