"""Reading config.toml files written before the config redesign (issue 14), so old runs resume.

Most fields only moved (`RENAMED`); six pairs of old fields became one new field each (`_merge_*`).
`upgrade` maps an old flat {"section.field": value} dict to today's names; it refuses, naming the
fields, when the old values cannot be expressed (e.g. two different hosts for one address).
A `--set` or `--config` that uses an old name is refused with the new name (qurl.config.load).
"""
from __future__ import annotations

from typing import Any

from qurl.config.rules import ConfigError

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
    "optim.beta1": "optim.betas", "optim.beta2": "optim.betas",
    "learner.backend": "deploy.backend", "learner.nnodes": "deploy.nnodes",
    "learner.nproc_per_node": "deploy.nproc_per_node", "learner.master_addr": "deploy.host",
    "learner.master_port": "deploy.learner_port",
    "learner.distributed_optimizer": "deploy.distributed_optimizer",
    "learner.transformer_engine": "deploy.transformer_engine",
    "stream.host": "deploy.host", "stream.traj_port": "deploy.inbox_port",
    "stream.hwm": "deploy.stream_hwm", "stream.key": "deploy.stream_key",
    "sync.bucket_mb": "deploy.bucket_mb", "sync.port": "deploy.weight_port",
    "sync.backend": "deploy.worker_backend",
}


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


def _merge_betas(old: dict[str, Any]) -> list[float]:
    return [old.get("optim.beta1", 0.9), old.get("optim.beta2", 0.999)]


def _merge_host(old: dict[str, Any], where: str) -> str:
    hosts = {old[k] for k in ("learner.master_addr", "stream.host") if k in old}
    if len(hosts) > 1:
        raise ConfigError(f"{where}: learner.master_addr and stream.host differ ({sorted(hosts)}); "
                             "today one deploy.host serves both: set it with --set deploy.host=...")
    return hosts.pop()


def _nproc(old: dict[str, Any]) -> int:
    # the old default 1 meant "tp * dp / nnodes" to `qurl launch`; today that is 0
    n = old["learner.nproc_per_node"]
    return 0 if n == 1 else n


_MERGED = {
    "deploy.nproc_per_node": lambda old, where: _nproc(old),
    "deploy.wandb": lambda old, where: _merge_wandb(old),
    "model.base": lambda old, where: _merge_base(old),
    "deploy.rollout": lambda old, where: _merge_rollout(old),
    "data.fields": lambda old, where: _merge_fields(old),
    "optim.betas": lambda old, where: _merge_betas(old),
    "deploy.host": _merge_host,
}


def upgrade(flat: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Map an old config's {"section.field": value} to today's names (new names pass through)."""
    old = {k: v for k, v in flat.items() if k in RENAMED}
    out = {k: v for k, v in flat.items() if k not in RENAMED}
    for key, value in old.items():
        new = RENAMED[key]
        out[new] = _MERGED[new](old, where) if new in _MERGED else value
    return out
