"""A faithful IMDS Scheduled Events emulator, for tests, benchmarks, `maintd demo` and rehearsing hooks.

    emu = Emulator(vms=["vm-1", "vm-2"])
    urls = emu.start()                       # {"vm-1": "http://127.0.0.1:PORT", ...}: one server per VM
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=900)
    emu.add_fault(kind="status", status=503, count=3)
    emu.requests("vm-1"); emu.approvals(); emu.stop()

Each VM has its own port, as each Azure VM has its own IMDS. By default every VM sees every event
(one availability set) and must filter on Resources, as a real client must (`broadcast=False`: a
VM sees only the events naming it, like GPU scale sets with one fault domain). Any VM that sees an
event may approve it; `approvals_required=N` needs N distinct VMs (shared infrastructure).

Time comes from `clock` (e.g. `agent.clock.FakeClock`; default real time). Every span given to the
emulator (notice, durations, fault delays) is in emulated seconds; `time_scale` > 1 runs emulated
time faster. The model advances on every request and every 50 ms while started (`tick()`).

Only the standard library and PyYAML are used, and nothing is shared with the client side
(`agent.model.events`, `agent.imds`, `agent.model.tracker`): a mistake in one is never mirrored by the other.

May import: nothing of `agent` outside `agent.emulator`.
"""

from agent.emulator.emulator import Emulator
from agent.emulator.model import Approval, RecordedRequest
from agent.emulator.scenario import Scenario

__all__ = ["Approval", "Emulator", "RecordedRequest", "Scenario"]
