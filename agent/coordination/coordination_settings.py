"""The `coordination:` section: the backend's name, how peers are reached, the store, the budget, and when
one takes over (pure settings; the config wing reads the file, this wing owns what the keys mean). Which
names are backends, and what each needs of these keys, is `backend_registry`'s (`check`): this module
lists none."""

from __future__ import annotations

import dataclasses
import re

from agent.coordination.member_urls import template_fields
from agent.errors import ConfigValueError
from agent.model.config_schema import choice, duration, integer, mapping_of, opt, optional, section, text

GUID = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"


@dataclasses.dataclass(frozen=True)
class AzureBlobConfig:
    account_url: str | None = opt(optional(text(r"^https://[A-Za-z0-9.-]+(:\d+)?(/\S*)?$",
                                                 "https://ACCOUNT.blob.core.windows.net")), None,
                                  "the storage account's blob endpoint, https://ACCOUNT.blob.core.windows.net "
                                  "(or a private endpoint's name)")
    container: str = opt(text(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$",
                              "3-63 lower-case letters, digits and single hyphens"), "maintd",
                         "the container holding the records (create it; grant the VMs' identities Storage Blob "
                         "Data Contributor on it)")
    credential: str = opt(choice("managed_identity"), "managed_identity",
                          "managed_identity: the VM's identity, token from IMDS")
    client_id: str | None = opt(optional(text(GUID, "a GUID")), None,
                                "client id of a user-assigned identity (default: the system-assigned one)")
    connection_string_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                             "instead of the identity: a file (0600) holding a connection string "
                                             "(Azurite, tests)")

    def validate(self) -> None:
        if self.connection_string_file is None and self.account_url is None:
            raise ConfigValueError("account_url", "set account_url (https://ACCOUNT.blob.core.windows.net), or "
                                                  "connection_string_file")
        if self.connection_string_file is not None and self.client_id is not None:
            raise ConfigValueError("client_id", "client_id selects a managed identity; a connection string "
                                                "carries its own credentials")

    @property
    def describe(self) -> str:
        """The store as shown in `maintd status`: endpoint (or the connection string's file) and container."""
        where = self.account_url or f"connection string in {self.connection_string_file}"
        return f"{where} container {self.container}"


def parse_max_unavailable(value: object) -> int | str:
    """A count (>= 1) or a percentage of the group's members known to the store ("25%", 1-100)."""
    if isinstance(value, str) and (m := re.fullmatch(r"\s*(\d{1,3})\s*%\s*", value)) and 1 <= int(m.group(1)) <= 100:
        return f"{int(m.group(1))}%"
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100_000:
        return value
    raise ConfigValueError("", f"expected a count (>= 1) or a percentage such as \"25%\", got {value!r}")


def parse_advertise(value: object) -> str:
    """auto, none, or a base URL (scheme, host, port; no path) where this member takes wake hints."""
    if isinstance(value, str) and (value in ("auto", "none") or re.fullmatch(r"https?://[^\s/?#@]{1,200}", value)):
        return value
    raise ConfigValueError("", f"expected auto, none or a base URL such as http://10.0.0.5:8088, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
    group: str | None = opt(optional(text(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$", "letters, digits, _ . -")), None,
                            "the VMs that share this budget; default: this VM's scale set name (IMDS compute "
                            "vmScaleSetName), required when there is none")
    max_unavailable: int | str = opt(parse_max_unavailable, 1,
                                     "how many members may be out at once by maintd's choice: a count (>= 1) or a "
                                     "percentage of the group's members known to the store (\"25%\"; at least 1)")
    spread: str = opt(choice("none", "zone", "fault_domain"), "none",
                      "none | zone | fault_domain: with zone, maintd's choices never have members of two zones out "
                      "at once (zone and platformFaultDomain from IMDS compute)")
    release_after: float = opt(duration(10, 7 * 86400), 1800.0,
                               "a member that never comes back frees its place this long after its last renewal "
                               "(store time)")
    advertise: str = opt(parse_advertise, "auto",
                         "auto | none | http://HOST:PORT: the address this member writes into its entry of the "
                         "places record, shown in the fleet view only (no hint or credential is ever sent to an "
                         "address read from the record; hints go to wake_url); auto: this VM's private IP with the "
                         "server's port when server.listen is not loopback-only, else none")
    wake_url: str | None = opt(optional(text(r"^https?://\S+$", "a URL template such as http://{name}:8088")), None,
                               "where a release's wake hint goes, derived from the member's name as peer_url is "
                               "({name}, {computer_name}, {instance_id}; a value in the host part must be a host "
                               "name); unset: no hints (the head of the line reads the record every second)")
    fallback_poll: float = opt(duration(5, 3600), 120.0,
                               "the longest a waiting member goes between two reads of the record; the members "
                               "next in line read it every second, the rest less often the further back they are")
    rejoin_wait: float | None = opt(optional(duration(0, 3600)), None,
                                    "how long a member back in rotation keeps its place before the next member "
                                    "may leave: the load balancer sends it traffic again only after as many good "
                                    "probe answers as it took bad ones to stop; unset: probe.lb_timeout; 0s "
                                    "without a load balancer")
    member_ttl: float = opt(duration(300, 30 * 86400), 3600.0,
                            "a member counts towards a percentage max_unavailable while its stamp in the record is "
                            "younger than this; each member refreshes it every member_ttl / 3, even while idle, and "
                            "every write drops the stale ones")

    def validate(self) -> None:
        if self.wake_url is not None:
            try:
                template_fields(self.wake_url)
            except ValueError as exc:
                raise ConfigValueError("wake_url", str(exc)) from None


@dataclasses.dataclass(frozen=True)
class CoordinationConfig:
    backend: str = opt(text(r"^\S{1,64}$", "a coordination backend's name"), "peers",
                       "the backend the VMs coordinate through: one `backend_registry` knows (each says what it "
                       "does; the config's check refuses any other)")
    azure_blob: AzureBlobConfig | None = opt(optional(section(AzureBlobConfig)), None,
                                             "the store, with backend: azure_blob")
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
                                 "wait: an unreachable peer blocks approval; "
                                 "ignore: after peer_timeout it no longer does")
    peer_timeout: float = opt(duration(1, 86400), 120.0,
                              "with ignore: how long a peer must be unreachable to be ignored")
    takeover_after: float = opt(duration(1, 86400), 60.0,
                                "a VM approves in the leader's place once every lower-ranked peer is unreachable "
                                "this long")
    request_timeout: float = opt(duration(0.05, 30), 2.0,
                                 "timeout of one whole peer request (connect, answer head and body)")
    max_concurrency: int = opt(integer(1, 256), 16, "peers asked at once (requests to one peer go one after another)")
    peer_recheck_max: float = opt(duration(1, 300), 10.0,
                                  "longest wait before the leader asks a not-ready peer again (ready peers push)")
    approval_retry_for: float = opt(duration(1, 3600), 60.0, "how long one approval POST is retried with backoff")
    budget: BudgetConfig | None = opt(optional(section(BudgetConfig)), None,
                                      "a disruption budget shared by a group of VMs (backend azure_blob only; see "
                                      "Disruption budgets)")

    def validate(self) -> None:
        """The keys' own checks; what a backend needs of them is `backend_registry.check`'s (the config runs it)."""
        try:
            template_fields(self.peer_url)
        except ValueError as exc:
            raise ConfigValueError("peer_url", str(exc)) from None
