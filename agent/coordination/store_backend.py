"""The blob store backend as the coordinator uses it: its config section, the store and its token, the
inputs to each event's decision, the claim around the POST, and the views.

The coordinator calls `begin` and `end` around its tick, `inputs` for each Scheduled event naming
this VM, and `claim`/`settle` on its approver thread. azure-storage-blob is imported by `_open`
only, on a store worker, the first time an event names this VM: a daemon whose events never need
the store never loads the SDK.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agent.clock import Clock
from agent.config.config_schema import choice, opt, optional, text
from agent.coordination.identity_token import Fetch
from agent.coordination.store_exchange import Claim, Snapshot, Store, StoreExchange
from agent.coordination.store_protocol import PREPARING, READY, Step, unstorable
from agent.errors import ConfigValueError
from agent.health.health_store import HealthState, HealthStore
from agent.metrics import Metrics

SOURCE = "coordination"
GUID = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
CONNECTION_STRING_KEY = "coordination.azure_blob.connection_string_file"


@dataclass(frozen=True)
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


def marker_state(pending: Sequence[str]) -> str:
    """What this VM records for an event: ready once no local handler holds it."""
    return PREPARING if pending else READY


class StoreBackend:
    """The coordinator's side of the store: thread use as in `store_exchange` (loop, workers, approver)."""

    def __init__(self, config: AzureBlobConfig, *, token: Fetch, clock: Clock, metrics: Metrics,
                 health: HealthStore, secret: Callable[[str, str | None], str | None],
                 on_change: Callable[[], None], takeover_after: Callable[[], float]) -> None:
        self.config = config
        self.token = token
        self.clock = clock
        self.metrics = metrics
        self.health = health
        self.secret = secret
        self.takeover_after = takeover_after
        self.exchange = StoreExchange(self._open, config.describe, clock, on_change=on_change, report=self._report,
                                      takeover_after=takeover_after)
        health.set(SOURCE, "store", HealthState.OK, f"{config.describe}: no request yet (none until an event "
                                                     "names this VM)")

    def _open(self) -> Store:
        from agent.coordination.blob_store import BlobStore, Settings
        from agent.coordination.identity_token import ManagedIdentityCredential

        c = self.config
        count = self._count
        if c.connection_string_file is not None:
            conn = self.secret(CONNECTION_STRING_KEY, c.connection_string_file)
            return BlobStore.open(Settings(c.account_url or "", c.container, connection_string=conn), count)
        credential = ManagedIdentityCredential(self.token, c.client_id, lambda: self.clock.now().timestamp())
        return BlobStore.open(Settings(c.account_url or "", c.container, credential=credential), count)

    def _count(self, op: str, outcome: str) -> None:
        self.metrics.store_requests.labels(op, outcome).inc()

    def _report(self, prop: str, ok: bool, description: str) -> None:
        self.health.set(SOURCE, prop, HealthState.OK if ok else HealthState.WARNING, description)

    # --- the loop ------------------------------------------------------------------------------

    def begin(self) -> None:
        """Take in what the store answered since the last tick."""
        self.exchange.apply(self.clock.monotonic())

    def inputs(self, event_id: str, resources: Sequence[str], vm_name: str, pending: Sequence[str],
               may_approve: bool, immediate: bool) -> tuple[list[str], Step]:
        """Queue this event's store requests; (who is not recorded ready, the protocol's next step)."""
        why = unstorable(event_id, resources)
        if why is not None:
            return list(resources), Step("wait", f"not coordinated through the store: {why}")
        self.exchange.run(event_id, resources, vm_name, marker_state(pending), may_approve, self.clock.monotonic())
        return self.exchange.verdict(event_id, resources, vm_name, self.takeover_after(), not immediate)

    def end(self, pending: set[str]) -> Snapshot:
        """Forget the events no longer pending; publish the snapshot the API reads."""
        self.exchange.forget(pending)
        return self.exchange.publish()

    # --- the approver --------------------------------------------------------------------------

    def claim(self, event_id: str, vm_name: str, step: Step) -> Claim:
        return self.exchange.claim(event_id, vm_name, step)

    def settle(self, event_id: str, vm_name: str, claim: Claim, approved: bool) -> bool:
        return self.exchange.settle(event_id, vm_name, claim, approved)

    # --- views ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """For `maintd status`: the store, its last answer and how long ago."""
        snap = self.exchange.snapshot
        age = None if snap.last_answer_at is None else round(self.clock.monotonic() - snap.last_answer_at, 1)
        return {"backend": "azure_blob", "store": snap.store, "store_last_answer": snap.last_outcome,
                "store_last_answer_seconds_ago": age}

    def fleet(self) -> list[dict[str, Any]]:
        """For `maintd fleet`: each pending event's VMs and state, and who approved (or claimed) and when."""
        return [{"event_id": v.event_id, "source": "store",
                 "vms": [{"name": n, "state": s} for n, s in v.vms],
                 "approval": None if v.approval is None else {
                     "by": v.approval.by, "state": v.approval.state, "attempt": v.approval.attempt,
                     "at": v.approval.at.isoformat() if v.approval.at else None},
                 "store_error": v.error, "problems": list(v.problems)}
                for v in self.exchange.snapshot.events]

    def wait_idle(self, timeout: float) -> bool:
        return self.exchange.wait_idle(timeout)

    def stop(self) -> None:
        self.exchange.stop()

