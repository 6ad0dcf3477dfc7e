"""A fake Pacemaker cluster behind the `pacemaker` handler's command runner: it answers the very argv the
handler runs (crm_node, crm_mon, cibadmin, crm_attribute) from a small model of nodes, resources and the
CIB's crm_config, and records every command. Resources leave a node in standby one crm_mon later."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from agent.handlers.pacemaker_cli import EXISTS, Done


@dataclass
class FakeNode:
    online: bool = True
    standby: bool = False
    standby_forever: bool = False


@dataclass
class FakeResource:
    on: str | None
    pinned: str | None = None
    stop_fails: bool = False
    failed: bool = False


@dataclass
class FakeCluster:
    me: str = "node-a"
    nodes: dict[str, FakeNode] = field(default_factory=lambda: {"node-a": FakeNode(), "node-b": FakeNode()})
    resources: dict[str, FakeResource] = field(default_factory=lambda: {"dummy": FakeResource("node-a")})
    config: dict[str, str] = field(default_factory=dict)
    """crm_config's property sets by id: their nvpair's value."""
    commands: list[list[str]] = field(default_factory=list)
    pending: bool = False
    fail: dict[str, int] = field(default_factory=dict)
    """A tool's name -> the exit status it answers with (a broken cluster)."""

    def __call__(self, argv: list[str], timeout: float) -> Done:
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
        self.commands.append(list(argv))
        if argv[0] in self.fail:
            return Done(self.fail[argv[0]], "", f"{argv[0]}: failed (the fake)")
        if argv == ["crm_node", "-n"]:
            return Done(0, self.me + "\n")
        if argv == ["crm_mon", "-1", "--output-as=xml"]:
            self._step()
            return Done(0, self.mon_xml())
        if argv[0] == "cibadmin":
            return self._cibadmin(argv[1:])
        if argv[0] == "crm_attribute":
            return self._attribute(argv[1:])
        return Done(127, "", f"the fake has no {argv}")

    # --- the model ----------------------------------------------------------------------------

    def _step(self) -> None:
        """A transition: one crm_mon after a standby changed, resources leave or return."""
        if self.pending:
            self.pending = False
            return
        for rsc in self.resources.values():
            node = self.nodes.get(rsc.on) if rsc.on else None
            if node is not None and (node.standby or node.standby_forever or not node.online):
                if rsc.stop_fails:
                    rsc.failed = True
                    continue
                rsc.on = None
            if rsc.on is None and not rsc.failed:
                ok = [n for n, v in sorted(self.nodes.items()) if v.online and not v.standby
                      and not v.standby_forever and (rsc.pinned is None or rsc.pinned == n)]
                rsc.on = ok[0] if ok else None

    def mon_xml(self) -> str:
        nodes = "".join(f'<node name="{n}" id="{i}" online="{str(v.online).lower()}" '
                        f'standby="{str(v.standby or v.standby_forever).lower()}" standby_onfail="false" '
                        f'maintenance="false" type="member" resources_running="0"/>'
                        for i, (n, v) in enumerate(sorted(self.nodes.items()), 1))
        res = ""
        for rid, r in self.resources.items():
            active = r.on is not None
            role = "Started" if active else "Stopped"
            res += (f'<resource id="{rid}" resource_agent="ocf:pacemaker:Dummy" role="{role}" '
                    f'active="{str(active).lower()}" blocked="{str(r.failed).lower()}" managed="true" '
                    f'failed="{str(r.failed).lower()}" nodes_running_on="{int(active)}">'
                    + (f'<node name="{r.on}" id="1" cached="true"/>' if active else "") + "</resource>")
        return (f'<pacemaker-result api-version="2.25" request="crm_mon -1 --output-as=xml"><summary>'
                f'<current_dc present="true" name="node-b"/></summary><nodes>{nodes}</nodes>'
                f'<resources>{res}</resources><status code="0" message="OK"/></pacemaker-result>')

    def _cibadmin(self, args: list[str]) -> Done:
        if args[:3] == ["--query", "--scope", "crm_config"]:
            sets = "".join(f'<cluster_property_set id="{sid}"><nvpair id="{sid}-x" name="{sid}-x" value="{v}"/>'
                           f'</cluster_property_set>' for sid, v in self.config.items())
            return Done(0, f"<crm_config>{sets}</crm_config>")
        if args[:2] == ["--delete", "--xpath"]:  # //cluster_property_set[@id='X'][nvpair[@id='Y' and @value='V']]
            m = re.fullmatch(r"//cluster_property_set\[@id='([^']+)'\]\[nvpair\[@id='[^']+' and @value='([^']*)'\]\]",
                             args[2])
            assert m, args[2]
            if self.config.get(m.group(1)) == m.group(2):
                del self.config[m.group(1)]
            return Done(0)
        xml = ET.fromstring(args[args.index("--xml-text") + 1])
        if args[0] == "--create":
            sid = xml.get("id", "")
            if sid in self.config:
                return Done(EXISTS, "", "Call cib_create failed: File exists")
            self.config[sid] = xml.find("nvpair").get("value", "")  # type: ignore[union-attr]
            return Done(0)
        if args[0] == "--replace":
            self.config[xml.get("id", "")] = xml.find("nvpair").get("value", "")  # type: ignore[union-attr]
            return Done(0)
        return Done(64, "", f"the fake has no cibadmin {args}")

    def _attribute(self, args: list[str]) -> Done:
        node = self.nodes[args[args.index("--node") + 1]]
        assert args[args.index("--name") + 1] == "standby"
        assert args[args.index("--lifetime") + 1] == "reboot"
        node.standby = "--update" in args
        self.pending = True
        return Done(0)

    # --- what the tests look at ------------------------------------------------------------------

    def standbys(self, node: str) -> int:
        """How many times `node` was put in standby."""
        return sum(1 for c in self.commands if c[0] == "crm_attribute" and "--update" in c and node in c)

    @property
    def lock(self) -> str | None:
        return self.config.get("maintd-lock")

    def claim(self, node: str) -> str | None:
        return self.config.get(f"maintd-claim-{node}")
