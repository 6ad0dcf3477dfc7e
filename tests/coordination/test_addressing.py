"""Peer addressing: scale-set computer names, templates that cannot be abused, lookup order, the peers file."""

from __future__ import annotations

import os

import pytest

from agent.config.config import ConfigError, loads
from agent.coordination.member_urls import base36, from_template, peer_fields, template_fields
from agent.coordination.peers.peer_addressing import event_url, folded, resolve
from agent.coordination.peers.peers_file import PeersFile
from agent.model.identity import Identity, identity_from_compute
from tests.imds_server import wait_for

WEB_15 = Identity("web_15", "web00000f", "web")


def test_base36_as_azure_writes_instance_ids():
    assert [base36(n) for n in (0, 3, 15, 35, 36, 1295)] == ["0", "3", "f", "z", "10", "zz"]


def test_a_uniform_scale_set_peer_gets_its_computer_name_from_this_vms_own_metadata():
    """web_3 → web000003, because this VM (web_15) is web00000f: the prefix is learned, never typed."""
    assert peer_fields("web_3", WEB_15) == {"name": "web_3", "computer_name": "web000003", "instance_id": "3"}
    assert peer_fields("web_40", WEB_15)["computer_name"] == "web000014"
    assert peer_fields("WEB_3", WEB_15)["computer_name"] == "web000003"


def test_no_derivation_outside_this_vms_scale_set_or_with_custom_computer_names():
    assert peer_fields("api_3", WEB_15)["computer_name"] == "api_3"
    assert peer_fields("web-db", WEB_15) == {"name": "web-db", "computer_name": "web-db", "instance_id": ""}
    custom = Identity("web_15", "frontend-a", "web")
    assert peer_fields("web_3", custom)["computer_name"] == "web_3"
    assert peer_fields("vm-2", Identity("vm-1", "vm-1", ""))["computer_name"] == "vm-2"
    assert peer_fields("web_3", None)["computer_name"] == "web_3"


def test_identity_from_compute_metadata():
    body = {"name": "web_15", "vmScaleSetName": "web", "osProfile": {"computerName": "web00000f"}}
    assert identity_from_compute(body) == WEB_15
    assert identity_from_compute({"name": "vm-1", "osProfile": "odd"}) == Identity("vm-1")
    with pytest.raises(ValueError):
        identity_from_compute({"name": ""})


def test_the_default_template_reaches_plain_vms_by_name_and_scale_set_vms_by_computer_name():
    cfg = loads("{}").coordination
    plain = resolve("vm-2", peers={}, peers_file={}, template=cfg.peer_url, me=Identity("vm-1", "vm-1"))
    assert (plain.url, plain.via) == ("http://vm-2:8088", "template")
    assert resolve("web_3", peers={}, peers_file={}, template=cfg.peer_url, me=WEB_15).url == "http://web000003:8088"


def test_template_fields_in_the_host_must_be_host_names_and_path_fields_are_quoted():
    """Finding 6: a Resources name can neither redirect the request (and the token) nor escape the path."""
    with pytest.raises(ValueError, match="not a host name"):
        from_template("http://{name}:8088", {"name": "127.0.0.1:19999/steal?x="})
    with pytest.raises(ValueError, match="not a host name"):
        from_template("http://{name}:8088", {"name": "web_3"})
    assert from_template("http://127.0.0.1:9000/p/{name}", {"name": "a/../b?x"}) == "http://127.0.0.1:9000/p/a%2F..%2Fb%3Fx"
    assert from_template("http://10.1.0.{instance_id}:8088", {"instance_id": "7"}) == "http://10.1.0.7:8088"
    with pytest.raises(ValueError):
        from_template("http://10.1.0.{instance_id}:8088", {"instance_id": ""})
    with pytest.raises(ValueError):
        event_url("http://x", "../admin")
    assert event_url("http://x", "A-1") == "http://x/v1/events/A-1"


def test_a_bad_template_is_refused_at_load():
    for template in ("http://{host}:8088", "http://vm:8088", "http://{name:8088"):
        with pytest.raises(ConfigError, match="peer_url"):
            loads(f'coordination: {{peer_url: "{template}"}}')
    assert template_fields("http://{computer_name}.corp:{instance_id}") == ["computer_name", "instance_id"]


def test_lookup_order_static_map_then_peers_file_then_template_by_name_or_computer_name():
    kw = dict(template="http://{computer_name}:8088", me=WEB_15)
    assert resolve("web_3", peers=folded({"WEB_3": "http://a/"}), peers_file={"web_3": "http://b"}, **kw).url == "http://a"
    via_file = resolve("WEB_3", peers={}, peers_file=folded({"Web000003": "http://10.0.0.3:8088"}), **kw)
    assert (via_file.url, via_file.via) == ("http://10.0.0.3:8088", "peers_file")
    unaddressable = resolve("flex_ab12cd34", peers={}, peers_file={}, template="http://{name}:8088", me=WEB_15)
    assert unaddressable.url is None and "peers_file" in unaddressable.problem


