"""The daemon's answers as text for `maintd status`, `events`, `events --history`, `fleet` and `health`.

Pure: each function takes the JSON the daemon (or the journal) gave and returns lines. Fields it does
not know yet are still shown, as text, in a section of their own: a new field never turns into a Python
repr, and never disappears. `--json` does not come here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from agent.cli.clitext import NONE, Row, duration, instant, pairs, section, table, text, when, yes_no
from agent.model.outcomes import PREPARATION_STARTED

WIDTH = 20
"""Where the values of `maintd status`'s sections start, so that every section lines up."""
SHOWN_STATUS = {"version", "vm_name", "dry_run", "in_rotation", "rotation_reason", "drains", "health", "imds",
                "events", "events_naming_this_vm", "not_ready", "state", "profile", "profile_approval",
                "profile_next_change", "restart_needed", "coordination", "peers", "notes", "cluster"}
"""The keys of /v1/status that `status_text` words itself; any other is shown under "Other"."""
EVENT_FIELDS = {"EventId", "EventType", "ResourceType", "Resources", "EventStatus", "NotBefore", "Description",
                "EventSource", "DurationInSeconds", "LiveMigration", "vm_name", "present", "names_self", "rank",
                "first_seen", "ready", "not_ready", "results", "history", "outcome", "plan", "approval",
                "approval_mode", "approval_rule", "approval_decision", "approval_held", "acting_leader",
                "readiness_pushed_to", "peers_ready", "peers_known", "peers"}
"""The keys of /v1/events/{id} that `event_text` words itself."""


def _other(body: Mapping[str, Any], shown: set[str], width: int = 0) -> list[str]:
    """A section for the fields this version of the CLI has no words for (every one shown, as text)."""
    rows = [(name, value) for key, value in body.items() if key not in shown
            for name, value in (pairs({key: value}) or [(key, NONE)])]
    return ["", *section("Other", rows, width=width)] if rows else []


# --- maintd status ----------------------------------------------------------------------------

def status_text(body: Mapping[str, Any]) -> str:
    """`maintd status`: the daemon, rotation, IMDS, events, state, coordination, then the peers of each event."""
    imds, state = body.get("imds") or {}, body.get("state") or {}
    drains = body.get("drains") or {}
    since_poll = imds.get("last_success_seconds_ago")
    profile = f"{text(body.get('profile'))} (approval {text(body.get('profile_approval'))})"
    restart = body.get("restart_needed") or []
    lines = [f"maintd {text(body.get('version'))} on {text(body.get('vm_name'))}", ""]
    lines += section("Daemon", [
        ("health", text(body.get("health"))),
        ("dry run", yes_no(body.get("dry_run"))),
        ("profile", profile),
        ("next profile change", when(body.get("profile_next_change"))),
        ("restart needed", f"{text(restart)} (changed by a reload; restart maintd to apply)" if restart else NONE)],
        width=WIDTH)
    lines += ["", *section("Rotation", [
        ("in rotation", yes_no(body.get("in_rotation"))),
        ("reason", "draining (see drains)" if drains and str(body.get("rotation_reason")).startswith("draining (")
         else text(body.get("rotation_reason"))),
        ("drains", [f"{key}  since {when(d.get('since'))}: {text(d.get('reason'))}" if isinstance(d, Mapping)
                    else f"{key}: {text(d)}" for key, d in drains.items()])], width=WIDTH)]
    lines += ["", *section("IMDS", [
        ("endpoint", text(imds.get("endpoint"))),
        ("last answer", NONE if since_poll is None else f"{duration(since_poll)} ago"),
        ("failures in a row", text(imds.get("consecutive_failures"))),
        ("polls", text(imds.get("polls"))),
        ("document incarnation", text(imds.get("document_incarnation")))], width=WIDTH)]
    not_ready = body.get("not_ready") or {}
    lines += ["", *section("Events", [
        ("tracked", text(body.get("events"))),
        ("naming this VM", text(body.get("events_naming_this_vm"))),
        ("not ready", [f"{eid}: {why}" for eid, reasons in not_ready.items() for why in (reasons or [])])],
        width=WIDTH)]
    lines += _notes([(eid, text(note)) for eid, note in _mapping(body.get("notes")).items()], WIDTH)
    cluster = _mapping(body.get("cluster"))
    if cluster:
        lines += ["", *section("Cluster", [(key, text(value)) for key, value in cluster.items()], width=WIDTH)]
    lines += ["", *section("State", [
        ("directory", text(state.get("dir"))),
        ("unsaved changes", yes_no(state.get("unsaved_changes"))),
        ("write error", text(state.get("write_error")))], width=WIDTH)]
    lines += ["", *_coordination(body.get("coordination") or {})]
    for event_id, peers in (body.get("peers") or {}).items():
        lines += ["", *_peers_of(event_id, peers)]
    lines += _other(body, SHOWN_STATUS, width=WIDTH)
    return "\n".join(lines)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _notes(rows: list[Row], width: int = 0) -> list[str]:
    """What the handlers keep noted (an Alertmanager silence: its ids, its end, on how many replicas), under a
    heading of its own; nothing while no handler keeps a note."""
    return ["", *section("Handler notes", rows, width=width)] if rows else []


