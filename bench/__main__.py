"""python -m bench [NAME ...] [--quick]: run the benchmarks, print and save their figures."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from bench.common import write_summary

ALL = ("parse_cost", "plan_cost", "steady", "detection", "approval", "probe_load", "probe_flood", "server_cost",
       "fleet", "silence", "silence_timing", "cli_watch", "model",
       "store_chaos", "fleet_history", "budget", "gate_pace", "pacemaker")

MODULES = {"model": "model_check"}
"""Benchmarks whose module is not named after them."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"some of: {', '.join(ALL)} (default: all)")
    p.add_argument("--backend", choices=("peers", "azure_blob"), default="peers",
                   help="fleet only: coordinate through the peers (default) or Azure Blob Storage (Azurite)")
    p.add_argument("--quick", action="store_true",
                   help="reduced counts, written to bench/results/quick/ (a smoke test, not figures to quote)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in ALL]
    if unknown:
        p.error(f"no benchmark {', '.join(unknown)}; choose from {', '.join(ALL)}")
    for name in args.names or ALL:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        module = "fleet_store" if name == "fleet" and args.backend == "azure_blob" else MODULES.get(name, name)
        importlib.import_module(f"bench.{module}").run(quick=args.quick)
        print(f"   ({time.monotonic() - t0:.0f}s)", flush=True)
    print(f"summary: {write_summary(args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
