"""Secret files (bearer tokens, webhook URLs): read on use, so a rotated token needs no reload."""

from __future__ import annotations

from pathlib import Path


def read_secret(path: str | None) -> str | None:
    """The stripped contents of a secret file, or None when unset or unreadable."""
    if not path:
        return None
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value or None