def _coordination(c: Mapping[str, Any]) -> list[str]:
    """The backend, then what it publishes: a store and its last answer, or the peers' sources; any other field
    as it comes (a backend this view does not know shows its own fields)."""
    backend = c.get("backend")
    if "store" in c:
        ago = c.get("store_last_answer_seconds_ago")
        rows: list[Row] = [("store", text(c.get("store"))),
                           ("last answer", f"{text(c.get('store_last_answer'))}"
                                           + (f", {duration(ago)} ago" if ago is not None else ""))]
        shown = {"backend", "store", "store_last_answer", "store_last_answer_seconds_ago"}
    elif "peer_url" in c:
        me = c.get("identity")
        rows = [("peer URL template", text(c.get("peer_url"))),
                ("static peers", text(c.get("peers_static"))),
                ("peers file", text(c.get("peers_file"))
                 + (f" ({text(c.get('peers_file_entries'))} entries)" if c.get("peers_file") else "")),
                ("peers file problem", text(c.get("peers_file_problem"))),
                ("identity", ", ".join(f"{k.replace('_', ' ')} {text(v)}" for k, v in me.items())
                 if isinstance(me, Mapping) else "- (not learnt from IMDS; identity.name is used)")]
        shown = {"backend", "peer_url", "peers_static", "peers_file", "peers_file_entries", "peers_file_problem",
                 "identity"}
    else:
        rows, shown = [], {"backend"}
    rows += [(name, value) for key, value in c.items() if key not in shown for name, value in pairs({key: value})]
    return section(f"Coordination (backend {text(backend)})", rows, width=WIDTH)


def _peers_of(event_id: str, peers: Any) -> list[str]:
    """Each other VM an event names, its address, how it was found, its last answer."""
    if not peers:
        return [f"Peers of {event_id}", "  none: the event names only this VM"]
    if not isinstance(peers, Mapping):
        return [f"Peers of {event_id}", f"  {text(peers)}"]
    return section(f"Peers of {event_id}", [(name, text(how)) for name, how in peers.items()], width=WIDTH)


# --- maintd events ----------------------------------------------------------------------------

def _approval_cell(event: Mapping[str, Any]) -> str:
    """sent/failed, `held: <gate>` while a gate holds it, else -."""
    held = event.get("approval_held")
    if isinstance(held, Mapping) and held:
        return f"held: {text(held.get('gate'))}"
    approval = event.get("approval")
    return text(approval.get("status")) if isinstance(approval, Mapping) else NONE


