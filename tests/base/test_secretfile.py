"""Token files: fail closed, refused when others can read them, every problem told once."""

from __future__ import annotations

import os

import pytest

from agent.health.health_store import HealthState, HealthStore
from agent.trust.secretfile import REFUSED, SecretFiles

KEY = "coordination.token_file"


@pytest.fixture
def secrets(clock):
    health = HealthStore(clock)
    return SecretFiles(health.report_config_problem), health


def _token_file(tmp_path, data=b"s3cret-token\n", mode=0o600):
    path = tmp_path / "token"
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def _report(health):
    return {(e.report.source_id, e.report.property): e for e in health.snapshot()}.get(("config", KEY))


def test_a_private_token_file_is_read_and_a_rotated_token_is_picked_up(tmp_path, secrets):
    """Mode 600: the stripped token; rewritten in place, the new one without a restart."""
    files, health = secrets
    path = _token_file(tmp_path)
    assert files.read(KEY, path) == "s3cret-token"
    _token_file(tmp_path, b"rotated-token\n")
    assert files.read(KEY, path) == "rotated-token" and _report(health) is None


def test_an_unset_token_file_means_no_token(secrets):
    """Not configured: None, as before (reads are open, as the README says)."""
    files, _ = secrets
    assert files.read(KEY, None) is None


UNUSABLE = {
    "readable by others": (dict(mode=0o644), "chmod 600"),
    "writable by group": (dict(mode=0o620), "chmod 600"),
    "empty": (dict(data=b"\n"), "is empty"),
    "not UTF-8": (dict(data=b"\xff\xfe"), "not UTF-8"),
    "a newline inside": (dict(data=b"abc\ndef"), "spaces or control characters"),
    "too large": (dict(data=b"x" * 70_000), "larger than"),
}


@pytest.mark.parametrize("kwargs,words", UNUSABLE.values(), ids=UNUSABLE.keys())
def test_an_unusable_token_file_fails_closed_and_is_told_once(tmp_path, secrets, logs, kwargs, words):
    """The token guards reads and writes: an unusable file never opens them. It answers REFUSED (no token:
    nothing is sent with it, no caller matches it), logs `secret.unusable` once (not per request) with the
    fix, and shows config/<key> Error."""
    files, health = secrets
    path = _token_file(tmp_path, **kwargs)
    answers = {files.read(KEY, path) for _ in range(50)}
    assert answers == {REFUSED}
    told = [e for e in logs if e["event"] == "secret.unusable"]
    assert len(told) == 1 and words in told[0]["problem"] and told[0]["path"] == path
    report = _report(health)
    assert report and report.state == HealthState.ERROR and words in report.report.description


@pytest.mark.parametrize("make", [
    lambda p: None,
    lambda p: os.mkdir(p),
    lambda p: os.symlink(p + ".gone", p),
], ids=["missing", "a directory", "a dangling symlink"])
def test_a_missing_token_file_fails_closed_and_recovers_when_written(tmp_path, secrets, logs, make):
    """Missing (or a directory, a dangling link): refused and reported; once written, used and the report goes."""
    files, health = secrets
    path = str(tmp_path / "token")
    make(path)
    assert files.read(KEY, path) == REFUSED
    assert _report(health) is not None
    if os.path.isdir(path):
        os.rmdir(path)
    elif os.path.islink(path):
        os.unlink(path)
    _token_file(tmp_path, b"now-here")
    assert files.read(KEY, path) == "now-here"
    assert _report(health) is None and [e["event"] for e in logs if e["event"].startswith("secret.")] == \
        ["secret.unusable", "secret.usable"]


def test_group_readable_is_accepted_only_for_maintds_own_group(tmp_path, secrets):
    """`root:maintd 0640` is how a secret is handed to a service user; another group may not read it."""
    files, _ = secrets
    path = _token_file(tmp_path, mode=0o640)
    os.chown(path, -1, os.getegid())
    assert files.read(KEY, path) == "s3cret-token"
    if os.geteuid() == 0:
        os.chown(path, -1, os.getegid() + 4242)
        assert files.read(KEY, path) == REFUSED


def test_a_token_file_another_user_could_replace_is_refused(tmp_path, secrets):
    """In a group-writable directory (or, as root, owned by nobody) a token file is someone else's choice: refused,
    named with the fix, REFUSED (issue 28: secrets fail closed, paths checked like the config's)."""
    files, health = secrets
    shared = tmp_path / "shared"
    shared.mkdir()
    path = _token_file(shared)
    shared.chmod(0o775)
    assert files.read(KEY, path) == REFUSED
    assert f"chmod go-w {shared}" in _report(health).report.description
    shared.chmod(0o755)
    assert files.read(KEY, path) == "s3cret-token"
    if os.geteuid() == 0:
        os.chown(path, 65534, -1)
        assert files.read(KEY, path) == REFUSED and "chown root" in _report(health).report.description
