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


def identity_from_compute(body: Any) -> Identity:
    """The Identity in an IMDS `compute` answer; ValueError when it names no VM."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        raise ValueError("compute metadata has no name")
    os_profile = body.get("osProfile")
    computer = os_profile.get("computerName") if isinstance(os_profile, dict) else None
    scale_set = body.get("vmScaleSetName")
    return Identity(body["name"], computer if isinstance(computer, str) else "",
                    scale_set if isinstance(scale_set, str) else "")
