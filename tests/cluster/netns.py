"""A real two-node Pacemaker cluster in network namespaces, for tests and benchmarks (root only).

Each node is a holder process in its own network, mount and UTS namespaces (`unshare`), with its own
/etc/corosync, /etc/hosts, /var/lib/pacemaker, /var/lib/corosync, /var/log/pacemaker, /run and
/dev/shm bound over the host's (docs: /work/shared/research/clusters.md). The two network
namespaces are joined by a veth pair with addresses from 10.237.37.0/24, which exist inside the
namespaces only: nothing is routed to or from the host. `corosync -f` then `pacemakerd -f` run in
each node; commands enter a node with `nsenter -t PID -n -m -u`.

Every process started here is a child started in its own process group and recorded by pid (and
start time) in a file under the cluster's directory; `stop` ends them all, the holders last (the
namespaces go with them), and a later `start` ends what an interrupted run left behind.
Waiting is on the cluster's own state (`crm_mon --output-as=xml`), never on a fixed time.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAMES = ("node-a", "node-b")
SUBNET = "10.237.37"
"""Addresses of the veth pair (10.237.37.1 and .2, /24), inside the namespaces only."""
IMDS = "169.254.169.254"
TOOLS = ("unshare", "nsenter", "ip", "corosync", "pacemakerd", "crm_mon", "crm_attribute", "cibadmin", "crm_node",
         "crm_resource")
DUMMY = "ocf:pacemaker:Dummy"
BINDS = ("/etc/corosync", "/var/lib/pacemaker", "/var/lib/corosync", "/var/log/pacemaker", "/run", "/dev/shm")
HOLDER = ("import ctypes, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "  # PR_SET_PDEATHSIG
          "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); signal.pause()")
LAUNCH = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
          "os.execvp(sys.argv[1], sys.argv[1:])")
"""Run a daemon so that it is told to end when the test process dies, however it dies."""
CLONE_NEWNET = 0x40000000


def missing() -> list[str]:
    """What this machine lacks to run the cluster (empty: it can)."""
    lack = [] if os.geteuid() == 0 else ["root"]
    lack += [t for t in TOOLS if shutil.which(t) is None]
    if not Path("/usr/lib/ocf/resource.d/pacemaker/Dummy").exists():
        lack.append("resource-agents' ocf:pacemaker:Dummy (pacemaker)")
    return lack


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


@dataclass
class Node:
    name: str
    index: int
    root: Path
    holder: subprocess.Popen[bytes] | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"{SUBNET}.{self.index + 1}"

    @property
    def pid(self) -> int:
        assert self.holder is not None
        return self.holder.pid

    def enter(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-n", "-m", "-u", "--", *argv]

    def run(self, argv: list[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A command inside the node (explicit arguments, never a shell)."""
        done = subprocess.run(self.enter(argv), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def spawn(self, key: str, argv: list[str], env: dict[str, str] | None = None,
              stdout: Any = None, stderr: Any = None) -> subprocess.Popen[bytes]:
        """A long-running process inside the node, in its own process group, ended by `Cluster.stop`."""
        log = open(self.root / f"{key}.log", "ab")  # handed to the child
        proc = subprocess.Popen(self.enter([sys.executable, "-c", LAUNCH, *argv]), start_new_session=True,
                                stdout=stdout if stdout is not None else log,
                                stderr=stderr if stderr is not None else log, env=env)
        log.close()
        self.procs[key] = proc
        return proc

    def in_netns(self, fn: Callable[[], Any]) -> Any:
        """Call `fn` on this thread while it is inside the node's network namespace (sockets it opens stay
        there), then come back."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        theirs = os.open(f"/proc/{self.pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(theirs, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the node's network namespace")
            try:
                return fn()
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(own)
            os.close(theirs)


class Cluster:
    """Two nodes; `start()` returns once both are online with the Dummy resource started."""

    def __init__(self, base: Path, names: tuple[str, ...] = NAMES) -> None:
        self.base = base
        self.nodes = [Node(n, i, base / n) for i, n in enumerate(names)]
        self.pidfile = base / "pids.json"

    # --- life cycle -------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.end_leftovers()
        authkey = secrets.token_bytes(128)
        for node in self.nodes:
            self._prepare(node, authkey)
        for node in self.nodes:
            node.holder = subprocess.Popen(
                ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--",
                 sys.executable, "-c", HOLDER, str(node.root)], start_new_session=True)
        self._record()
        for node in self.nodes:
            self._wait_ns(node)
            for target in BINDS:
                node.run(["mount", "--bind", str(node.root / target.strip("/").replace("/", "-")), target])
            node.run(["mount", "--bind", str(node.root / "hosts"), "/etc/hosts"])
            node.run(["hostname", node.name])
        a, b = self.nodes
        veth = f"vpm{os.getpid() % 100000}"
        subprocess.run(["ip", "link", "add", veth + "a", "type", "veth", "peer", "name", veth + "b"], check=True)
        for node, end in ((a, veth + "a"), (b, veth + "b")):
            subprocess.run(["ip", "link", "set", end, "netns", str(node.pid)], check=True)
            node.run(["ip", "link", "set", "lo", "up"])
            node.run(["ip", "addr", "add", f"{IMDS}/32", "dev", "lo"])
            node.run(["ip", "link", "set", end, "name", "eth0"])
            node.run(["ip", "addr", "add", f"{node.addr}/24", "dev", "eth0"])
            node.run(["ip", "link", "set", "eth0", "up"])
        for node in self.nodes:
            node.spawn("corosync", ["corosync", "-f"])
        for node in self.nodes:
            env = {**os.environ, "PCMK_logfile": "/var/log/pacemaker/pacemaker.log"}
            node.spawn("pacemakerd", ["pacemakerd", "-f"], env=env)
        self.wait(lambda m: m is not None and all(m.nodes.get(n.name, NodeState()).online for n in self.nodes)
                  and m.dc, timeout, "both nodes online with a DC")
        self._record()
        first = self.nodes[0]
        first.run(["crm_attribute", "--type", "crm_config", "--name", "stonith-enabled", "--update", "false"])
        first.run(["crm_attribute", "--type", "crm_config", "--name", "no-quorum-policy", "--update", "ignore"])
        first.run(["crm_attribute", "--type", "rsc_defaults", "--name", "resource-stickiness", "--update", "100"])
        first.run(["cibadmin", "--create", "--scope", "resources", "--xml-text",
                   '<primitive id="dummy" class="ocf" provider="pacemaker" type="Dummy">'
                   '<operations><op id="dummy-monitor" name="monitor" interval="5s"/></operations></primitive>'])
        self.wait(lambda m: m is not None and m.where("dummy") is not None, timeout, "the Dummy resource started")
        self._record()

    def stop(self) -> None:
        """End every process of the cluster (daemons first, then the holders: the namespaces go with them)."""
        pids: list[int] = []
        for node in self.nodes:
            pids += self._in_node(node)
            for proc in node.procs.values():
                pids.append(proc.pid)
        self._end(pids)
        for node in self.nodes:
            for proc in node.procs.values():
                _reap(proc)
            node.procs.clear()
        self._end([n.holder.pid for n in self.nodes if n.holder is not None])
        for node in self.nodes:
            if node.holder is not None:
                _reap(node.holder)
        self.pidfile.unlink(missing_ok=True)

    def _in_node(self, node: Node) -> list[int]:
        """Every process inside the node's network namespace but its holder."""
        if node.holder is None or node.holder.poll() is not None:
            return []
        ns = _netns(node.pid)
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != node.pid and _netns(int(entry.name)) == ns:
                found.append(int(entry.name))
        return found

    def _record(self) -> None:
        pids = [n.holder.pid for n in self.nodes if n.holder is not None]
        for node in self.nodes:
            pids += self._in_node(node) + [p.pid for p in node.procs.values()]
        self.pidfile.write_text(json.dumps({str(p): _start_time(p) for p in set(pids)}))

    def end_leftovers(self) -> None:
        """End the processes an interrupted run of this cluster left (by pid, when the start time matches)."""
        try:
            recorded = json.loads(self.pidfile.read_text())
        except (OSError, ValueError):
            return
        self._end([int(p) for p, start in recorded.items() if start is not None and _start_time(int(p)) == start])
        self.pidfile.unlink(missing_ok=True)

    @staticmethod
    def _end(pids: list[int], grace: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in pids if _alive(p)]
            for p in alive:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace
            while any(_alive(p) for p in alive) and time.monotonic() < end:
                time.sleep(0.05)

    def _prepare(self, node: Node, authkey: bytes) -> None:
        if node.root.exists():
            shutil.rmtree(node.root)
        for target in BINDS:
            (node.root / target.strip("/").replace("/", "-")).mkdir(parents=True)
        hac = _ids("hacluster", "haclient")
        lib = node.root / "var-lib-pacemaker"
        for sub in ("cib", "pengine", "blackbox", "cores"):
            (lib / sub).mkdir()
            os.chown(lib / sub, *hac)
            os.chmod(lib / sub, 0o750)
        logdir = node.root / "var-log-pacemaker"
        os.chown(logdir, *hac)
        os.chmod(logdir, 0o770)
        os.chmod(node.root / "dev-shm", 0o1777)
        os.chmod(node.root / "run", 0o755)
        etc = node.root / "etc-corosync"
        (etc / "authkey").write_bytes(authkey)
        os.chmod(etc / "authkey", 0o400)
        (etc / "corosync.conf").write_text(self._corosync_conf())
        (node.root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{n.addr} {n.name}\n" for n in self.nodes))

    def _corosync_conf(self) -> str:
        nodes = "".join(f"    node {{\n        ring0_addr: {n.addr}\n        name: {n.name}\n"
                        f"        nodeid: {n.index + 1}\n    }}\n" for n in self.nodes)
        return ("totem {\n    version: 2\n    cluster_name: maintd-test\n    transport: knet\n"
                "    crypto_cipher: none\n    crypto_hash: none\n    token: 1000\n}\n"
                "logging {\n    to_stderr: yes\n    to_syslog: no\n    to_logfile: no\n}\n"
                "quorum {\n    provider: corosync_votequorum\n    two_node: 1\n}\n"
                f"nodelist {{\n{nodes}}}\n")

    def _wait_ns(self, node: Node, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while _netns(node.pid) == _netns(os.getpid()) or _netns(node.pid) is None:
            if node.holder is not None and node.holder.poll() is not None:
                raise RuntimeError(f"{node.name}: unshare exited {node.holder.returncode}")
            if time.monotonic() > end:
                raise RuntimeError(f"{node.name}: no namespace after {timeout:.0f}s")
            time.sleep(0.02)

    # --- state ------------------------------------------------------------------------------

    def mon(self, node: Node | None = None) -> Mon | None:
        """The cluster as crm_mon sees it from `node` (the first by default); None when it does not answer."""
        try:
            done = (node or self.nodes[0]).run(["crm_mon", "-1", "--output-as=xml"], timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return None
        return parse_mon(done.stdout) if done.returncode == 0 else None

    def wait(self, ok: Callable[[Mon | None], Any], timeout: float, what: str, node: Node | None = None) -> Mon:
        end = time.monotonic() + timeout
        while True:
            mon = self.mon(node)
            if ok(mon):
                assert mon is not None
                return mon
            if time.monotonic() > end:
                logs = "".join(self._tail(n) for n in self.nodes)
                raise AssertionError(f"cluster: timed out after {timeout:.0f}s waiting for {what}{logs}")
            time.sleep(0.1)

    def _tail(self, node: Node) -> str:
        out = ""
        for key in node.procs:
            try:
                out += f"\n--- {node.name} {key}:\n" + "".join((node.root / f"{key}.log").read_text().splitlines(
                    keepends=True)[-8:])
            except OSError:
                pass
        return out


@dataclass(frozen=True)
class NodeState:
    online: bool = False
    standby: bool = False
    resources: int = 0
    health: str = "green"


@dataclass(frozen=True)
class Mon:
    nodes: dict[str, NodeState]
    resources: dict[str, tuple[str, ...]]
    """Resource id -> the nodes it is active on."""
    dc: bool

    def where(self, rsc: str) -> str | None:
        on = self.resources.get(rsc, ())
        return on[0] if len(on) == 1 else None


def parse_mon(text: str) -> Mon | None:
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return None
    nodes = {n.get("name", ""): NodeState(n.get("online") == "true", n.get("standby") == "true",
                                          int(n.get("resources_running", "0") or 0), n.get("health", "green"))
             for n in root.iter("node") if n.get("id") is not None and n.get("online") is not None}
    resources: dict[str, tuple[str, ...]] = {}
    for r in root.iter("resource"):
        if r.get("active") == "true" and r.get("role") == "Started":  # a clone's instances: one entry each
            rid = r.get("id", "")
            resources[rid] = resources.get(rid, ()) + tuple(n.get("name", "") for n in r.iter("node"))
    summary = root.find("summary/current_dc")
    return Mon(nodes, resources, summary is not None and summary.get("present") == "true")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is as good as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _ids(user: str, group: str) -> tuple[int, int]:
    import grp
    import pwd
    return pwd.getpwnam(user).pw_uid, grp.getgrnam(group).gr_gid


if __name__ == "__main__":  # a manual try: python -m tests.cluster.netns
    cluster = Cluster(Path("/tmp/maintd-cluster-try"))
    t0 = time.monotonic()
    try:
        cluster.start()
        print(f"up in {time.monotonic() - t0:.1f}s: {cluster.mon()}", flush=True)
        print(" ".join(str(n.pid) for n in cluster.nodes), flush=True)
        if "hold" in sys.argv:
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
            signal.pause()
    finally:
        cluster.stop()
