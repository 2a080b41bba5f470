"""qurl's public Python face: the verbs a user scripts with, the same steps as the command line
(cli.py), with the records they pass. These names keep their meaning across releases; every
other module under qurl/ is internal and may move (research code, qurl/research/, imports those
internals directly, as any script that accepts that may).

Configure:
- `load_config(preset, toml, sets)`: a preset, then a TOML file, then `--set`-style strings,
  validated: the `Config` of a run (`qurl train --preset --config --set`);
- `override(cfg, {"section.field": value})`: a copy of a config with fields replaced;
- `to_toml(cfg)`: a config as the TOML text a run directory's config.toml holds;
- `PRESETS`: the preset names `load_config` takes, each a function returning its `Config`;
- `Config`: the run's configuration (qurl/config/, docs/config.md);
- `ConfigError`: a bad config field, in one line; an `InputError`;
- `InputError`: every error that is bad user input (a field, a data row, a run directory), one line.

Run:
- `train(cfg, resume=False)`: run (or resume) `cfg` in this process with the synchronous loop;
  returns the final evaluation record (`qurl train` also checks the data and model first, starts
  the learner's ranks and runs the asynchronous pipeline when deploy.rollout asks for it);
- `evaluate(run_dir, step=None, sets=None)`: greedy / Avg@k / pass@k of a run's latest checkpoint
  (or `step`'s; `sets`: `--set` strings such as "eval.samples=8") on every eval set
  (`qurl eval runs/<run>`); the evaluation record;
- `evaluate_checkpoint(model_dir, cfg)`: the same for an HF checkpoint directory under `cfg`
  (`qurl eval DIR --config`);
- `export(run_dir, out, step=None, fmt="hf")`: a run's policy as an HF or 8-bit checkpoint that
  transformers and SGLang load (`qurl export`); returns `out`;
- `fetch(name, directory="data")`: download a paper training set (`qurl fetch NAME`);
- `fetch_model(name, directory=None)`: a registered pretrained model as an HF checkpoint directory
  (`qurl fetch smollm2-135m`);
- `resolve_base(name_or_path)`: `model.base` as a checkpoint path (a fetched model's directory).

Read a run:
- `read_config(run_dir)`: the `Config` a run directory was trained with;
- `read_metrics(path)`: the records of a metrics.jsonl (one dict per line);
- `report(run_dir, out=None)`: a run's metrics as one PNG of plots (`qurl report`); its path;
- `plot_runs({label: records}, out)`: several runs' metrics overlaid in one PNG.

What needs torch (training, evaluation, export, a run's checkpoints) is imported on first use:
`import qurl.api` and reading a run's metrics do not pay for the learner's imports.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qurl.config import PRESETS, Config, ConfigError, load_config, override, to_toml
from qurl.data.download import fetch
from qurl.errors import InputError
from qurl.models.registry import fetch_model, resolve_base
from qurl.train.metrics_log import read_metrics
from qurl.train.plots import plot_runs, report

if TYPE_CHECKING:
    from qurl.checkpoint.rundir import read_config
    from qurl.commands.eval import eval_checkpoint as evaluate_checkpoint
    from qurl.commands.eval import eval_run as evaluate
    from qurl.commands.export import export_run as export
    from qurl.commands.train import train

# the names whose modules import torch: public name -> (module, name there)
_LAZY: dict[str, tuple[str, str]] = {
    "train": ("qurl.commands.train", "train"),
    "evaluate": ("qurl.commands.eval", "eval_run"),
    "evaluate_checkpoint": ("qurl.commands.eval", "eval_checkpoint"),
    "export": ("qurl.commands.export", "export_run"),
    "read_config": ("qurl.checkpoint.rundir", "read_config"),
}

__all__ = ["PRESETS", "Config", "ConfigError", "InputError", "evaluate", "evaluate_checkpoint",
           "export", "fetch", "fetch_model", "load_config", "override", "plot_runs", "read_config",
           "read_metrics", "report", "resolve_base", "to_toml", "train"]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"qurl.api has no {name!r}: its names are qurl.api.__all__") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
