"""Config loading: defaults, durations, and errors that name file, line, column, key and the fix."""

from __future__ import annotations

import os
import re
import tracemalloc

import pytest

from agent.config import config
from agent.config import config_loading as configload
from agent.errors import ConfigError
from agent.model.config_schema import parse_duration_text


def test_empty_file_gives_documented_defaults():
    """An empty config is valid: every key has a default except what must be chosen."""
    cfg = config.loads("", "empty.yaml")
    assert cfg.imds.endpoint == "http://169.254.169.254"
    assert cfg.imds.api_version == "2020-07-01"
    assert cfg.imds.poll_interval == 1.0 and cfg.imds.timeout == 5.0 and cfg.imds.max_backoff == 10.0
    assert cfg.identity.name == "auto" and cfg.state.dir == "/var/lib/maintd"
    assert cfg.log.format == "auto" and cfg.log.level == "info" and cfg.dry_run is False


@pytest.mark.parametrize("text,seconds", [
    ("500ms", 0.5), ("1s", 1), ("5m", 300), ("2h", 7200), ("1d", 86400), ("PT1M", 60), ("PT1H30M", 5400),
    ("P1DT1S", 86401), (3, 3), (0.25, 0.25), ("7", 7),
])
def test_durations_accept_units_iso8601_and_plain_seconds(text, seconds):
    """Durations: 500ms, 1s, 5m, PT1M and plain seconds all mean what they say."""
    assert parse_duration_text(text) == seconds


BAD = [
    # (yaml, line, key, words that must appear in the message)
    ("imds:\n  poll_intervl: 1s\n", 2, "imds.poll_intervl", ["unknown key", "poll_interval"]),
    ("imds:\n  poll_interval: soon\n", 2, "imds.poll_interval", ["not a duration", "5m"]),
    ("imds:\n  poll_interval: 50ms\n", 2, "imds.poll_interval", ["5 requests/s"]),
    ("imds:\n  timeout: -1\n", 2, "imds.timeout", ["not a duration"]),
    ("imds:\n  endpoint: 169.254.169.254\n", 2, "imds.endpoint", ["base URL"]),
    ("imds:\n  api_version: latest\n", 2, "imds.api_version", ["2020-07-01"]),
    ("imds:\n  warn_after_failures: 0\n", 2, "imds.warn_after_failures", ["minimum 1"]),
    ("identity:\n  name: my vm\n", 2, "identity.name", ["spaces"]),
    ("state:\n  dir: var/lib/maintd\n", 2, "state.dir", ["absolute path"]),
    ("log:\n  level: verbose\n", 2, "log.level", ["debug, info, warning, error"]),
    ("log:\n  format: xml\n", 2, "log.format", ["json"]),
    ("dry_run: yes please\n", 1, "dry_run", ["true or false"]),
    ("server:\n  listen: 8088\n", 2, "server.listen", ["host:port"]),
    ("server:\n  token_file: token\n", 2, "server.token_file", ["absolute path"]),
    ("probe:\n  lb_timeout: 5s\n", 2, "probe.lb_timeout", ["minimum is 11s"]),
    ("probe:\n  lb_interval: 2s\n", 2, "probe.lb_interval", ["minimum is 5s"]),
    ("probe:\n  mode: tcp\n", 1, "probe.listen", ["probe.listen"]),
    ("probe:\n  drain_on_stop: sometimes\n", 2, "probe.drain_on_stop", ["shutdown, always, never"]),
    ("imds: {timeout: 5s}\nimds: {}\n", 2, "imds", ["duplicate key", "line 1"]),
    ("imds:\n  timeout: 5s\n  timeout: 6s\n", 3, "imds.timeout", ["duplicate key"]),
    ("imds: [1, 2]\n", 1, "imds", ["mapping"]),
    ("imds:\n  timeout: [5s\n", None, "", ["not valid YAML"]),
    ("- imds\n", 1, "", ["top level must be a mapping"]),
    ("colour: blue\n", 1, "colour", ["unknown key"]),
]


@pytest.mark.parametrize("text,line,key,words", BAD, ids=[b[2] or b[3][0] for b in BAD])
def test_bad_config_is_refused_naming_file_line_key_and_fix(text, line, key, words):
    """Each refused config says where (file:line:col), which key, and what is allowed."""
    with pytest.raises(ConfigError) as info:
        config.loads(text, "/etc/maintd/maintd.yaml")
    err = info.value
    message = str(err)
    assert message.startswith("/etc/maintd/maintd.yaml:")
    if line is not None:
        assert err.line == line and f"maintd.yaml:{line}:" in message
    assert err.key == key
    for word in words:
        assert word in message


def test_load_refuses_a_group_writable_config(write_config):
    """A config others can write could inject hooks: it is refused with the chmod fix."""
    path = write_config("log: {level: info}\n")
    os.chmod(path, 0o664)
    with pytest.raises(ConfigError, match="chmod go-w"):
        config.load(path)


def test_load_of_missing_file_says_so(tmp_path):
    """A missing file names the path and what to do."""
    with pytest.raises(ConfigError, match="no such file"):
        config.load(tmp_path / "nope.yaml")