def test_peers_file_is_reread_when_it_changes_and_a_bad_one_keeps_the_last_good_map(tmp_path):
    path = tmp_path / "peers.yaml"
    pf = PeersFile(str(path))
    assert pf.current() == ({}, True) and "No such file" in pf.problem
    path.write_text('{"web_1": "http://10.0.0.4:8088"}')
    assert pf.current() == ({"web_1": "http://10.0.0.4:8088"}, True) and pf.problem is None
    assert pf.current()[1] is False, "unchanged file: not read again"
    for bad in ("web_1: ftp://x\n", "[1, 2]", "a: &a [1]\nb: *a\n", "web_1: http://x/?steal=1\n", ": :",
                "a: " + "[" * 5000 + "]" * 5000, "{" * 5000 + "}" * 5000, '{"web_1": 5}'):
        path.write_text(bad)
        os.utime(path, ns=(0, len(bad)))
        peers, _ = pf.current()
        assert peers == {"web_1": "http://10.0.0.4:8088"} and pf.problem, bad
    path.write_text("web_1: http://10.0.0.4:8088\nweb_2: http://10.0.0.5:8088/\n")
    assert pf.current()[0] == {"web_1": "http://10.0.0.4:8088", "web_2": "http://10.0.0.5:8088"}
    path.unlink()
    assert len(pf.current()[0]) == 2 and pf.problem


@pytest.mark.parametrize("computer_name", ["10.0.0.000003", "10.0.0.00000f", "000000000003", "0x0a000003",
                                           "web.evil.example000003", "-web00000f", "web00000f:80"])
def test_a_computer_name_not_of_the_scale_set_shape_derives_no_peer_names(computer_name):
    """Hostile compute metadata (`10.0.0.000003`) never steers a peer request, with the token, to another host."""
    me = Identity("web_3", computer_name, "web")
    assert peer_fields("web_5", me)["computer_name"] == "web_5"
    address = resolve("web_5", peers={}, peers_file={}, template="http://{computer_name}:8088", me=me)
    assert address.url is None and "peers_file" in address.problem


def test_an_unusable_computer_name_is_logged_once_when_the_identity_is_learned(logs):
    """The operator is told once why scale-set peers are not derived, not on every ask."""
    from agent.coordination.coordination_settings import CoordinationConfig
    from agent.coordination.peers.peer_directory import PeerDirectory

    directory = PeerDirectory(lambda: CoordinationConfig(), None)
    me = Identity("web_3", "10.0.0.000003", "web")
    for _ in range(3):
        directory.identity = me
        directory.address("web_5")
    directory.identity = WEB_15
    assert [e["computer_name"] for e in logs if e["event"] == "identity.computer_name_unusable"] == ["10.0.0.000003"]
    assert directory.address("web_5").url == "http://web000005:8088"


def test_a_fifo_as_peers_file_is_refused_at_once_and_the_last_good_map_kept(tmp_path, logs):
    """A FIFO (or any non-regular file) never hangs the watcher: refused with a clear line, the last good map kept."""
    from agent.coordination.coordination_settings import CoordinationConfig
    from agent.coordination.peers.peer_directory import PeerDirectory

    path = tmp_path / "peers.yaml"
    path.write_text("web_1: http://10.0.0.4:8088\n")
    directory = PeerDirectory(lambda: CoordinationConfig(peers_file=str(path)), None)
    wait_for(directory.refresh)  # the first look (the watcher's thread may be making its own right now)
    os.mkfifo(tmp_path / "fifo")
    os.rename(tmp_path / "fifo", path)  # in one step: an unlink then a mkfifo let a look in between see no file
    refused = wait_for(lambda: directory.refresh() or [e for e in logs if e["event"] == "peers_file.invalid"], 3)
    assert directory.address("web_1").url == "http://10.0.0.4:8088"
    assert len(refused) == 1 and "not a regular file" in refused[0]["problem"] and refused[0]["kept_entries"] == 1


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_link_or_directory_as_peers_file_is_refused(tmp_path, kind):
    """A planted symlink is not followed; a directory is not read; both keep the last good map."""
    path = tmp_path / "peers.yaml"
    path.write_text("web_1: http://10.0.0.4:8088\n")
    pf = PeersFile(str(path))
    pf.current()
    path.unlink()
    if kind == "symlink":
        (tmp_path / "elsewhere.yaml").write_text("web_1: http://10.9.9.9:1\n")
        path.symlink_to(tmp_path / "elsewhere.yaml")
    else:
        path.mkdir()
    assert pf.current()[0] == {"web_1": "http://10.0.0.4:8088"}
    assert ("symbolic link" if kind == "symlink" else "not a regular file") in pf.problem
