"""Reading config.toml files written by older qurl, so old runs resume, rebuild and tabulate.

Two redesigns renamed fields. Issue 14 moved most fields between sections and merged six pairs;
issue 57 cut the training fields to 55: the correction settings became the `[algo.correction]`
table (`algo.tis_cap` and `algo.seq_tis_cap` -> `cap`; `algo.icepop_bounds` and
`algo.geo_mask_bounds` -> `bounds`; `algo.icepop_keep` and `algo.geo_mask_keep` -> `keep`, each
taken from the kind algo.loss names, a value equal to that kind's usual one written as the
default), and four groups became one field each: `algo.eps_low`/`eps_high` -> `algo.clip`,
`algo.dynamic_sampling`/`max_sample_rounds` -> `algo.dynamic_sampling_rounds`,
`algo.overlong_buffer`/`overlong_penalty` -> `algo.overlong`, `optim.betas`/`adam_eps` (and
issue 14's `beta1`/`beta2`) -> `optim.adam`. Issue 66 split `deploy` by concern: its
learner-process, weight-sync, stream and alarm fields moved into the tables `[deploy.ranks]`,
`[deploy.sync]`, `[deploy.stream]` and `[deploy.alarm]` (`deploy.sync_mode` -> `deploy.sync.mode`,
`deploy.weight_port` -> `deploy.sync.port`, ...). Every old name is in `RENAMED`; a field fed by
several old ones is built by its `_merge_*`. `DROPPED` fields left the config and are skipped on read.

`upgrade` maps an old flat {"section.field": value} dict to today's names; it refuses, naming the
fields, when the old values cannot be expressed (e.g. two different hosts for one address).
A `--set` or `--config` that uses an old name is refused with the new name (qurl.config.load).
"""
from __future__ import annotations

from typing import Any

from qurl.config.fields import ConfigError

RENAMED: dict[str, str] = {
    "run.dir": "deploy.dir", "run.ckpt_every": "deploy.ckpt_every",
    "run.keep_ckpts": "deploy.keep_ckpts", "run.progress": "deploy.progress",
    "run.torch_threads": "deploy.torch_threads",
    "run.wandb": "deploy.wandb", "run.wandb_mode": "deploy.wandb",
    "model.preset": "model.base", "model.path": "model.base",
    "data.reward_timeout_s": "deploy.reward_timeout_s",
    "data.question_field": "data.fields", "data.answer_field": "data.fields",
    "rollout.eval_max_new_tokens": "eval.max_new_tokens",
    "rollout.num_workers": "deploy.engines",
    "rollout.mode": "deploy.rollout", "rollout.workers": "deploy.rollout",
    "rollout.sglang_urls": "sglang.urls", "rollout.sglang_args": "sglang.args",
    "rollout.sglang_tp": "sglang.tp",
    "optim.beta1": "optim.adam", "optim.beta2": "optim.adam",
    "learner.backend": "deploy.ranks.backend", "learner.nnodes": "deploy.ranks.nnodes",
    "learner.nproc_per_node": "deploy.ranks.nproc_per_node", "learner.master_addr": "deploy.host",
    "learner.master_port": "deploy.ranks.port",
    "learner.distributed_optimizer": "deploy.ranks.distributed_optimizer",
    "learner.transformer_engine": "deploy.ranks.transformer_engine",
    "stream.host": "deploy.host", "stream.traj_port": "deploy.stream.port",
    "stream.hwm": "deploy.stream.hwm", "stream.key": "deploy.stream.key",
    "sync.bucket_mb": "deploy.sync.bucket_mb", "sync.port": "deploy.sync.port",
    "sync.backend": "deploy.sync.worker_backend",
    # issue 57: the training fields back to 55
    "algo.tis_cap": "algo.correction.cap", "algo.seq_tis_cap": "algo.correction.cap",
    "algo.icepop_bounds": "algo.correction.bounds", "algo.geo_mask_bounds": "algo.correction.bounds",
    "algo.icepop_keep": "algo.correction.keep", "algo.geo_mask_keep": "algo.correction.keep",
    "algo.eps_low": "algo.clip", "algo.eps_high": "algo.clip",
    "algo.dynamic_sampling": "algo.dynamic_sampling_rounds",
    "algo.max_sample_rounds": "algo.dynamic_sampling_rounds",
    "algo.overlong_buffer": "algo.overlong", "algo.overlong_penalty": "algo.overlong",
    "optim.betas": "optim.adam", "optim.adam_eps": "optim.adam",
    # issue 66: DeployConfig split by concern into [deploy.ranks], [deploy.sync], [deploy.stream],
    # [deploy.alarm]
    "deploy.sync_mode": "deploy.sync.mode", "deploy.full_sync_every": "deploy.sync.full_every",
    "deploy.verify_kernels_every": "deploy.sync.verify_kernels_every",
    "deploy.bucket_mb": "deploy.sync.bucket_mb",
    "deploy.worker_backend": "deploy.sync.worker_backend",
    "deploy.weight_port": "deploy.sync.port", "deploy.stream_hwm": "deploy.stream.hwm",
    "deploy.stream_key": "deploy.stream.key", "deploy.inbox_port": "deploy.stream.port",
    "deploy.alarm_kl_factor": "deploy.alarm.kl_factor", "deploy.alarm_steps": "deploy.alarm.steps",
    "deploy.alarm_stop": "deploy.alarm.stop", "deploy.nnodes": "deploy.ranks.nnodes",
    "deploy.nproc_per_node": "deploy.ranks.nproc_per_node",
    "deploy.backend": "deploy.ranks.backend", "deploy.learner_port": "deploy.ranks.port",
    "deploy.wait_timeout_min": "deploy.ranks.wait_timeout_min",
    "deploy.distributed_optimizer": "deploy.ranks.distributed_optimizer",
    "deploy.transformer_engine": "deploy.ranks.transformer_engine",
    "deploy.attention": "deploy.ranks.attention",
}

