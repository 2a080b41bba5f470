"""Typed payloads carried by the stream: trajectory batches (worker -> learner) and prompts
(learner -> worker), their packing into flat tensors, and the checks a receiver runs before use.

Trajectory batch ("trajectory" messages). N trajectories are packed as concatenations plus offsets,
so one message carries many trajectories in a fixed 10 frames however large N is:

    prompt_ids [sum P] int64, prompt_offsets [N+1] int64
    response_ids [sum T] int64, response_offsets [N+1] int64   (shared by behav_logp and versions)
    behav_logp [sum T] float32, versions [sum T] int64, behav_entropy [sum T] float32
    sample_idx [N] int64, reward [N] float64, reward_timed_out [N] bool
    meta: {"prompt_uids": [N str], "finish_reasons": [N str]}
    routed_experts [sum (P+T-1), L, k] uint8 (int32 when E > 256)   Mixture-of-Experts only

`routed_experts` (Trajectory.routed_experts, qurl/types.py) is the one optional tensor: present
when every trajectory of the message carries the engine's experts (a MoE), absent otherwise (a
dense model, and every message written before it existed: the schema is backward compatible).
Trajectory i's rows are the P_i + T_i - 1 positions its engine forwarded, so its offsets follow
from the prompt and response offsets; a message mixing trajectories with and without routes is
refused at packing.

Packing is lossless (reward stays float64, ids int64, logp float32 as produced); unpacking returns
views into the received buffers (no copy). Because response_ids, behav_logp, versions and
behav_entropy share one offsets tensor, their per-trajectory lengths agree by construction once
the totals agree. A trajectory whose engine gave no entropy (Trajectory.behav_entropy None) travels
as NaN entries and comes back as None: NaN there means "not reported", never a value.

Validation (`validate_packed`) is vectorised over the whole batch — a handful of reductions per
message, not a Python loop per token — and raises WireError("invalid", detail) naming the first bad
trajectory (prompt_uid, sample_idx) when: a token id is outside [0, vocab_size); a response is longer
than max_len or a prompt empty; behav_logp is not finite or > 0; a version is negative, newer than the
learner's current version, or decreases along a response (weights only move forward during a partial
rollout); a behav_entropy is negative or infinite; a reward is not finite; a finish_reason is
unknown; with `moe` = (L, k, E) given, routed_experts is not [sum (P+T-1), L, k] in its dtype or
holds an expert id >= E (and routed experts arriving at a receiver that expects a dense model
are refused). Structural problems (missing tensors, wrong dtypes/shapes, inconsistent offsets) raise
"bad_tensor" / "bad_header".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from qurl.pipeline.frames import WireError
from qurl.types import SamplingParams, Trajectory

FINISH_REASONS = ("stop", "length", "abort")
_TRAJ_TENSORS = {
    "prompt_ids": torch.int64, "prompt_offsets": torch.int64, "response_ids": torch.int64,
    "response_offsets": torch.int64, "behav_logp": torch.float32, "versions": torch.int64,
    "sample_idx": torch.int64, "reward": torch.float64, "reward_timed_out": torch.bool,
    "behav_entropy": torch.float32,
}
_PER_TOKEN = ("response_ids", "behav_logp", "versions", "behav_entropy")
ROUTES = "routed_experts"


def route_dtype(num_experts: int) -> torch.dtype:
    """The wire dtype of expert ids: uint8 while they fit (E <= 256), else int32."""
    return torch.uint8 if num_experts <= 256 else torch.int32


def _route_rows(p_len: torch.Tensor, r_len: torch.Tensor) -> torch.Tensor:
    """[N] rows of routed_experts per trajectory: the P + T - 1 positions its engine forwarded."""
    return (p_len + r_len - 1).clamp(min=0)


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out


def pack_trajectories(trajs: list[Trajectory]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Pack trajectories into (meta, tensors) for one "trajectory" message (layout above).
    Raises ValueError naming the trajectory if a field has the wrong dtype, rank or length."""
    p_ids, r_ids, logps, vers, ents, p_len, r_len = [], [], [], [], [], [], []
    routes: list[torch.Tensor] = []
    with_routes = {t.routed_experts is not None for t in trajs}
    if len(with_routes) > 1:
        raise ValueError("trajectories with and without routed_experts in one message")
    for i, t in enumerate(trajs):
        who = f"trajectory {i} ({t.prompt_uid!r}, sample {t.sample_idx})"
        for fname in ("prompt_ids", "response_ids", "behav_logp", "versions"):
            x = getattr(t, fname)
            if not isinstance(x, torch.Tensor) or x.dim() != 1:
                raise ValueError(f"{who}: {fname} must be a 1-D tensor")
        if t.behav_logp.dtype != torch.float32:
            raise ValueError(f"{who}: behav_logp dtype {t.behav_logp.dtype}, expected float32")
        for fname in ("prompt_ids", "response_ids", "versions"):
            x = getattr(t, fname)
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise ValueError(f"{who}: {fname} must hold integers, got {x.dtype}")
        n = t.response_ids.numel()
        ent = t.behav_entropy
        if ent is not None and (not isinstance(ent, torch.Tensor) or ent.dim() != 1
                                or not ent.dtype.is_floating_point):
            raise ValueError(f"{who}: behav_entropy must be a 1-D float tensor or None")
        m = n if ent is None else ent.numel()
        if t.behav_logp.numel() != n or t.versions.numel() != n or m != n:
            raise ValueError(f"{who}: response_ids/behav_logp/versions/behav_entropy lengths "
                             f"{n}/{t.behav_logp.numel()}/{t.versions.numel()}/{m} differ")
        p_ids.append(t.prompt_ids.to(torch.int64))
        r_ids.append(t.response_ids.to(torch.int64))
        logps.append(t.behav_logp)
        vers.append(t.versions.to(torch.int64))
        ents.append(torch.full((n,), math.nan) if ent is None else ent.to(torch.float32))
        p_len.append(t.prompt_ids.numel())
        r_len.append(n)
        if t.routed_experts is not None:
            re_ = t.routed_experts
            rows = max(t.prompt_ids.numel() + n - 1, 0)
            if not isinstance(re_, torch.Tensor) or re_.dim() != 3 or re_.shape[0] != rows:
                raise ValueError(f"{who}: routed_experts must be [P + T - 1 = {rows}, L, k], got "
                                 f"{tuple(getattr(re_, 'shape', ()))}")
            if re_.dtype not in (torch.uint8, torch.int32):
                raise ValueError(f"{who}: routed_experts dtype {re_.dtype}, expected uint8 "
                                 f"(int32 when E > 256)")
            if routes and (re_.shape[1:] != routes[0].shape[1:] or re_.dtype != routes[0].dtype):
                raise ValueError(f"{who}: routed_experts {tuple(re_.shape[1:])} {re_.dtype} vs "
                                 f"{tuple(routes[0].shape[1:])} {routes[0].dtype} of the others")
            routes.append(re_)
    meta = {"prompt_uids": [str(t.prompt_uid) for t in trajs],
            "finish_reasons": [str(t.finish_reason) for t in trajs]}
    tensors = {
        "prompt_ids": _cat(p_ids, torch.int64), "prompt_offsets": _offsets(p_len),
        "response_ids": _cat(r_ids, torch.int64), "response_offsets": _offsets(r_len),
        "behav_logp": _cat(logps, torch.float32), "versions": _cat(vers, torch.int64),
        "behav_entropy": _cat(ents, torch.float32),
        "sample_idx": torch.tensor([int(t.sample_idx) for t in trajs], dtype=torch.int64),
        "reward": torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64),
        "reward_timed_out": torch.tensor([bool(t.reward_timed_out) for t in trajs],
                                         dtype=torch.bool),
    }
    if routes:
        tensors[ROUTES] = torch.cat(routes)
    return meta, tensors


