"""Model checking S1 and S2 (tests/model): states explored and time for each backend's model, and the
counterexamples if any property breaks (each one the numbered steps that lead there); then the disruption
budget's B1-B4 over each member's belief (`bench.model_beliefs`: its runs, today's bugs re-injected).

The same explorations run in the test suite (tests/model/test_model_check.py); this records their size and
time on this machine: `python -m bench model`.
"""

from __future__ import annotations

import time
from typing import Any

from bench import model_beliefs
from bench.common import write
from tests.model.common import CAP, LOST_ANSWER, MAX_FAULTS, PAUSE, POST_ERROR, TICK, VMS
from tests.model.explorer import explore
from tests.model.peer_model import IGNORE, PeerModel
from tests.model.store_model import StoreModel

PAIRED = (PAUSE, POST_ERROR, LOST_ANSWER)
"""Also recorded: two faults per path, a pause with a failed or lost POST."""
BUDGET = 60.0
"""Seconds the whole check may take in CI on a 2-core machine (both models)."""


def run(quick: bool = False) -> dict[str, Any]:
    started, cpu = time.monotonic(), time.process_time()
    results = [explore(model, outcomes={"a POST": lambda s: bool(s.imds.posted_by)})
               for model in (PeerModel(), StoreModel())]
    in_suite, in_suite_cpu = time.monotonic() - started, time.process_time() - cpu
    paired = [explore(model, outcomes={"a POST": lambda s: bool(s.imds.posted_by)})
              for model in (PeerModel(2, PAIRED), StoreModel(2, PAIRED))]
    ignore = explore(PeerModel(config=IGNORE), outcomes={"a POST": lambda s: bool(s.imds.posted_by)})
    total = time.monotonic() - started
    figures: dict[str, Any] = {"vms": len(VMS), "faults_per_path": MAX_FAULTS, "tick_seconds": TICK,
                               "ages_capped_at_ticks": CAP, "one_fault_seconds": round(in_suite, 2),
                               "one_fault_cpu_seconds": round(in_suite_cpu, 2),
                               "total_seconds": round(total, 2), "paired_faults": list(PAIRED)}
    checks = []
    for r in results + paired:
        key = r.model if r in results else f"{r.model}_two_faults"
        figures[key] = r.figures()
        print(f"  {key}: {r.states} states, {r.transitions} transitions, depth {r.depth}, "
              f"{r.seconds:.1f} s ({r.cpu_seconds:.1f} s CPU), complete {r.complete}, "
              f"states with a POST {r.reached.get('a POST', 0)}",
              flush=True)
        for found in r.violations.values():
            print(found.render(), flush=True)
        broken = ", ".join(sorted(r.violations)) or "none"
        checks.append((f"{key} model: properties broken ({r.states} states, {r.cpu_seconds:.1f} s CPU)", broken,
                       "none", not r.violations and r.complete))
    figures["peers_ignore"] = ignore.figures()
    print(f"  peers under unreachable_peers: ignore (peer_timeout {IGNORE.peer_timeout:.0f} s): {ignore.states} "
          f"states, {ignore.cpu_seconds:.1f} s CPU", flush=True)
    for found in ignore.violations.values():
        print(found.render(), flush=True)
    checks.append(("peers under ignore: S2 broken, as the README says (ignore is the opt-out of S1 and S2)",
                   "yes" if "S2" in ignore.violations else "no", "yes", "S2" in ignore.violations))
    checks.append(("both models, one fault per path (the suite's run; CI budget), CPU (wall)",
                   f"{in_suite_cpu:.1f} s ({in_suite:.1f} s)", f"< {BUDGET:.0f} s", in_suite_cpu < BUDGET))
    print("  budget, each member's belief:", flush=True)
    beliefs, belief_checks = model_beliefs.run()
    figures["budget_beliefs"] = beliefs
    return write("model_check", figures, checks + belief_checks, quick)
