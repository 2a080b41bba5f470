"""A run's data, from its `[data]` config: the training prompts and the evaluation sets.

`data.train` names one source and `data.eval` a comma-separated list of them: "synthetic"
(arithmetic tasks generated from the run seed, synthetic.py), a jsonl / json / parquet
file path, or the bare name of a set shipped in qurl/data/sets/ ("aime24"). Training files are read
with the `data.format` preset; each eval file's format is detected from its own rows unless the
fields are spelled out (datasets.py). Each eval set is cut to `data.eval_size` examples
(0 = the whole file); the training file is used whole (`data.train_size` sizes only the synthetic
split).

A malformed row or unreadable file raises DataError (datasets.py), a bad `data.eval` list
ConfigError, a name that is neither a file nor a shipped set FileNotFoundError: `qurl train` calls
`load_datasets` before starting any rank, so each is one line and exit status 2.
"""
from __future__ import annotations

from pathlib import Path

from qurl.config import ConfigError, DataConfig
from qurl.data.datasets import Example, load_dataset
from qurl.data.sets import resolve_data_path
from qurl.data.synthetic import arithmetic_task


def eval_set_names(data: DataConfig) -> list[str]:
    """data.eval as a list: comma-separated set names or paths ("aime24,amc23,math500")."""
    names = [n.strip() for n in data.eval.split(",") if n.strip()]
    if not names:
        raise ConfigError("data.eval: name at least one evaluation set")
    if len(set(names)) != len(names):
        raise ConfigError(f"data.eval={data.eval!r}: a set is named twice")
    if "synthetic" in names and data.eval_size <= 0:
        raise ConfigError(f"data.eval_size={data.eval_size}: the synthetic eval split needs a "
                          "size > 0 (0 means whole files, for file sets only)")
    return names


def _load(d: DataConfig, seed: int, source: str, split: str, n: int) -> list[Example]:
    if source == "synthetic":
        return arithmetic_task(n, seed=seed, split=split, digits=d.digits,
                               n_operands=d.operands)
    # each eval set is detected from its own rows unless the fields are spelled out
    fmt = d.format if split == "train" or d.format == "custom" else "auto"
    question, answer = d.fields if d.fields else (None, None)
    return load_dataset(resolve_data_path(source), fmt, question_field=question, answer_field=answer,
                        limit=(n or None) if split == "eval" else None)


def load_eval_sets(data: DataConfig, seed: int) -> dict[str, list[Example]]:
    """{set name: examples} for every set of data.eval, at most data.eval_size each (0 = all of
    a file set). Names are file stems ("synthetic" for the generated split, from run seed `seed`)."""
    names = eval_set_names(data)
    stems = [Path(name).stem for name in names]
    if len(set(stems)) != len(stems):
        raise ConfigError(f"data.eval={data.eval!r}: two sets share a file name {stems}")
    return {stem: _load(data, seed, name, "eval", data.eval_size)
            for stem, name in zip(stems, names)}


def load_datasets(data: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """(train split, every eval set concatenated; uids stay unique: they carry the set's name).
    `seed`: the run's (run.seed), which generates the synthetic splits."""
    evals = load_eval_sets(data, seed)
    return (_load(data, seed, data.train, "train", data.train_size),
            [ex for exs in evals.values() for ex in exs])