def _plan_cells(event: Mapping[str, Any]) -> tuple[str, str]:
    """PREPARE and APPROVE FROM of the plan: `<time> (<reason>)` while held, `started`, `-` without a plan."""
    plan = event.get("plan")
    if not isinstance(plan, Mapping):
        return NONE, NONE
    prepare = PREPARATION_STARTED if plan.get("preparation") == PREPARATION_STARTED else \
        f"{when(plan.get('prepare_at'))} ({text(plan.get('prepare_reason'))})"
    reason = plan.get("approve_reason")
    approve = f"{when(plan.get('approve_not_before'))} (window)" if reason == "window" else text(reason)
    return prepare, approve


def events_text(events: Sequence[Mapping[str, Any]]) -> str:
    """`maintd events`: one row per event, then why each event naming this VM is not ready yet."""
    if not events:
        return "no events"
    rows = [(text(e.get("EventId")), text(e.get("EventType")), text(e.get("EventStatus")), when(e.get("NotBefore")),
             yes_no(e.get("names_self")), text(e.get("rank")), yes_no(e.get("ready")) if e.get("names_self") else NONE,
             *_plan_cells(e),
             _approval_cell(e), text(e.get("Resources"))[:40]) for e in events]
    lines = table(("EVENT ID", "TYPE", "STATUS", "NOT BEFORE", "THIS VM", "RANK", "READY", "PREPARE", "APPROVE FROM",
                   "APPROVAL", "RESOURCES"), rows)
    why = [f"{e.get('EventId')} not ready: {text(reason)}" for e in events for reason in e.get("not_ready") or []]
    return "\n".join(lines + ([""] + why if why else []))


