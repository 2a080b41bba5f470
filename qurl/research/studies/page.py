"""The ablation's page: `ablation.md` and its CSVs, put together from the study's parts.

The parts each have their module: the per-arm table and the paired differences
(qurl/research/studies/tables.py), the paper's claims checked per seed (claims.py), the trajectories
(trajectories.py), and which arms started from the same weights (store.py's `starts`, written
here by `starts_markdown`). This module only assembles them, so none of the parts imports another
part's writer.
"""
from __future__ import annotations

from pathlib import Path

from qurl.research.studies.claims import claims_markdown
from qurl.research.studies.records import write_records
from qurl.research.studies.store import starts
from qurl.research.studies.tables import _csv, markdown, pair_rows, seed_rows, summarize
from qurl.research.studies.trajectories import trajectories_markdown


def starts_markdown(found: dict[int, dict[str | None, list[str]]]) -> str:
    """Which arms of each seed started from the same weights ({seed: {sha256 or None: [arms]}},
    qurl.research.studies.store.starts); "" when no arm recorded its start."""
    if not any(sha for by in found.values() for sha in by):
        return ""
    lines = ["", "Starting weights per seed (SHA-256 of the warm-started base, first 12 hex digits; "
             "arms listed together started from the same weights; a seed's warm start rebuilt on "
             "another machine differs slightly, qurl/research/studies/store.py):", ""]
    for seed, by in sorted(found.items()):
        groups = [f"`{sha[:12]}` {', '.join(arms)}" for sha, arms in by.items() if sha]
        if None in by:
            groups.append(f"not recorded: {', '.join(by[None])}")
        lines.append(f"- seed {seed}: " + "; ".join(groups))
    return "\n".join(lines) + "\n"


def write_tables(records: dict[int, dict[str, list[dict]]], out: Path, *, baseline: str) -> Path:
    """ablation.md into out, its CSVs with the study's records (records.write_records); returns it."""
    rows = seed_rows(records)
    summary, pairs = summarize(rows, baseline), pair_rows(rows, baseline)
    out.mkdir(parents=True, exist_ok=True)
    write_records(out, {"ablation_seeds.csv": _csv(rows), "ablation.csv": _csv(summary),
                        **({"ablation_pairs.csv": _csv(pairs)} if pairs else {})})
    path = out / "ablation.md"
    eval_ses = {r["arm"]: r["acc_vs_base_eval_se"] for r in summary}
    path.write_text("# qurl study ablation\n\n" + markdown(summary, pairs, list(records))
                    + claims_markdown(rows, baseline, eval_ses) + trajectories_markdown(records)
                    + starts_markdown(starts(out)))
    return path
