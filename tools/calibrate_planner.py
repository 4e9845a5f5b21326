#!/usr/bin/env python
"""The memory planner against the peers' published longest contexts, on the peers' hardware.

    python tools/calibrate_planner.py --output docs/bench/planner_calibration.json
    python tools/calibrate_planner.py --records alst-8,upipe-8 --output /tmp/cal.json

For each record (autosp_lm/planner/calibrate.py: ALST's 3.7M tokens of Llama-3.1-8B on 8 x H100
and 15M on 32, UPipe's 5,242,880 on 8, ALST's 500K on one H100) the planner searches the longest
length of the same recipe on the same hardware and the table puts it beside the published
figure, with what the peer runs that the planner does not model. JSON and Markdown are written
after every row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse_args(argv=None):
    from autosp_lm.planner.calibrate import RECORDS
    from autosp_lm.planner.plan import DEFAULT_RESERVE_GB
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", default=",".join(r.key for r in RECORDS),
                   help="comma list of records: " + ", ".join(r.key for r in RECORDS))
    p.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                   help="the planner's reserve (GiB), subtracted from each GPU's memory")
    p.add_argument("--output", help="JSON file to write (Markdown next to it)")
    return p.parse_args(argv)


def main(argv=None) -> list:
    import torch

    from autosp_lm.planner.calibrate import calibrate_one, markdown, record
    args = parse_args(argv)
    try:
        records = [record(k.strip()) for k in args.records.split(",") if k.strip()]
    except KeyError as e:
        raise SystemExit(f"calibrate_planner.py: {e.args[0]}") from None
    env = {"torch": torch.__version__, "cpu_count": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "reserve_gb": args.reserve_gb,
           "command": "python tools/calibrate_planner.py " + " ".join(
               argv if argv is not None else sys.argv[1:])}
    if args.output and os.path.dirname(args.output):
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
    rows = []
    for rec in records:
        print(f"{rec.key}: {rec.recipe} on {rec.gpus} x H100, {rec.model} ...", flush=True)
        rows.append(calibrate_one(rec, reserve_gb=args.reserve_gb,
                                  log=lambda m: print(m, flush=True)))
        if args.output:
            data = {"rows": [r.as_dict() for r in rows], "environment": env,
                    "complete": len(rows) == len(records)}
            tmp = args.output + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, default=str)
            os.replace(tmp, args.output)
            with open(os.path.splitext(args.output)[0] + ".md", "w") as f:
                f.write(markdown(rows, env))
    return rows


if __name__ == "__main__":
    main()
