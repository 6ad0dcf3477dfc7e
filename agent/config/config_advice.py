"""What `maintd check-config` warns about in a config it accepts: a choice that would surprise its
operator at the first event, named at its file:line:column, with the fix.

Pure: the profiles and the handlers in, (key, message) pairs out. One warning so far: a profile
approves some event types early (`approval: auto`, for the profile or for one of its rules) while no
`scheduled` handler runs for those types under it. `auto` approves once every VM the event names is
ready, and a VM with nothing to prepare is ready at once: the event would be approved as soon as
IMDS announces it, minutes before its NotBefore, with nothing drained or saved. `immediate` is not
warned about: it says in so many words that preparation is not waited for.
"""

from __future__ import annotations

from agent.handlers.spec import HandlerSpec
from agent.model.approval import AUTO
from agent.model.events import KNOWN_TYPES
from agent.model.outcomes import PHASE_SCHEDULED
from agent.policy.approval_policy import ApprovalRule, Profile


def unprepared_early_approvals(profiles: tuple[Profile, ...], handlers: tuple[HandlerSpec, ...],
                               profiles_given: bool = True) -> list[tuple[str, str]]:
    """(key, message) for each profile setting that approves event types early which no handler prepares
    for under that profile. `profiles_given`: False when the file has no `profiles:` (the built-in default
    profile is in force), so the key is `profiles` itself."""
    found: list[tuple[str, str]] = []
    for i, profile in enumerate(profiles):
        unprepared: dict[str, list[str]] = {}
        for event_type in KNOWN_TYPES:
            if _prepared(event_type, profile, handlers):
                continue
            for key in _approving_early(event_type, profile):
                unprepared.setdefault(key, []).append(event_type)
        for key, types in unprepared.items():
            where = f"profiles[{i}].{key}" if profiles_given else "profiles"
            found.append((where, _message(profile, types, profiles_given)))
    return found


def _approving_early(event_type: str, profile: Profile) -> list[str]:
    """The profile's keys (`approval`, `rules[j].approval`) that may approve an event of this type with
    `auto`; the first rule that matches every event of the type ends the search, as it ends `approval_for`'s."""
    keys = []
    for j, rule in enumerate(profile.rules):
        if rule.event_types and event_type not in rule.event_types:
            continue
        if rule.approval == AUTO:
            keys.append(f"rules[{j}].approval")
        if _matches_every_event_of_its_types(rule):
            return keys
    if profile.approval == AUTO:
        keys.append("approval")
    return keys


def _matches_every_event_of_its_types(rule: ApprovalRule) -> bool:
    return not rule.event_sources and rule.max_duration_seconds is None and rule.live_migration is None


def _prepared(event_type: str, profile: Profile, handlers: tuple[HandlerSpec, ...]) -> bool:
    """Whether some handler runs in the `scheduled` phase for this event type while the profile is in force
    (a handler limited to some event sources counts: it prepares for some of them)."""
    return any(PHASE_SCHEDULED in h.phases and (not h.event_types or event_type in h.event_types)
               and (profile.handlers is None or h.name in profile.handlers) for h in handlers)


def _message(profile: Profile, types: list[str], profiles_given: bool) -> str:
    which = f"profile {profile.name!r}" if profiles_given else f"the built-in profile {profile.name!r} (no profiles:)"
    them = "it" if len(types) == 1 else "them"
    among = " of the profile's handlers" if profile.handlers is not None else ""
    return (f"warning: {which} approves {', '.join(types)} early (approval: auto), and no handler{among} prepares "
            f"for {them} (phases: [scheduled]): such an event is approved as soon as it is announced, before its "
            f"NotBefore, with nothing drained or saved. Fix: add a scheduled handler for {them}, or set "
            f"approval: never to only observe (the event then starts at its NotBefore)")
