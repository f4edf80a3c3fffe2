"""KV fragmentation benchmark: paged vs contiguous allocation on one trace and KV budget.

Prints one JSON summary, and saves it and a plot under benchmarks/results/. The work is
done by `pagedinfer simulate` (pagedinfer.service.simulate); this is its driver for the
published results. Extra arguments are passed through, e.g. --num-requests 2000.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedinfer.service import simulate

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    simulate.add_arguments(parser)
    parser.set_defaults(plot=str(RESULTS / "fragmentation.png"))
    parser.add_argument("--out", default=str(RESULTS / "fragmentation.json"), help="JSON path")
    args = parser.parse_args(argv)
    summary = simulate.run_benchmark(args)
    if summary["setup"].get("plot"):
        summary["setup"]["plot"] = Path(args.plot).name  # no machine paths in published results
    text = json.dumps(summary, indent=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
