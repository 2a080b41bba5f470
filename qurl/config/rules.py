"""Checking a whole config tree: each field's own rules (on its type, in tree.py and
deployment.py; fields.py `check_field`), then the rules that tie fields together.

Each rule names the fields it reads, so the error a user meets says which settings disagree.
"""
from __future__ import annotations

from dataclasses import fields

from qurl.config.fields import ConfigError, check_field, field_hints
from qurl.config.tree import LOCAL_BASES, Config, leaves


def validate(cfg: Config) -> Config:
    """Check every leaf against its type's rules, then the cross-field rules; return cfg.
    ConfigError for the first rule `cfg` breaks."""
    for section in fields(cfg):
        for dotted, cls, name, value in leaves(getattr(cfg, section.name), f"{section.name}."):
            check_field(value, field_hints(cls)[name], dotted)
    r, a, e = cfg.rollout, cfg.algo, cfg.eval
    if r.top_p > 1:
        raise ConfigError(f"rollout.top_p={r.top_p}: must be in (0, 1]")
    if e.top_p > 1:
        raise ConfigError(f"eval.top_p={e.top_p}: must be in (0, 1]")
    # The batch always holds prompts_per_step full groups (dynamic sampling refills it), so these
    # two checks keep every step divisible into mini-batches x data-parallel ranks.
    batch = r.prompts_per_step * r.group_size
    if batch % a.mini_batches:
        raise ConfigError(
            f"algo.mini_batches={a.mini_batches}: must divide prompts_per_step*group_size={batch}")
    if (batch // a.mini_batches) % cfg.learner.dp:
        raise ConfigError(f"learner.dp={cfg.learner.dp}: must divide the mini-batch of "
                          f"{batch // a.mini_batches} sequences (prompts_per_step*group_size"
                          f"/algo.mini_batches)")
    if cfg.learner.dp % cfg.learner.ep:
        raise ConfigError(f"learner.ep={cfg.learner.ep}: must divide learner.dp={cfg.learner.dp} "
                          "(expert parallelism divides the experts over groups of data-parallel "
                          "ranks)")
    if r.precision == "w4a16" and r.engine != "local":
        raise ConfigError("rollout.precision='w4a16': the weight-only 4-bit stress format of the "
                          "ablation study runs on the local engine only (rollout.engine='local')")
    if r.precision == "fp8_block" and r.engine != "sglang":
        raise ConfigError("rollout.precision='fp8_block': SGLang's block-scaled FP8 needs "
                          "rollout.engine='sglang' (the local engine runs int8/fp8 per channel)")
    if r.max_staleness and cfg.deploy.rollout == "inline":
        raise ConfigError(f"rollout.max_staleness={r.max_staleness}: inline rollout is synchronous; "
                          "asynchronous rollout needs deploy.rollout='workers' or 'external'")
    if len(a.clip) != 2 or not all(eps > 0 for eps in a.clip):
        raise ConfigError(f"algo.clip={list(a.clip)}: must be two numbers eps_low,eps_high, each > 0")
    b = a.correction.bounds
    if b and (len(b) != 2 or not 0 < b[0] <= 1 <= b[1]):
        raise ConfigError(f"algo.correction.bounds={list(b)}: must be two numbers low,high with "
                          "0 < low <= 1 <= high (a ratio of 1, no mismatch, is always kept), or "
                          "empty for the kind's usual bounds")
    if a.correction.keep == "geo" and a.loss == "icepop":
        raise ConfigError("algo.correction.keep='geo': the sequence's g exists only for "
                          "algo.loss='geomask' (icepop keeps rho or one)")
    if (len(a.overlong) != 2 or not a.overlong[0] >= 0 or not float(a.overlong[0]).is_integer()
            or not a.overlong[1] >= 0):
        raise ConfigError(f"algo.overlong={list(a.overlong)}: must be window,penalty: a whole "
                          "number of tokens >= 0 (0 = off) and a penalty >= 0")
    m = cfg.model
    if (m.warmstart_checkpoint and m.warmstart_steps and m.base not in LOCAL_BASES
            and cfg.data.train != "synthetic"):
        raise ConfigError(f"model.warmstart_checkpoint: the warm start trains on worked solutions of "
                          f"the synthetic task; data.train={cfg.data.train!r} has none (set "
                          "model.warmstart_checkpoint=false)")
    if not e.greedy and not e.samples:
        raise ConfigError("eval.greedy=false and eval.samples=0: the evaluation would measure nothing")
    for k in e.pass_k:
        if not 1 <= k <= e.samples:
            raise ConfigError(f"eval.pass_k={list(e.pass_k)}: each k must be in [1, eval.samples="
                              f"{e.samples}]")
    if e.samples and not e.temperature > 0:
        raise ConfigError(f"eval.temperature={e.temperature}: must be > 0 for sampled evaluation")
    adam = cfg.optim.adam
    if len(adam) != 3 or not all(0 <= b < 1 for b in adam[:2]) or not adam[2] > 0:
        raise ConfigError(f"optim.adam={list(adam)}: must be three numbers beta1,beta2,eps with "
                          "each beta in [0, 1) and eps > 0")
    if cfg.data.format == "custom" and len(cfg.data.fields) != 2:
        raise ConfigError("data.fields: format=custom needs the question and answer columns, "
                          "e.g. data.fields=problem,solution")
    if cfg.data.fields and len(cfg.data.fields) != 2:
        raise ConfigError(f"data.fields={list(cfg.data.fields)}: must be two names, question,answer")
    if cfg.deploy.stream.key and len(cfg.deploy.stream.key.encode()) < 16:
        raise ConfigError("deploy.stream.key: must be at least 16 bytes (or empty for a random run key)")
    return cfg
