"""`qurl fetch NAME`'s training sets: a paper recipe's training set, downloaded once to a file.

The evaluation sets ship with qurl (qurl/data/sets/); the training sets are 7k to 40k rows and are
fetched from the Hugging Face Hub instead. Each name maps to one file of a public dataset repo, saved
under `--dir` (default `data/`) with the name the paper presets expect in `data.train`:

| name            | Hub dataset                                   | file in the repo                     |
| --------------- | --------------------------------------------- | ------------------------------------ |
| `gsm8k_train`   | openai/gsm8k (MIT)                            | main/train-00000-of-00001.parquet    |
| `deepscaler`    | agentica-org/DeepScaleR-Preview-Dataset (MIT) | deepscaler.json                      |
| `dapo-math-17k` | BytedTsinghua-SIA/DAPO-Math-17k (Apache-2.0)  | data/dapo-math-17k.parquet           |

The downloaded file is loaded like any other (`qurl.data.datasets.load_dataset`, formats gsm8k,
deepscaler and dapo); nothing here runs during training.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

# name -> (Hub dataset repo, file in the repo, local file name)
TRAINING_SETS: dict[str, tuple[str, str, str]] = {
    "gsm8k_train": ("openai/gsm8k", "main/train-00000-of-00001.parquet", "gsm8k_train.parquet"),
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", "deepscaler.json", "deepscaler.json"),
    "dapo-math-17k": ("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet",
                      "dapo-math-17k.parquet"),
}


def target_path(name: str, directory: str | Path = "data") -> Path:
    """Where `fetch(name, directory)` puts the file (the path the paper presets name)."""
    if name not in TRAINING_SETS:
        raise ValueError(f"unknown training set {name!r} (known: {', '.join(TRAINING_SETS)})")
    return Path(directory) / TRAINING_SETS[name][2]


def fetch(name: str, directory: str | Path = "data") -> Path:
    """Download training set `name` into `directory` (skipped when the file is there)."""
    out = target_path(name, directory)
    if out.is_file():
        return out
    os.environ["HF_HUB_OFFLINE"] = "0"  # the CLI defaults to offline; this command needs the Hub
    from huggingface_hub import hf_hub_download

    repo, filename, _ = TRAINING_SETS[name]
    cached = hf_hub_download(repo_id=repo, filename=filename, repo_type="dataset")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.copyfile(cached, tmp)
    tmp.rename(out)
    return out
