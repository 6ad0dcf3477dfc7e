"""Addresses as maintd writes them: whether a URL stays on this host (the one rule the IMDS client, with no
request gap towards an emulator, and the config, a poll interval under 0.2 s only towards one, share), and
a `listen` setting's host and port (the server's and the TCP probe's).

The server's check of who a *client* is (`agent.http.http_connection.is_loopback`) is stricter on purpose:
exactly 127.0.0.1 or ::1, since other 127.0.0.0/8 sources are how port forwarders reach it.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def is_loopback_url(url: str) -> bool:
    """The URL's host is `localhost`, 127.0.0.0/8 or ::1."""
    host = urlsplit(url).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def parse_listen(listen: str) -> tuple[str, int]:
    """('host', port) from 'host:port' or '[v6]:port'."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)