def handler_rows(results: Mapping[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """HANDLER, PHASE, OUTCOME, ATTEMPT, TOOK (or since when it runs), DETAIL for each `handler:<name>:<phase>`."""
    rows = []
    for key, r in results.items():
        kind, _, rest = key.partition(":")
        if kind != "handler" or not isinstance(r, Mapping):
            continue
        name, _, phase = rest.rpartition(":")
        took = duration(r["duration_seconds"]) if isinstance(r.get("duration_seconds"), (int, float)) else \
            f"since {when(r.get('started_at'))}" if r.get("started_at") else NONE
        detail = text(r.get("detail")) + (f" (on_failure: {r['on_failure']})"
                                          if r.get("outcome") not in ("ok", "running") and r.get("on_failure") else "")
        if r.get("background") is True:  # a non-holding run past its first try
            detail = "in the background; preparation went on" if r.get("outcome") == "running" else \
                f"{detail} (went on in the background)"
        rows.append((name or rest, phase, text(r.get("outcome")), text(r.get("attempt")), took, detail))
    return rows


def _note(note: Mapping[str, Any]) -> list[str]:
    """A handler's note on an event: its summary, then each Alertmanager's silence (id and end) or error."""
    silences = _mapping(note.get("silences"))
    return [text(note.get("summary")) + (f" ({text(note['state'])})" if note.get("state") else ""),
            *(f"{url}: " + (f"error {text(s.get('error'))}" if s.get("error") else
                            f"silence {text(s.get('id'))} until {when(s.get('ends_at'))}")
              for url, s in silences.items() if isinstance(s, Mapping))]


def event_text(e: Mapping[str, Any]) -> str:
    """`maintd events ID`: the event, this VM's part, the plan, each handler run, the approval, the peers, its
    history, and any record the CLI has no words for."""
    peers_known = e.get("peers_known")
    lines = section(f"Event {text(e.get('EventId'))}", [
        ("type", f"{text(e.get('EventType'))} ({text(e.get('EventSource'))}, {text(e.get('ResourceType'))})"),
        ("status", text(e.get("EventStatus")) + ("" if e.get("present", True) else " (gone from IMDS)")),
        ("not before", when(e.get("NotBefore"))),
        ("duration", duration(e["DurationInSeconds"]) if isinstance(e.get("DurationInSeconds"), int)
         and e["DurationInSeconds"] >= 0 else "unknown"),
        ("resources", text(e.get("Resources"))),
        ("description", text(e.get("Description"))),
        ("first seen", when(e.get("first_seen"))),
        ("outcome", text(e.get("outcome")))])
    lines += ["", *section(f"This VM ({text(e.get('vm_name'))})", [
        ("named", yes_no(e.get("names_self"))),
        ("rank", text(e.get("rank"))),
        ("ready", yes_no(e.get("ready"))),
        ("not ready", list(e.get("not_ready") or []))])]
    plan = e.get("plan")
    if isinstance(plan, Mapping):
        lines += ["", *section("Plan", [
            ("preparation", text(plan.get("preparation"))),
            ("prepare at", f"{when(plan.get('prepare_at'))} ({text(plan.get('prepare_reason'))}): "
                           f"{text(plan.get('prepare_detail'))}"),
            ("approve from", f"{when(plan.get('approve_not_before'))} ({text(plan.get('approve_reason'))}): "
                             f"{text(plan.get('approve_detail'))}"),
            ("window", text(plan.get("window"))),
            ("lead time", text(plan.get("lead_time")))])]
    results = e.get("results") or {}
    rows = handler_rows(results)
    lines += ["", "Handlers", *(table(("HANDLER", "PHASE", "OUTCOME", "ATTEMPT", "TOOK", "DETAIL"), rows, "  ")
                                if rows else ["  none run yet"])]
    approval: Mapping[str, Any] = e["approval"] if isinstance(e.get("approval"), Mapping) else {}
    held: Mapping[str, Any] = e["approval_held"] if isinstance(e.get("approval_held"), Mapping) else {}
    lines += ["", *section("Approval", [
        ("status", text(approval.get("status")) if approval else "not sent"),
        ("by", text(approval.get("by"))), ("at", when(approval.get("at"))),
        ("reason", text(approval.get("reason"))), ("attempts", text(approval.get("attempts"))),
        ("mode", text(e.get("approval_mode"))), ("rule", text(e.get("approval_rule"))),
        ("decision", text(e.get("approval_decision"))),
        ("held", f"{text(held.get('gate'))}: {text(held.get('reason'))}" if held else NONE),
        ("acting leader", text(e.get("acting_leader"))),
        ("readiness pushed to", text(e.get("readiness_pushed_to")))])]
    peers = e.get("peers") or {}
    if peers:
        prow = [(name, yes_no(p.get("ready")), text(p.get("detail")),
                 f"{text(p.get('url'))} (via {text(p.get('via'))})",
                 duration(p.get("unreachable_seconds")) if p.get("unreachable_seconds") else NONE)
                for name, p in peers.items() if isinstance(p, Mapping)]
        lines += ["", f"Peers ({text(e.get('peers_ready'))} of {text(peers_known)} ready)",
                  *table(("VM", "READY", "ANSWER", "ADDRESS", "UNREACHABLE FOR"), prow, "  ")]
    elif e.get("names_self") and len(e.get("Resources") or []) <= 1:
        lines += ["", "Peers", "  none: the event names only this VM"]
    lines += _notes([(key.partition(":")[2], _note(note)) for key, note in results.items()
                     if key.startswith("note:") and isinstance(note, Mapping)])
    records = {k: v for k, v in results.items() if not k.startswith(("handler:", "note:")) and k not in ("approval",)}
    if records:
        lines += ["", *section("Records", [(k, text(v)) for k, v in records.items()])]
    history = [h for h in e.get("history") or [] if isinstance(h, Mapping)]
    if history:
        lines += ["", "History", *table(("AT", "WHAT", "STATUS"), [
            (when(h.get("at")), text(h.get("kind")), text(h.get("status"))) for h in history], "  ")]
    return "\n".join(lines + _other(e, EVENT_FIELDS))


# --- maintd fleet, health, events --history ----------------------------------------------------

def fleet_text(body: Mapping[str, Any]) -> str:
    """`maintd fleet`: per event naming this VM, who approved (or holds the claim) and when, then each VM's state."""
    events = body.get("events") or []
    group = budget_lines(body.get("budget"))
    if not events:
        return "\n".join([f"no pending event names {text(body.get('vm_name'))} (backend {text(body.get('backend'))})",
                          *group])
    lines: list[str] = []
    for event in events:
        a = event.get("approval")
        approval = (f"{text(a.get('state'))} by {text(a.get('by'))}" + (f" at {when(a['at'])}" if a.get("at") else "")
                    + (f" (attempt {a['attempt']})" if a.get("attempt") else "")) if isinstance(a, Mapping) else \
            "none yet"
        vms = [v for v in event.get("vms") or [] if isinstance(v, Mapping)]
        lines += [*([""] if lines else []), f"Event {text(event.get('event_id'))}",
                  f"  from the {text(event.get('source'))}; approval: {approval}"]
        if event.get("store_error"):
            lines.append(f"  store: {text(event['store_error'])}")
        lines += table(("VM", "STATE"), [(text(v.get("name")), text(v.get("state"))) for v in vms], "  ")
        if len(vms) == 1:
            lines.append("  (the event names only this VM)")
        lines += [f"  problem: {text(p)}" for p in event.get("problems") or []]
    return "\n".join(lines + group)


def budget_lines(b: Any) -> list[str]:
    """The disruption budget's group in `maintd fleet`: its places, who holds one since when and why, who waits."""
    if not isinstance(b, Mapping):
        return []
    holders = [h for h in b.get("holders") or [] if isinstance(h, Mapping)]
    waiting = [w for w in b.get("waiting") or [] if isinstance(w, Mapping)]
    lines = ["", f"Budget {text(b.get('group'))}: {text(b.get('places'))} place(s) (max_unavailable "
                 f"{text(b.get('max_unavailable'))}, spread {text(b.get('spread'))}), "
                 f"{text(b.get('members_known'))} members known"]
    if b.get("store_error"):
        lines.append(f"  store: {text(b['store_error'])}")
    lines += [f"  this VM lost its place for {text(x.get('event_id'))} at {when(x.get('at'))}: "
              f"{text(x.get('reason'))}; back in rotation, queued again" for x in b.get("lost") or []
              if isinstance(x, Mapping)]
    if b.get("odd_records"):
        lines.append(f"  odd records: {text(b['odd_records'])} found and ignored "
                     "(the Warning coordination/budget_records)")
    rows = [(text(h.get("vm")), "out", text(h.get("why")), when(h.get("since")), text(h.get("event_id")))
            for h in holders] + [(text(w.get("vm")), "waits", "-", when(w.get("since")), text(w.get("event_id")))
                                 for w in waiting]
    return lines + (table(("VM", "STATE", "WHY", "SINCE", "EVENT"), rows, "  ") if rows else ["  nobody out"])


def history_summary(summary: Mapping[str, Any]) -> str:
    """An event's summary line: VMs, the most out at once, the longest time out of rotation, who was not prepared."""
    late = summary.get("not_prepared_before_start") or []
    forced = summary.get("forced") or []
    longest = (f"{duration(summary['longest_out_seconds'])} ({text(summary.get('longest_out_vm'))})"
               if isinstance(summary.get("longest_out_seconds"), (int, float)) else "-")
    return (f"{text(summary.get('vms'))} VMs, at most {text(summary.get('most_out_at_once'))} out at once, "
            f"longest out of rotation {longest}, "
            + (f"not prepared before start: {', '.join(map(text, late))}" if late else "all prepared before start")
            + (f", forced: {', '.join(map(text, forced))}" if forced else ""))


def fleet_history_text(body: Mapping[str, Any]) -> str:
    """`maintd fleet --history`: per past event of the group, its summary line, then each VM once."""
    events = [e for e in body.get("events") or [] if isinstance(e, Mapping)]
    head = f"group {text(body.get('group'))}: events ended since {when(body.get('since'))}"
    if body.get("unreadable_records"):
        head += f" ({text(body['unreadable_records'])} unreadable records left out)"
    if not events:
        return head + "\nnone"
    lines = [head]
    for e in events:
        summary: Mapping[str, Any] = e["summary"] if isinstance(e.get("summary"), Mapping) else {}
        approved = f"approved by {text(e.get('approved_by'))} at {when(e.get('approved_at'))}" \
            if e.get("approved_by") else "not approved early"
        vms = [v for v in e.get("vms") or [] if isinstance(v, Mapping)]
        lines += ["", f"Event {text(e.get('event_id'))} {text(e.get('event_type'))}, ended {when(e.get('ended_at'))}, "
                      f"{approved}", f"  {history_summary(summary)}"]
        lines += table(("VM", "OUT", "BACK", "OUT FOR", "READY", "PREPARED BEFORE START", "BUDGET"),
                       [(text(v.get("vm")), when(v.get("out_at")), when(v.get("back_at")),
                         duration(v.get("out_seconds")), when(v.get("ready_at")),
                         yes_no(v.get("prepared_before_start")), text(v.get("chosen_or_forced"))) for v in vms], "  ")
    return "\n".join(lines)


def health_text(body: Mapping[str, Any]) -> str:
    """`maintd health`: the aggregated state, then each report with its source, since when, and what it says."""
    rows = [(text(ev.get("HealthState")), f"{text(ev.get('SourceId'))}/{text(ev.get('Property'))}",
             when(ev.get(f"Last{ev.get('HealthState', '')}TransitionAt") or ev.get("SentAt")),
             text(ev.get("Description")) + (" (expired)" if ev.get("IsExpired") else ""))
            for ev in body.get("HealthEvents") or [] if isinstance(ev, Mapping)]
    head = f"health: {text(body.get('AggregatedHealthState'))}"
    return "\n".join([head, "", *table(("STATE", "REPORT", "SINCE", "DESCRIPTION"), rows)] if rows else
                     [head, "no reports"])


def select_history(entries: Sequence[Mapping[str, Any]], since: datetime | None = None, event_type: str | None = None,
                   event_id: str | None = None) -> list[Mapping[str, Any]]:
    """The journal entries at or after `since`, of events of `event_type` (as IMDS spells it, any case: the type
    is learnt from the event's entries that carry it) and of the event `event_id`; an entry without a readable time
    is left out once `since` is given, one without an event once a type or an event is."""
    types = {e.get("event_id"): str(e["event_type"]).casefold() for e in entries if e.get("event_type")}
    wanted = event_type.casefold() if event_type else None

    def keep(e: Mapping[str, Any]) -> bool:
        t = instant(e.get("t"))
        return ((since is None or (t is not None and t >= since))
                and (wanted is None or types.get(e.get("event_id")) == wanted)
                and (event_id is None or str(e.get("event_id", "")).casefold() == event_id.casefold()))
    return [e for e in entries if keep(e)]


def history_text(entries: Sequence[Mapping[str, Any]]) -> str:
    """`maintd events --history`: one line per journal entry, its fields as `key=value` (nested keys dotted, a value
    with blanks quoted)."""
    rows = [(when(e.get("t")), text(e.get("kind")), text(e.get("event_id")),
             " ".join(f'{k}="{v}"' if " " in v else f"{k}={v}"
                      for k, v in pairs({k: v for k, v in e.items() if k not in ("t", "kind", "event_id")})))
            for e in entries]
    return "\n".join(table(("TIME", "KIND", "EVENT", "DETAIL"), rows)) if rows else "no journal entries"
