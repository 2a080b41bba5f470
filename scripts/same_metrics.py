"""Do two runs log the same metrics, step for step? Prints every difference and exits 1 if any.

Timing keys (metrics_log.TIMING_KEYS) are never compared; `--skip sync/` leaves out keys with that
prefix too (e.g. to compare a delta-sync run with a full-sync one, whose `sync/*` differ by design).

    python scripts/same_metrics.py runs/a runs/b --skip sync/
"""
import argparse
import sys

from qurl.train.metrics_log import metric_differences, read_metrics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs=2, help="two run directories (each with metrics.jsonl)")
    ap.add_argument("--skip", action="append", default=[], help="a key prefix not to compare")
    args = ap.parse_args()
    recs = [read_metrics(f"{r}/metrics.jsonl") for r in args.runs]
    if not all(recs):
        print("no records in", " or ".join(r for r, x in zip(args.runs, recs) if not x))
        return 2
    diff = metric_differences(*recs, skip_prefixes=tuple(args.skip))
    keys = sorted({k for r in recs[0] for k in r})
    print(f"{len(recs[0])} vs {len(recs[1])} records, {len(keys)} keys; "
          f"{len(diff)} difference(s)")
    print("\n".join(diff[:50]))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
