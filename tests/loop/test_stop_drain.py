"""The stop-time drain (`probe.drain_on_stop`) leaves rotation for as long as the `drain` handler
would: the LB's probe timeout plus the drain grace of the profile in force, not the global one."""

from __future__ import annotations

import threading

from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.systemd import Notifier

CONFIG = """identity: {{name: vm1}}
state: {{dir: {dir}}}
probe: {{drain_on_stop: always, lb_timeout: 11s, lb_interval: 5s, drain_grace: 1s}}
profiles:
  - {{name: default, approval: auto, drain_grace: 25s}}
"""


def test_the_stop_drain_waits_the_profiles_drain_grace_out_of_rotation(tmp_path, clock):
    """Before: the stop drain waited lb_timeout + probe.drain_grace (12 s) and ignored the profile's 25 s grace."""
    d = Daemon(loads(CONFIG.format(dir=tmp_path)), clock, boot_id="b", notifier=Notifier({}))
    d.parts.publish_settings(d.profile)
    start = clock.monotonic()
    d.parts.drain_for_stop(threading.Event())
    assert clock.monotonic() - start == 36.0
    assert not d.parts.rotation.verdict().in_rotation
