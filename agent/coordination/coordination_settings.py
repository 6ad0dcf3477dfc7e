"""The `coordination:` section: how peers are reached and when one takes over (pure settings; the
config wing reads the file, this wing owns what the keys mean)."""

from __future__ import annotations

import dataclasses

from agent.coordination.peer_addressing import template_fields
from agent.errors import ConfigValueError
from agent.model.config_schema import choice, duration, integer, mapping_of, opt, optional, text


@dataclasses.dataclass(frozen=True)
class CoordinationConfig:
    peer_url: str = opt(text(r"^https?://\S+$", "a URL template such as http://{computer_name}:8088"),
                        "http://{computer_name}:8088",
                        "how to reach a peer named in Resources: {name}, {computer_name} (derived on a Uniform "
                        "scale set, else the name), {instance_id}")
    peers: dict[str, str] = opt(mapping_of(text(r"^https?://\S+$", "a base URL such as http://10.0.0.5:8088")), {},
                                "static map VM name -> base URL; wins over peers_file and peer_url")
    peers_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                 "YAML/JSON map VM name -> base URL, reread when it changes; wins over peer_url")
    token_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                 "shared bearer token peers send (and this VM requires) on /v1 reads")
    unreachable_peers: str = opt(choice("wait", "ignore"), "wait",
                                 "wait: an unreachable peer blocks approval; ignore: after peer_timeout it no longer does")
    peer_timeout: float = opt(duration(1, 86400), 120.0, "with ignore: how long a peer must be unreachable to be ignored")
    takeover_after: float = opt(duration(1, 86400), 60.0,
                                "a VM approves in the leader's place once every lower-ranked peer is unreachable this long")
    request_timeout: float = opt(duration(0.05, 30), 2.0, "timeout of one peer readiness request")
    max_concurrency: int = opt(integer(1, 256), 16, "peers asked at once (requests to one peer go one after another)")
    peer_recheck_max: float = opt(duration(1, 300), 10.0,
                                  "longest wait before the leader asks a not-ready peer again (ready peers push)")
    approval_retry_for: float = opt(duration(1, 3600), 60.0, "how long one approval POST is retried with backoff")

    def validate(self) -> None:
        try:
            template_fields(self.peer_url)
        except ValueError as exc:
            raise ConfigValueError("peer_url", str(exc)) from None
