"""maintd's memory is an operator-visible cost (issue 16: peak RSS under 35 MB with the shipped
config; issue 35: at most 28 MB, the documentation's naive urllib poller takes about 19.5 MB): every
module loaded stays resident for the life of the process. So a daemon built from a config imports only
what that config uses; the figures themselves are measured by `bench steady` (docs/PERFORMANCE.md),
this test guards which heavy parts stay out.

Each case runs in a fresh interpreter: the test process itself has imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SHIPPED = Path(__file__).resolve().parents[2] / "config" / "maintd.yaml"

BUILD = """
import dataclasses, json, sys, tempfile
from agent.cli import commands as cli
from agent.clock import SystemClock
from agent.config.config import load, loads
from agent.loop.daemon import Daemon
from agent.systemd import Notifier
from agent import deferred

cfg = load(sys.argv[1], check_perms=False) if sys.argv[1].endswith(".yaml") else loads(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    cfg = dataclasses.replace(cfg, state=dataclasses.replace(cfg.state, dir=tmp),
                              server=dataclasses.replace(cfg.server, listen="127.0.0.1:0"))
    daemon = Daemon(cfg, SystemClock(), notifier=Notifier({}))
    if "--scrape" in sys.argv:
        assert b"maintd_build_info" in daemon.parts.metrics.render()
print(json.dumps(sorted(m for m in sys.modules if deferred.loaded(m))))
"""

NOT_FOR_THE_SHIPPED_CONFIG = (
    "dateutil",  # recurrences only
    "agent.policy.recurrence",
    "zoneinfo",  # schedules with a time zone only
    "difflib",  # "did you mean" hints of a refused config only
    "agent.handlers.webhook",
    "agent.handlers.health_report",
    "agent.cli.cliclient",  # the commands that talk to a running daemon
    "agent.cli.clitext",  # their text and views: `maintd run` never prints them
    "agent.cli.cliviews",
    "agent.cli.cliwatch",
    "agent.coordination.store",  # the azure_blob backend only (the shipped one is the peers): its claim, budget
    # and fleet history, and their protocols (decision 0220)
    "agent.emulator",
    "agent.cli.demo",
    "agent.cli.docgen",
    "azure",  # the azure_blob coordination backend only
)
"""Modules a daemon built from the shipped config does not load (a prefix covers its submodules)."""


def loaded_after_build(config: str, *flags: str) -> set[str]:
    """The modules loaded by importing the CLI and building (not starting) the daemon from `config`
    (a path, or YAML text); `--scrape` renders /metrics once too. A module deferred (`agent.deferred`) and not
    used yet is not loaded: it is a stand-in, its code has not run."""
    out = subprocess.run([sys.executable, "-c", BUILD, config, *flags], capture_output=True, text=True,
                         timeout=60, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def offenders(loaded: set[str], heavy: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in heavy))


@pytest.fixture(scope="module")
def shipped() -> set[str]:
    return loaded_after_build(str(SHIPPED))


def test_the_shipped_config_loads_no_schedule_plugin_handler_or_tool_code(shipped):
    assert "agent.loop.daemon" in shipped
    assert offenders(shipped, NOT_FOR_THE_SHIPPED_CONFIG) == []


def test_the_shipped_config_loads_no_http_client_library(shipped):
    assert offenders(shipped, ("requests", "urllib3", "charset_normalizer", "idna", "importlib.metadata")) == []


DEPENDENCIES_NOT_USED_IDLE = (
    "asyncio",  # structlog imports it for its async log methods only (about 7 MB with what it imports)
    "ssl", "_ssl",  # http.client imports it for HTTPS only: libssl and libcrypto (about 5 MB)
    "_hashlib", "hmac",  # libcrypto again (3.5 MB): the token check compares without it
    "prometheus_client.exposition", "http.server", "urllib.request", "wsgiref",  # prometheus_client's package
    # __init__: its HTTP servers and clients, for an exposition maintd writes itself
)
"""What the dependencies would load at start for features maintd does not use (decision 0220)."""


TENACITY_LOADS_ASYNCIO = """
from agent import deferred
deferred.defer("asyncio")
import tenacity
print(deferred.loaded("asyncio"))
"""


@pytest.fixture(scope="module")
def not_used_idle() -> tuple[str, ...]:
    """DEPENDENCIES_NOT_USED_IDLE, less asyncio and ssl where tenacity itself loads asyncio (8.x, Debian 12's
    8.2: `from asyncio import sleep`; asyncio's SSL transport then loads ssl): tenacity retries the first
    compute call when `identity.name` is `auto`, so it is loaded at start."""
    out = subprocess.run([sys.executable, "-c", TENACITY_LOADS_ASYNCIO], capture_output=True, text=True, timeout=60,
                         check=True)
    if out.stdout.split()[-1] == "True":
        return tuple(m for m in DEPENDENCIES_NOT_USED_IDLE if m not in ("asyncio", "ssl", "_ssl"))
    return DEPENDENCIES_NOT_USED_IDLE


def test_the_shipped_config_loads_nothing_its_dependencies_import_for_features_maintd_does_not_use(
        shipped, not_used_idle):
    assert offenders(shipped, not_used_idle) == []


def test_a_metrics_scrape_loads_no_http_server_client_or_ssl_code(not_used_idle):
    """/metrics is written by maintd (agent.telemetry.metrics_text): a scraped daemon stays as small as an idle one."""
    assert offenders(loaded_after_build(str(SHIPPED), "--scrape"), not_used_idle) == []


def test_drain_and_exec_handlers_load_neither_webhook_nor_health_handler_code():
    loaded = loaded_after_build("handlers:\n"
                                "  - {name: drain, type: drain, phases: [scheduled, completed]}\n"
                                "  - {name: checkpoint, type: exec, phases: [scheduled], command: [/bin/true]}\n")
    assert {"agent.handlers.drain", "agent.handlers.exec"} <= loaded
    assert offenders(loaded, ("agent.handlers.webhook", "agent.handlers.health_report")) == []


def test_a_recurrence_loads_what_it_needs():
    loaded = loaded_after_build("profiles:\n"
                                "  - {name: default, approval: auto}\n"
                                "  - name: nights\n"
                                "    approval: auto\n"
                                "    recurrence: {frequency: day, time_zone: Europe/Stockholm,"
                                " schedule: {hours: [1], minutes: [0]}}\n")
    assert {"dateutil.rrule", "agent.policy.recurrence", "zoneinfo"} <= loaded


def test_the_store_backend_loads_the_azure_sdk_only_when_an_event_needs_the_store():
    """backend azure_blob: building the daemon loads the store backend but neither azure-storage-blob nor
    azure-core (about 17 MB); a store worker loads them after the loop's first tick, never the loop."""
    loaded = loaded_after_build("coordination:\n"
                                "  backend: azure_blob\n"
                                "  azure_blob: {account_url: 'https://acct.blob.core.windows.net',"
                                " container: maintd}\n")
    assert {"agent.coordination.store.store_backend", "agent.fleet.fleet_history"} <= loaded
    assert offenders(loaded, ("azure", "agent.coordination.store.blob_store",
                              "agent.coordination.store.identity_token")) == []


IMDS_EXCHANGE = """
import socket, sys, threading
from agent.imds.imds_connection import Connection

server = socket.create_server(("127.0.0.1", 0))

def answer() -> None:
    conn, _ = server.accept()
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
    conn.close()

threading.Thread(target=answer, daemon=True).start()
reply = Connection(f"http://127.0.0.1:{server.getsockname()[1]}").exchange(
    b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n", 5.0, 1024)
print(sorted(m for m in sys.modules if m in ("encodings.idna", "stringprep", "unicodedata")))
"""


def test_polling_imds_by_address_loads_no_international_domain_name_tables():
    """Every poll opens or reuses a connection to IMDS: resolving its ASCII address must not load the idna
    codec's tables (stringprep, unicodedata), which would stay resident for the life of the process."""
    out = subprocess.run([sys.executable, "-c", IMDS_EXCHANGE], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


NSS = """
import sys
from agent.config.config import load
load(sys.argv[1])
print(sorted({line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps") if "/libnss_" in line}))
"""


def test_a_config_owned_by_root_or_maintds_user_loads_no_name_service_module(tmp_path):
    """Checking who owns the config (and each directory above it) asks the system's user database only
    about an owner that is neither root nor the user maintd runs as: a lookup of a missing `maintd`
    account would load the NSS modules (libnss_systemd, about 0.5 MB resident) for the life of the process."""
    config = tmp_path / "maintd.yaml"
    config.write_text(SHIPPED.read_text())
    config.chmod(0o600)
    out = subprocess.run([sys.executable, "-c", NSS, str(config)], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