def _check_structure(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Shapes, dtypes and offsets of a packed batch; returns N."""
    uids, reasons = meta.get("prompt_uids"), meta.get("finish_reasons")
    if not isinstance(uids, list) or not all(isinstance(u, str) and u for u in uids):
        raise WireError("bad_header", "meta.prompt_uids must be a list of non-empty strings")
    if not isinstance(reasons, list) or len(reasons) != len(uids):
        raise WireError("bad_header", "meta.finish_reasons must be a list as long as prompt_uids")
    n = len(uids)
    for name, dtype in _TRAJ_TENSORS.items():
        t = tensors.get(name)
        if t is None or t.dtype != dtype or t.dim() != 1:
            raise WireError("bad_tensor", f"trajectory tensor {name!r} missing or not 1-D {dtype}")
    extra = set(tensors) - set(_TRAJ_TENSORS) - {ROUTES}
    if extra:
        raise WireError("bad_tensor", f"unexpected tensors {sorted(extra)}")
    for name in ("sample_idx", "reward", "reward_timed_out"):
        if tensors[name].numel() != n:
            raise WireError("bad_tensor", f"{name} has {tensors[name].numel()} entries, expected {n}")
    for off_name, data_names in (("prompt_offsets", ("prompt_ids",)),
                                 ("response_offsets", _PER_TOKEN)):
        off = tensors[off_name]
        if off.numel() != n + 1 or int(off[0]) != 0 or bool((off[1:] < off[:-1]).any()):
            raise WireError("bad_tensor", f"{off_name} must be [N+1] non-decreasing from 0")
        for d in data_names:
            if tensors[d].numel() != int(off[-1]):
                raise WireError("bad_tensor", f"{d} has {tensors[d].numel()} entries, "
                                              f"{off_name} ends at {int(off[-1])}")
    routes = tensors.get(ROUTES)
    if routes is not None:
        rows = int(_route_rows(tensors["prompt_offsets"].diff(),
                               tensors["response_offsets"].diff()).sum())
        if routes.dim() != 3 or routes.dtype not in (torch.uint8, torch.int32) \
                or routes.shape[0] != rows:
            raise WireError("bad_tensor", f"{ROUTES} must be [sum(P+T-1)={rows}, L, k] uint8 or "
                                          f"int32, got {tuple(routes.shape)} {routes.dtype}")
    return n


def _owner(meta: dict[str, Any], tensors: dict[str, torch.Tensor], row: int) -> str:
    return f"trajectory {row} ({meta['prompt_uids'][row]!r}, sample {int(tensors['sample_idx'][row])})"


def _token_owner(meta, tensors, off_name: str, bad: torch.Tensor) -> str:
    first = int(bad.nonzero()[0, 0])  # flat index of the first offending token
    row = int(torch.searchsorted(tensors[off_name], first, right=True)) - 1
    return _owner(meta, tensors, row)


def _fail_tokens(meta, tensors, off_name: str, bad: torch.Tensor, what: str) -> None:
    if bool(bad.any()):
        raise WireError("invalid", f"{_token_owner(meta, tensors, off_name, bad)}: {what}")


def _fail_rows(meta, tensors, bad: torch.Tensor, what: str) -> None:
    if bool(bad.any()):
        raise WireError("invalid", f"{_owner(meta, tensors, int(bad.nonzero()[0, 0]))}: {what}")


def _in_range(x: torch.Tensor, lo: float, hi: float, *, open_lo: bool = False) -> bool:
    """lo <= x <= hi (lo < x with open_lo) everywhere. One numpy min and max pass: numpy reductions
    are single-threaded and fast, where torch's OpenMP ones stall when cores are shared. NaN fails
    (comparisons with NaN are False). The per-token masks naming the culprit are only built on failure."""
    a = x.numpy()
    if a.size == 0:
        return True
    mn, mx = a.min(), a.max()
    return bool(mn > lo if open_lo else mn >= lo) and bool(mx <= hi)


def validate_packed(
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    vocab_size: int,
    current_version: int,
    max_len: int,
    max_prompt_len: int | None = None,
    moe: tuple[int, int, int] | None = None,
) -> None:
    """Check a packed trajectory batch (see module docstring). Raises WireError; returns None.
    moe: (L MoE layers, k experts per token, E experts) of the served model; None: dense."""
    _check_structure(meta, tensors)
    _check_routes(meta, tensors, moe)
    for ids_name, off_name in (("prompt_ids", "prompt_offsets"), ("response_ids", "response_offsets")):
        ids = tensors[ids_name]
        if not _in_range(ids, 0, vocab_size - 1):
            _fail_tokens(meta, tensors, off_name, (ids < 0) | (ids >= vocab_size),
                         f"{ids_name} token id outside [0, {vocab_size})")
    p_len = tensors["prompt_offsets"].diff()
    r_len = tensors["response_offsets"].diff()
    _fail_rows(meta, tensors, p_len == 0, "empty prompt")
    if max_prompt_len is not None:
        _fail_rows(meta, tensors, p_len > max_prompt_len, f"prompt longer than {max_prompt_len}")
    _fail_rows(meta, tensors, r_len > max_len, f"response longer than max_len={max_len}")
    lp = tensors["behav_logp"]
    if not _in_range(lp, -math.inf, 0.0, open_lo=True):
        _fail_tokens(meta, tensors, "response_offsets", ~torch.isfinite(lp), "behav_logp not finite")
        _fail_tokens(meta, tensors, "response_offsets", lp > 0, "behav_logp > 0")
    v = tensors["versions"]
    if not _in_range(v, 0, current_version):
        _fail_tokens(meta, tensors, "response_offsets", v < 0, "negative version")
        _fail_tokens(meta, tensors, "response_offsets", v > current_version,
                     f"version in the future (learner is at {current_version})")
    va = v.numpy()
    if va.size > 1 and va.min() != va.max():  # one version throughout cannot decrease
        # A decrease between token k and k+1 is only legal where a new response starts at k+1.
        drop = va[1:] < va[:-1]
        starts = tensors["response_offsets"].numpy()[1:-1]
        drop[starts[(starts > 0) & (starts < va.size)] - 1] = False
        if drop.any():
            bad = torch.cat([torch.zeros(1, dtype=torch.bool), torch.from_numpy(drop)])
            _fail_tokens(meta, tensors, "response_offsets", bad, "version decreases along response")
    h = tensors["behav_entropy"]
    if not _in_range(h[~h.isnan()], 0.0, torch.finfo(torch.float32).max):  # inf fails too
        _fail_tokens(meta, tensors, "response_offsets", h < 0, "behav_entropy < 0")
        _fail_tokens(meta, tensors, "response_offsets", h.isinf(), "behav_entropy infinite")
    _fail_rows(meta, tensors, ~torch.isfinite(tensors["reward"]), "reward not finite")
    _fail_rows(meta, tensors, tensors["sample_idx"] < 0, "negative sample_idx")
    for row, r in enumerate(meta["finish_reasons"]):
        if r not in FINISH_REASONS:
            raise WireError("invalid", f"{_owner(meta, tensors, row)}: finish_reason {r!r} "
                                       f"not in {FINISH_REASONS}")


def _check_routes(meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                  moe: tuple[int, int, int] | None) -> None:
    """routed_experts against the served model's (L, k, E) (structure already checked)."""
    routes = tensors.get(ROUTES)
    if routes is None:
        return
    if moe is None:
        raise WireError("invalid", f"{ROUTES} sent to a receiver that serves a dense model")
    L, k, E = moe
    if tuple(routes.shape[1:]) != (L, k) or routes.dtype != route_dtype(E):
        raise WireError("invalid", f"{ROUTES} {tuple(routes.shape[1:])} {routes.dtype}: the model "
                                   f"routes [L={L}, k={k}] experts, ids as {route_dtype(E)}")
    if routes.numel() and int(routes.max()) >= E:
        rows = _route_rows(tensors["prompt_offsets"].diff(), tensors["response_offsets"].diff())
        bad = (routes >= E).flatten(1).any(1)
        row = int(torch.searchsorted(rows.cumsum(0), int(bad.nonzero()[0, 0]), right=True))
        raise WireError("invalid", f"{_owner(meta, tensors, row)}: {ROUTES} expert id >= {E}")


def unpack_trajectories(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[Trajectory]:
    """Inverse of pack_trajectories; the returned tensors are views into `tensors` (no copy).
    Checks structure only — run validate_packed first for values."""
    n = _check_structure(meta, tensors)
    # split() makes all the views in one call: ~10x cheaper than a Python slice per field per row,
    # which otherwise dominates receiving a batch of hundreds of trajectories.
    p_len = tensors["prompt_offsets"].diff().tolist()
    r_len = tensors["response_offsets"].diff().tolist()
    prompts = tensors["prompt_ids"].split(p_len)
    resps, lps, vers, ents = (tensors[k].split(r_len) for k in _PER_TOKEN)
    routes: Any = [None] * n
    if ROUTES in tensors:
        rows = _route_rows(tensors["prompt_offsets"].diff(), tensors["response_offsets"].diff())
        routes = tensors[ROUTES].split(rows.tolist())
    sidx, rew = tensors["sample_idx"].tolist(), tensors["reward"].tolist()
    tout = tensors["reward_timed_out"].tolist()
    uids, reasons = meta["prompt_uids"], meta["finish_reasons"]
    return [
        Trajectory(prompt_uid=uids[i], sample_idx=sidx[i], prompt_ids=prompts[i],
                   response_ids=resps[i], behav_logp=lps[i], versions=vers[i], reward=rew[i],
                   finish_reason=reasons[i], reward_timed_out=tout[i],
                   behav_entropy=None if bool(ents[i].isnan().all()) else ents[i],
                   routed_experts=routes[i])
        for i in range(n)
    ]


def validate_trajectories(
    trajs: list[Trajectory],
    *,
    vocab_size: int,
    current_version: int,
    max_len: int,
    max_prompt_len: int | None = None,
    moe: tuple[int, int, int] | None = None,
) -> None:
    """validate_packed for a list of Trajectory records; malformed records raise WireError("invalid")."""
    try:
        meta, tensors = pack_trajectories(trajs)
    except ValueError as e:
        raise WireError("invalid", str(e)) from None
    validate_packed(meta, tensors, vocab_size=vocab_size, current_version=current_version,
                    max_len=max_len, max_prompt_len=max_prompt_len, moe=moe)


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PromptTask:
    """One dispatched prompt: generate `group_size` samples of prompt_ids ([P] int64) with `params`.
    `version` is the learner's policy version at dispatch (for staleness accounting)."""

    prompt_uid: str
    prompt_ids: torch.Tensor
    params: SamplingParams
    group_size: int
    version: int


def pack_prompt(task: PromptTask) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    p = task.params
    meta = {"prompt_uid": task.prompt_uid, "group_size": task.group_size, "version": task.version,
            "params": {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature,
                       "top_p": p.top_p, "seed": p.seed, "stop_token_ids": list(p.stop_token_ids)}}
    return meta, {"prompt_ids": task.prompt_ids.to(torch.int64)}


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def unpack_prompt(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> PromptTask:
    """Inverse of pack_prompt; raises WireError("bad_header"/"bad_tensor") on a malformed message."""
    ids = tensors.get("prompt_ids")
    if ids is None or ids.dtype != torch.int64 or ids.dim() != 1 or len(tensors) != 1:
        raise WireError("bad_tensor", "prompt message needs exactly one 1-D int64 'prompt_ids'")
    p = meta.get("params")
    ok = (isinstance(meta.get("prompt_uid"), str) and _int(meta.get("group_size"))
          and _int(meta.get("version")) and isinstance(p, dict)
          and _int(p.get("max_new_tokens")) and isinstance(p.get("temperature"), (int, float))
          and isinstance(p.get("top_p"), (int, float)) and (p.get("seed") is None or _int(p["seed"]))
          and isinstance(p.get("stop_token_ids"), list) and all(_int(s) for s in p["stop_token_ids"]))
    if not ok:
        raise WireError("bad_header", f"prompt meta malformed: {meta!r:.200}")
    params = SamplingParams(max_new_tokens=p["max_new_tokens"], temperature=float(p["temperature"]),
                            top_p=float(p["top_p"]), seed=p["seed"],
                            stop_token_ids=tuple(p["stop_token_ids"]))
    return PromptTask(prompt_uid=meta["prompt_uid"], prompt_ids=ids, params=params,
                      group_size=meta["group_size"], version=meta["version"])


def validate_prompt(task: PromptTask, *, vocab_size: int, max_len: int) -> None:
    """Values of a prompt: ids in vocab, 1 <= P <= max_len, sane sampling params. WireError("invalid")."""
    ids, p = task.prompt_ids, task.params
    problems = []
    if not task.prompt_uid:
        problems.append("empty prompt_uid")
    if not 1 <= ids.numel() <= max_len:
        problems.append(f"prompt length {ids.numel()} not in [1, {max_len}]")
    elif bool(((ids < 0) | (ids >= vocab_size)).any()):
        problems.append(f"prompt token id outside [0, {vocab_size})")
    if task.group_size < 1 or task.version < 0:
        problems.append(f"group_size={task.group_size} / version={task.version} must be >=1 / >=0")
    if p.max_new_tokens < 1 or not (math.isfinite(p.temperature) and p.temperature >= 0):
        problems.append(f"max_new_tokens={p.max_new_tokens}, temperature={p.temperature}")
    if not 0 < p.top_p <= 1 or any(not 0 <= s < vocab_size for s in p.stop_token_ids):
        problems.append(f"top_p={p.top_p} or stop_token_ids={p.stop_token_ids} out of range")
    if problems:
        raise WireError("invalid", f"prompt {task.prompt_uid!r}: " + "; ".join(problems))
