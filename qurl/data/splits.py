"""A run's two data splits, from its `[data]` config: the training prompts and the held-out set.

`data.train` / `data.eval` name a source: "synthetic" (arithmetic tasks generated from the run seed,
qurl/data/synthetic.py) or a jsonl / json / parquet file read with the `data.format` preset
(qurl/data/datasets.py). The eval file is cut to `data.eval_size` examples; the training file is
used whole (`data.train_size` sizes only the synthetic split).
"""
from __future__ import annotations

from pathlib import Path

from qurl.config import Config
from qurl.data.datasets import Example, load_dataset
from qurl.data.synthetic import arithmetic_task

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # beside the checkout


def _resolve_data_path(path: str) -> Path:
    p = Path(path)
    if p.exists():
        return p
    if (SHARED_DATA / path).exists():
        return SHARED_DATA / path
    raise FileNotFoundError(f"data file {path!r} not found (also looked in {SHARED_DATA})")


def load_datasets(cfg: Config) -> tuple[list[Example], list[Example]]:
    """(train split, eval split) of the run."""
    d = cfg.data

    def one(source: str, split: str, n: int) -> list[Example]:
        if source == "synthetic":
            return arithmetic_task(n, seed=cfg.run.seed, split=split, digits=d.digits,
                                   n_operands=d.operands)
        return load_dataset(_resolve_data_path(source), d.format,
                            question_field=d.question_field or None,
                            answer_field=d.answer_field or None,
                            limit=n if split == "eval" else None)

    return one(d.train, "train", d.train_size), one(d.eval, "eval", d.eval_size)
