"""TLS files made by the test (trustme), laid out as `deadpool_runtime.tls` reads them."""

from __future__ import annotations

from pathlib import Path

import trustme

from deadpool_runtime.tls import TlsFiles

NAMES = ("127.0.0.1", "localhost")
"""What the servers' certificates name: every test server listens on loopback."""


def write_identity(files: TlsFiles, authority: trustme.CA) -> None:
    """`files.ca` trusting `authority`, and a certificate of it (with its key) naming loopback."""
    files.directory.mkdir(parents=True, exist_ok=True)
    authority.cert_pem.write_to_path(str(files.ca))
    issued = authority.issue_cert(*NAMES)
    issued.private_key_pem.write_to_path(str(files.key))
    files.cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    files.key.chmod(0o600)


def make_tls_files(directory: Path) -> TlsFiles:
    """A deployment's TLS directory: one authority for clients and servers, another for routes."""
    files = TlsFiles(directory)
    write_identity(files, trustme.CA())
    write_identity(files.routes, trustme.CA())
    return files
