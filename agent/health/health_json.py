"""Service Fabric's health JSON as maintd speaks it: /v1/health's body, its HealthEvents and
EventHealthEvaluations (filled by `health_store`), and the HealthInformation body of a ReportHealth (sent
by the `health` handler). Types only."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class HealthEventJson(TypedDict):
    """One stored report as /v1/health shows it (SequenceNumber as text, like SF's int64)."""

    SourceId: str
    Property: str
    HealthState: str
    Description: str
    SequenceNumber: str
    TimeToLiveInMilliSeconds: int | None
    RemoveWhenExpired: bool
    SentAt: str | None
    ReceivedAt: str | None
    IsExpired: bool
    LastOkTransitionAt: str | None
    LastWarningTransitionAt: str | None
    LastErrorTransitionAt: str | None


class EventHealthEvaluation(TypedDict):
    """Why the aggregated state is what it is: one of the events that make it so."""

    Kind: str
    Description: str
    AggregatedHealthState: str
    ConsiderWarningAsError: bool
    UnhealthyEvent: HealthEventJson


class HealthView(TypedDict):
    """The /v1/health body (`HealthStore.to_json`): also what the fleet gate and the store's markers read of this VM."""

    AggregatedHealthState: str
    UnhealthyEvaluations: list[EventHealthEvaluation]
    HealthEvents: list[HealthEventJson]


class HealthInformation(TypedDict):
    """The body of Service Fabric's ReportHealth."""

    SourceId: str
    Property: str
    HealthState: str
    Description: str
    SequenceNumber: str
    RemoveWhenExpired: bool
    TimeToLiveInMilliSeconds: NotRequired[str]
