"""TLS for the bus and the data plane: one setting, a directory of PEM files.

`DEADPOOL_TLS=DIR` (every command's `--tls DIR`) turns it on for every DeadPool process that inherits
it, and a launcher's members inherit it:

    DIR/ca.pem             the authority every client trusts: it verifies NATS servers and stores
    DIR/cert.pem, key.pem  this host's certificate and key, on hosts that serve (NATS servers, stores)
    DIR/routes/            ca.pem, cert.pem and key.pem of the NATS cluster's routes, on NATS hosts only

Clients verify the server's certificate and its name (the host in the NATS URL or the store's announced
address: the certificate must name it, as a DNS name or an IP address). Routes are mutual and under an
authority of their own: a NATS server opens a route to, and accepts one from, a server holding a
certificate of `routes/ca.pem` only, so no certificate a store or training host holds can join the
cluster (a rogue server with no users once joined a node's cluster port and read the swapper's commands).

Tokens authenticate the data plane and signatures the snapshots; TLS adds secrecy on the wire (the
token travels in every frame) and keeps a host on the path from reading or replaying frames.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TLS_ENV", "TlsFiles", "client_context", "from_env", "server_context"]

TLS_ENV = "DEADPOOL_TLS"
"""The directory of TLS files; unset or empty: plain TCP."""
HANDSHAKE_TIMEOUT_S = 2.0
"""How long a server waits for a TLS handshake (the data plane's `first_frame_s`)."""


@dataclass(frozen=True)
class TlsFiles:
    """A directory laid out as this module's docstring says."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.directory / "cert.pem"

    @property
    def key(self) -> Path:
        return self.directory / "key.pem"

    @property
    def routes(self) -> TlsFiles:
        return TlsFiles(self.directory / "routes")

    def require(self, *, serving: bool) -> None:
        """Raise FileNotFoundError naming the first file a client (or, `serving`, a server) lacks."""
        for path in (self.ca, self.cert, self.key) if serving else (self.ca,):
            if not path.is_file():
                raise FileNotFoundError(f"TLS is on ({TLS_ENV}={self.directory}) but {path} does not exist")


def from_env(env: dict[str, str] | None = None) -> TlsFiles | None:
    """The TLS files this process was given (`DEADPOOL_TLS`), or None: TLS is off."""
    directory = (os.environ if env is None else env).get(TLS_ENV, "")
    return TlsFiles(Path(directory)) if directory else None


def client_context(files: TlsFiles | None) -> ssl.SSLContext | None:
    """A context that verifies servers against `files.ca` and their names (None: TLS off)."""
    if files is None:
        return None
    files.require(serving=False)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_context(files: TlsFiles | None) -> ssl.SSLContext | None:
    """A context that serves `files.cert` (None: TLS off). Clients are not asked for a certificate:
    the data plane's job tokens say who they are."""
    if files is None:
        return None
    files.require(serving=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(files.cert), str(files.key))
    return context
