"""This VM's identity as IMDS compute metadata gives it (pure): the IMDS client reads it, coordination
addresses peers from it, and neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Identity:
    """This VM as IMDS compute metadata describes it."""

    name: str
    computer_name: str = ""
    scale_set: str = ""
    zone: str = ""
    """The availability zone (IMDS compute `zone`; "" when the VM is in none): the budget's `spread: zone`."""
    fault_domain: str = ""
    """IMDS compute `platformFaultDomain`: the budget's `spread: fault_domain`."""


def identity_from_compute(body: Any) -> Identity:
    """The Identity in an IMDS `compute` answer; ValueError when it names no VM."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        raise ValueError("compute metadata has no name")
    os_profile = body.get("osProfile")
    computer = os_profile.get("computerName") if isinstance(os_profile, dict) else None
    scale_set, zone, domain = body.get("vmScaleSetName"), body.get("zone"), body.get("platformFaultDomain")
    return Identity(body["name"], computer if isinstance(computer, str) else "",
                    scale_set if isinstance(scale_set, str) else "", zone[:32] if isinstance(zone, str) else "",
                    str(domain)[:32] if isinstance(domain, (str, int)) and not isinstance(domain, bool) else "")
