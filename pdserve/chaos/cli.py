"""``pdserve chaos``: run fault-injection scenarios against a local cluster of real processes
and report what held (JSON lines, or one JSON file with ``--out``)."""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    from pdserve.chaos.scenarios import SCENARIOS
    p = argparse.ArgumentParser(prog="pdserve chaos", description=__doc__)
    p.add_argument("--scenario", action="append", choices=[*SCENARIOS, "all"],
                   help="scenario to run (repeatable; default all)")
    p.add_argument("--model", default="smollm2-135m", help="model spec of the cluster")
    p.add_argument("--out", default="", help="write every result to this JSON file")
    a = p.parse_args(argv)
    names = list(SCENARIOS) if not a.scenario or "all" in a.scenario else a.scenario
    results, failed = [], 0
    for name in names:
        t0 = time.monotonic()
        try:
            res = SCENARIOS[name](a.model).to_dict()
        except Exception as e:  # noqa: BLE001 - a scenario that breaks is a failed one
            res = {"scenario": name, "passed": False, "error": repr(e)}
        res["seconds"] = round(time.monotonic() - t0, 1)
        results.append(res)
        failed += not res["passed"]
        print(json.dumps(res), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "pdserve chaos " + " ".join(argv or sys.argv[1:]),
                       "model": a.model, "results": results}, f, indent=1)
    print(f"{len(results) - failed} of {len(results)} scenarios passed", file=sys.stderr)
    return 1 if failed else 0