def test_load_reads_a_valid_file_and_remembers_its_source(write_config):
    """A valid file loads, with its path kept for reloads and messages."""
    path = write_config("imds:\n  poll_interval: 2s\nlog:\n  level: debug\n")
    cfg = config.load(path)
    assert cfg.imds.poll_interval == 2.0 and cfg.log.level == "debug" and cfg.source == str(path)


def test_loopback_endpoint_may_poll_fast():
    """The emulator on loopback may be polled faster than IMDS's limit (soak and benchmarks)."""
    cfg = config.loads("imds:\n  endpoint: http://127.0.0.1:8089\n  poll_interval: 5ms\n")
    assert cfg.imds.poll_interval == 0.005


# --- hostile config files: a ConfigError naming the file and the fix, never a traceback --------------

def _bytes(path, data):
    path.write_bytes(data)
    os.chmod(path, 0o600)


HOSTILE = {
    "not UTF-8": (lambda p: _bytes(p, b"imds:\n  poll_interval: \xff\xfe1s\n"), "not UTF-8"),
    "random bytes": (lambda p: _bytes(p, bytes(range(128, 256)) * 8), "not UTF-8"),
    "empty": (lambda p: _bytes(p, b""), "is empty"),
    "only blank lines": (lambda p: _bytes(p, b"\n  \n"), "write {}"),
    "a directory": (lambda p: p.mkdir(), "is a directory"),
    "a dangling symlink": (lambda p: p.symlink_to(p.parent / "gone.yaml"), "symbolic link"),
    "a FIFO": (lambda p: os.mkfifo(p, 0o600), "not a regular file"),
    "too large": (lambda p: _bytes(p, b"# " + b"x" * (configload.MAX_CONFIG_BYTES + 10)), "larger than"),
    "control characters": (lambda p: _bytes(p, b"imds: {}\n\x01\x02"), "not valid YAML"),
}


@pytest.mark.parametrize("make,words", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_config_file_that_cannot_be_used_is_refused_with_the_file_named(tmp_path, make, words):
    """Whatever is at the config path, `load` answers a Config or a ConfigError saying which file and why."""
    path = tmp_path / "maintd.yaml"
    make(path)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert str(info.value).startswith(str(path)) and words in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_config_file_is_refused_with_the_fix(write_config):
    """No read permission: refused, naming the uid maintd runs as."""
    path = write_config("imds: {}\n")
    os.chmod(path, 0)
    with pytest.raises(ConfigError, match="permission denied"):
        config.load(path)


def _billion_laughs(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for prev, name in zip("abcdefghij", "bcdefghijk"[:levels - 1], strict=False):
        text += f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]\n"
    return text


def _merge_bomb(levels: int = 10) -> str:
    text = "a: &a {" + ", ".join(f"x{i}: {i}" for i in range(10)) + "}\n"
    for prev, name in zip("abcdefghijk", "bcdefghijkl"[:levels], strict=False):
        text += f"{name}: &{name} {{<<: [" + ",".join([f"*{prev}"] * 10) + f"], k{name}: 1}}\n"
    return text + "<<: *" + "bcdefghijkl"[levels - 1] + "\n"


@pytest.mark.parametrize("text,words", [
    (_billion_laughs(), "more than 20000 values"),
    ("handlers: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 32"),
    ("handlers:\n" + "".join("  " * i + "- \n" for i in range(200)), "nested more than 32"),
    ("imds: " + "{a: " * 2000 + "1" + "}" * 2000 + "\n", "nested more than 32"),
    ("handlers: &h [*h]\n", "nested more than 32"),
    ("imds: &m {<<: *m}\n", "nested more than 32"),
    ("imds: 2026-13-01\n", ":1:7: imds: cannot be read as a value"),
    ("2026-02-30: x\n", ":1:1: cannot be read as a value"),
    ('imds: {"x[1": 2}\n', "unknown key"),
])
def test_yaml_bombs_deep_nesting_and_impossible_values_are_refused_not_a_crash(text, words):
    """An alias bomb, a merge-key bomb, deep or cyclic nesting, an impossible date, a key holding "[":
    a ConfigError at once (before: 9 s and 630 MB, a RecursionError, or a ValueError traceback)."""
    with pytest.raises(ConfigError) as info:
        config.loads(text, "/etc/maintd/maintd.yaml")
    assert str(info.value).startswith("/etc/maintd/maintd.yaml:") and words in str(info.value)


def test_a_merge_key_bomb_is_refused_in_bounded_time_and_memory():
    """A merge-key bomb (10 levels of ten-fold `<<`) never expands: PyYAML up to 6.0.3 builds the
    merged values and the loader refuses them as too many; 6.0.4 flattens merges into one small
    mapping, refused by the schema. Either way a ConfigError naming file and line, with the
    loader's peak memory bounded (before the bound: 9 s and 630 MB)."""
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as info:
            config.loads(_merge_bomb(), "/etc/maintd/maintd.yaml")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert re.match(r"/etc/maintd/maintd\.yaml:\d+:\d+: ", str(info.value))
    assert peak < 64 * 2**20


def test_aliases_and_merge_keys_of_a_normal_size_still_work():
    """The bounds leave room for real configs that share settings through anchors."""
    cfg = config.loads("imds: &i {poll_interval: 2s}\nprobe: {lb_timeout: 40s, <<: {drain_grace: 5s}}\n")
    assert cfg.imds.poll_interval == 2 and cfg.probe.drain_grace == 5