# Fields that left the config: why, for the `--set` that still names one. A run dir's config.toml
# may hold them; they never changed what a run learns, so reading it skips them.
DROPPED: dict[str, str] = {
    "eval.per_question": "per-question counts are the `qurl eval --per-question` flag",
}

# The usual settings of the two masks whose bounds and kept weight share one leaf each (the values
# qurl/algo/corrections.py takes for `[]` / "auto"); a config that held exactly these gets the
# default leaf, so it reads the same as one written today.
_USUAL = {"icepop": ((0.5, 5.0), "rho", "algo.icepop_bounds", "algo.icepop_keep"),
          "geomask": ((0.99, 1.01), "one", "algo.geo_mask_bounds", "algo.geo_mask_keep")}


def _merge_wandb(old: dict[str, Any]) -> str:
    on, mode = old.get("run.wandb", False), old.get("run.wandb_mode", "offline")
    return "off" if not on or mode == "disabled" else mode


def _merge_base(old: dict[str, Any]) -> str:
    preset = old.get("model.preset", "tiny")
    return old.get("model.path", "") if preset == "path" else preset


def _merge_rollout(old: dict[str, Any]) -> str:
    if old.get("rollout.mode", "sync") == "sync":
        return "inline"
    return "workers" if old.get("rollout.workers", "local") == "local" else "external"


def _merge_fields(old: dict[str, Any]) -> list[str]:
    q, a = old.get("data.question_field", ""), old.get("data.answer_field", "")
    if bool(q) != bool(a):
        raise ConfigError("data.question_field / data.answer_field: only one is set; today's "
                             "data.fields needs both (question,answer)")
    return [q, a] if q else []


def _merge_adam(old: dict[str, Any]) -> list[float]:
    b1, b2 = old.get("optim.betas", (old.get("optim.beta1", 0.9), old.get("optim.beta2", 0.999)))
    return [b1, b2, old.get("optim.adam_eps", 1e-8)]


def _merge_cap(old: dict[str, Any]) -> float:
    # One C for every weight: seqtis's own cap when seqtis is the loss, else tis's (the other fed
    # only the cut/ diagnostic of a kind the run did not train with).
    key = "algo.seq_tis_cap" if old.get("algo.loss", "acr") == "seqtis" else "algo.tis_cap"
    return old.get(key, 2.0)


def _merge_bounds(old: dict[str, Any]) -> list[float]:
    kind = _USUAL.get(old.get("algo.loss", "acr"))
    if kind is None or old.get(kind[2]) is None:
        return []
    bounds = [float(b) for b in old[kind[2]]]
    return [] if tuple(bounds) == kind[0] else bounds


def _merge_keep(old: dict[str, Any]) -> str:
    kind = _USUAL.get(old.get("algo.loss", "acr"))
    if kind is None or old.get(kind[3], kind[1]) == kind[1]:
        return "auto"
    return old[kind[3]]


def _merge_clip(old: dict[str, Any]) -> list[float]:
    return [old.get("algo.eps_low", 0.2), old.get("algo.eps_high", 0.2)]


def _merge_dynamic_sampling(old: dict[str, Any]) -> int:
    return old.get("algo.max_sample_rounds", 16) if old.get("algo.dynamic_sampling", False) else 0


def _merge_overlong(old: dict[str, Any]) -> list[float]:
    return [old.get("algo.overlong_buffer", 0), old.get("algo.overlong_penalty", 1.0)]


def _merge_host(old: dict[str, Any], where: str) -> str:
    hosts = {old[k] for k in ("learner.master_addr", "stream.host") if k in old}
    if len(hosts) > 1:
        raise ConfigError(f"{where}: learner.master_addr and stream.host differ ({sorted(hosts)}); "
                             "today one deploy.host serves both: set it with --set deploy.host=...")
    return hosts.pop()


def _nproc(old: dict[str, Any]) -> int:
    if "learner.nproc_per_node" not in old:  # issue 14's deploy.nproc_per_node: the same meaning
        return old["deploy.nproc_per_node"]
    # the old default 1 meant "tp * dp / nnodes" to `qurl launch`; today that is 0
    n = old["learner.nproc_per_node"]
    return 0 if n == 1 else n


_MERGED = {
    "deploy.ranks.nproc_per_node": lambda old, where: _nproc(old),
    "deploy.wandb": lambda old, where: _merge_wandb(old),
    "model.base": lambda old, where: _merge_base(old),
    "deploy.rollout": lambda old, where: _merge_rollout(old),
    "data.fields": lambda old, where: _merge_fields(old),
    "optim.adam": lambda old, where: _merge_adam(old),
    "deploy.host": _merge_host,
    "algo.correction.cap": lambda old, where: _merge_cap(old),
    "algo.correction.bounds": lambda old, where: _merge_bounds(old),
    "algo.correction.keep": lambda old, where: _merge_keep(old),
    "algo.clip": lambda old, where: _merge_clip(old),
    "algo.dynamic_sampling_rounds": lambda old, where: _merge_dynamic_sampling(old),
    "algo.overlong": lambda old, where: _merge_overlong(old),
}


def upgrade(flat: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Map an old config's {"section.field": value} to today's names (new names pass through,
    dropped fields are skipped). A merge reads the whole old dict: some depend on algo.loss."""
    out = {k: v for k, v in flat.items() if k not in RENAMED and k not in DROPPED}
    for key, value in flat.items():
        if key in RENAMED:
            new = RENAMED[key]
            out[new] = _MERGED[new](flat, where) if new in _MERGED else value
    return out
