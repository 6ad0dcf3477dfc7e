"""Azurite (Microsoft's storage emulator) for the store backend's tests: blob only, in memory, on 127.0.0.1.

`./dev.sh test` installs it into .azurite/ (npm, git-ignored); `.ci/run` installs Debian's nodejs
and npm first. Without node the tests that need it are skipped with the reason, except in CI
(MAINTD_CI=1), where they fail: a green CI must have run them.

    from tests.azurite import azurite  # noqa: F401 - the fixture

`start(tmp_path, oauth=True)` runs it over HTTPS with a self-signed certificate made at test time
and `--oauth basic` (bearer tokens checked for issuer, audience and lifetime, not signature).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.harness import free_port
from tests.reaper import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account key (public, in its README)."""


def binary() -> str:
    """The azurite-blob command, or skip (fail in CI) saying what is missing."""
    found = os.environ.get("MAINTD_AZURITE") or (str(LOCAL) if LOCAL.exists() else shutil.which("azurite-blob"))
    if found:
        return found
    reason = ("Azurite is not installed: ./dev.sh test installs it with npm into .azurite/"
              if shutil.which("node") else "node is not installed (apt-get install nodejs npm), so Azurite cannot run")
    if os.environ.get("MAINTD_CI") == "1":
        pytest.fail(f"CI must run the Azure Storage tests: {reason}")
    pytest.skip(reason)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1, valid for a day (the test's own CA bundle is the certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "azurite-cert.pem", directory / "azurite-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@dataclass
class Azurite:
    """One running Azurite: where it listens, its connection string, and how to stop and start it again."""

    port: int
    scheme: str
    args: list[str]
    process: subprocess.Popen[bytes] | None = None
    cert: Path | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/{ACCOUNT}"

    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol={self.scheme};AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint={self.url};")

    def start(self, timeout: float = 30.0) -> None:
        """Start it (again, after `stop`: in memory, so it starts empty) and wait until it accepts connections."""
        self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"Azurite exited with {self.process.returncode}: {err[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"Azurite did not listen on 127.0.0.1:{self.port} within {timeout}s")

    def stop(self) -> None:
        """Kill it (the store becomes unreachable at once)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()

    def new_container(self) -> str:
        """A fresh container (each test its own), created with the account key."""
        return self.create_container(f"t{uuid.uuid4().hex[:20]}")

    def create_container(self, name: str) -> str:
        """Create `name` (again, after a restart emptied the in-memory store)."""
        from azure.storage.blob import BlobServiceClient

        verify = str(self.cert) if self.cert else True
        with BlobServiceClient.from_connection_string(self.connection_string(), connection_verify=verify) as service:
            service.create_container(name)
        return name


def start(tmp_path: Path, *, oauth: bool = False) -> Azurite:
    """A new Azurite on a free port; with `oauth`, HTTPS with a fresh self-signed certificate and bearer tokens."""
    port = free_port()
    args = [binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
            "--skipApiVersionCheck", "--loose", "--silent", "--disableProductStyleUrl"]
    cert = None
    if oauth:
        cert, key = self_signed(tmp_path)
        args += ["--cert", str(cert), "--key", str(key), "--oauth", "basic"]
    server = Azurite(port, "https" if oauth else "http", args, cert=cert)
    server.start()
    return server


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """One Azurite for the session (tests isolate themselves with `new_container`)."""
    server = start(tmp_path_factory.mktemp("azurite"))
    yield server
    server.stop()
