"""What qurl relies on of SGLang's HTTP protocol, and the replies it checks.

Every fact about the SGLang server that qurl's engine depends on is written down here, so that one
file says what to re-check when the pinned SGLang release changes; qurl never imports sglang.
The rest of this package speaks the protocol: the server process (launcher.py), the weight-update
session (update.py) and the engine that drives them (engine.py).

Facts used here, read from the source of sglang 0.5.23 (`srt/entrypoints/http_server.py`,
`srt/managers/io_struct.py`, `srt/managers/tokenizer_manager.py`, `srt/managers/
scheduler_components/weight_updater.py`, `srt/model_executor/model_runner_components/
weight_updater.py`); recheck them when the pinned release changes:

- Launch: `python -m sglang.launch_server --model-path P --tp-size T --quantization Q --host H
  --port N --weight-version V` (`--tp` is not a flag; `--tensor-parallel-size` is an alias).
  `GET /health` answers 503 while starting, 200 when up (body empty).
- `POST /generate` with `{"rid", "input_ids": [int], "sampling_params": {"max_new_tokens",
  "temperature", "top_p", "sampling_seed", "stop_token_ids"}, "return_logprob": true}` answers
  `{"text", "output_ids", "meta_info"}`; `meta_info` has `finish_reason` ({"type": "stop" |
  "length" | "abort", ...}), `output_token_logprobs` ([logprob, token_id, text|None] per generated
  token; logprob of softmax(logits / temperature), before top-p), `completion_tokens`,
  `weight_version` (str) and, on finished requests, `weight_versions` spans
  [{"version", "start", "end"}] when the weights changed under a running request. `output_ids`
  run through the stop token (not trimmed). With `"top_logprobs_num": k` in the body,
  `meta_info.output_top_logprobs` holds, per generated token, its k most likely tokens as
  [logprob, token_id, text|None], most likely first, read from the same tempered log-probs
  (`srt/layers/sampler.py` computes them after `/ temperatures`; `tokenizer_manager.py`
  `detokenize_top_logprobs_tokens`).
- `POST /pause_generation {"mode": "abort"}` aborts every running request — each returns
  normally with finish_reason type "abort" and the tokens generated so far — and holds new ones
  until `POST /continue_generation {}`.
- A weight update must sit inside `POST /begin_weight_update {}` ... `POST /end_weight_update
  {}` (the session restores weights quantized methods repacked after loading, e.g. the transposed
  int8 weight of `w8a8_int8`); outside it `update_weights_from_distributed` fails. Older
  releases lack these routes (404), and then the calls are skipped.
- `POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
  "group_name", "backend"}` makes each TP rank join as rank `rank_offset + tp_rank`; the call
  returns only after the group has formed, so the learner must join concurrently.
- `POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
  "flush_cache", "abort_all_requests", "weight_version", "load_format"}` returns only after the
  broadcast(s) it describes have been received and loaded (so the learner broadcasts while the
  call is in flight). `load_format="flattened_bucket"` = one uint8 broadcast per call (qurl's
  bucket layout), `null` = one broadcast per tensor. `flush_cache: true` fails while requests run.
- Replies of control routes are `{"success": bool, "message": str}` with 200 or 400;
  `/flush_cache` answers plain text with 200 or 400; `/pause_generation` and
  `/continue_generation` answer `{"message", "status": "ok"}`.
- 8-bit formats (see qurl/models/export8bit.py): `w8a8_int8` (int8 `weight` + fp32
  `weight_scale` [out, 1]), `w8a8_fp8` (per-channel FP8, same names), `fp8` with
  `weight_block_size` [128, 128] (FP8 `weight` + fp32 `weight_scale_inv`). SGLang's `fp8` method
  without blocks is per-TENSOR, so per-channel FP8 is `w8a8_fp8`. Weight names are HF names;
  SGLang's loader fuses q/k/v and gate/up itself. Unknown names are ignored by SGLang, silently.
- Routes of a mixture of experts: a server started with `--enable-return-routed-experts` answers a
  /generate body with `"return_routed_experts": true` (`srt/managers/io_struct.py:264`) with
  `meta_info.routed_experts`, base64 of int32 [rows, L, k] (`srt/managers/detokenizer_manager.py`
  `_b64_encode_per_request`, `tokenizer_manager.py:2602-2609`): the k experts each of the L MoE
  layers chose, in top-k order, at positions [start, seqlen - 1), seqlen = input + output tokens,
  start = the body's `routed_experts_start_len` (default 0, at most the input's length,
  `io_struct.py:265-268`, `srt/managers/scheduler.py:3300-3318`; `srt/state_capturer/base.py`
  `get_topk`). They are read from a host buffer indexed by KV slot, written when the position
  was forwarded. They are collected when a request finishes (`scheduler_components/
  batch_result_processor.py:136-160`), an aborted running request included (it runs one more
  decode step, `scheduler.py:5797-5812`); a request aborted while queued, or any request on a
  server started without the flag (`state_capturer/routed_experts.py:50`), gets none, silently.
- `GET /server_info` (`srt/entrypoints/http_server.py` `server_info`, `srt/utils/common.py`
  `build_server_info`) answers the resolved server args (`tp_size`, `dp_size`, `quantization`,
  `custom_weight_loader`, `max_running_requests`: the flag as given, null when unset), the
  scheduler's handshake (`srt/managers/scheduler.py` `get_init_info`: `max_total_num_tokens`, the
  KV pool in tokens, and `max_req_input_len`) and `internal_states`, one dict per DP rank
  (`srt/managers/scheduler_components/internal_state.py` `_add_topology`:
  `effective_max_running_requests_per_dp`, the scheduler's own cap after it sized the KV pool).
  `/get_server_info` is the deprecated alias. Requests beyond the cap wait in the server's queue.
- `GET /health_generate` (and `/health`, the same handler: `health_generate`) answers 200 once
  the tokenizer manager got ANY output from the scheduler after the probe began, running a
  one-token request of its own, else 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s); `/model_info`
  is answered without the scheduler. A stuck scheduler is seen by the first, never by the second
  (watchdog.py cites the lines).
"""
from __future__ import annotations

import base64
import binascii
import math
import pickle
from typing import Any

import numpy as np
import torch

# precision (+ fp8 scaling) -> (SGLang --quantization, qurl sync format)
QUANTIZATION = {"int8": ("w8a8_int8", "int8"), "fp8": ("w8a8_fp8", "fp8"),
                "fp8_block": ("fp8", "fp8_block"), "bf16": (None, "bf16")}
# --quantization methods that repack weights after loading without a restore (inside/loader.py)
RESTORE_QUANTIZATIONS = ("w8a8_int8", "w8a8_fp8")
# the server flag without which /generate returns no routes (see "Routes" above)
ROUTES_FLAG = "--enable-return-routed-experts"
# an empty named-tensor list, as SGLang's MultiprocessingSerializer reads it (pickle, base64)
NO_TENSORS = base64.b64encode(pickle.dumps([])).decode()


class SGLangError(RuntimeError):
    """A server answered wrongly (or not at all); the message names the server and route."""


class SGLangUnavailable(SGLangError):
    """The server did not answer (refused, reset, timed out): it may need a restart."""



def running_limit(info: Any) -> int | None:
    """How many requests a server runs at once, from its /server_info reply: the sum over its DP
    ranks of `internal_states[i].effective_max_running_requests_per_dp`, else the
    `max_running_requests` flag it was started with; None when it reports neither (older
    releases, or a reply that is not SGLang's)."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        caps = [st.get("effective_max_running_requests_per_dp") for st in states
                if isinstance(st, dict)]
        if caps and all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in caps):
            return sum(caps)
    flag = info.get("max_running_requests")
    if isinstance(flag, int) and not isinstance(flag, bool) and flag > 0:
        return flag
    return None


def parse_generate(reply: Any, where: str) -> tuple[list[int], list[float], list[int], str]:
    """(token ids, logprobs, versions per token, finish type) from a /generate reply."""
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise SGLangError(f"{where}: reply has no 'meta_info' object: {str(reply)[:200]}")
    meta, ids = reply["meta_info"], reply.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SGLangError(f"{where}: 'output_ids' must be a list of ints, got {str(ids)[:100]}")
    lps = meta.get("output_token_logprobs")
    if not isinstance(lps, list) or len(lps) != len(ids):
        raise SGLangError(f"{where}: meta_info.output_token_logprobs has "
                          f"{len(lps) if isinstance(lps, list) else lps!r} entries for "
                          f"{len(ids)} output_ids (was return_logprob set?)")
    logprobs = []
    for k, (entry, tok) in enumerate(zip(lps, ids)):
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != tok \
                or not isinstance(entry[0], (int, float)) or not math.isfinite(entry[0]):
            raise SGLangError(f"{where}: output_token_logprobs[{k}] = {entry!r} is not "
                              f"[finite logprob, {tok}, text]")
        logprobs.append(float(entry[0]))
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise SGLangError(f"{where}: meta_info.finish_reason = {finish!r}")

    def as_int(v: Any) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            raise SGLangError(f"{where}: weight version {v!r} is not an integer (qurl sets "
                              "versions; was the server started with --weight-version?)") from None

    versions = [as_int(meta.get("weight_version"))] * len(ids)
    for span in meta.get("weight_versions") or []:
        if not isinstance(span, dict) or not {"version", "start", "end"} <= span.keys():
            raise SGLangError(f"{where}: bad weight_versions span {span!r}")
        for k in range(max(0, span["start"]), min(len(ids), span["end"])):
            versions[k] = as_int(span["version"])
    return ids, logprobs, versions, finish["type"]


def topk_entropy(reply: dict, where: str) -> list[float]:
    """Per generated token of a /generate reply asked with top_logprobs_num = k, a lower bound on
    the entropy of the distribution it was drawn from: the top k's own terms, -p log p each, plus
    the rest of the mass r = 1 - sum p taken as one token (-r log r). Any split of r over more
    tokens has more entropy (each of its p_j <= r, so -p_j log p_j >= -p_j log r). Exact when the
    top k hold all the mass; off by at most r log(V - k) otherwise."""
    tops, ids = reply["meta_info"].get("output_top_logprobs"), reply.get("output_ids") or []
    if not isinstance(tops, list) or len(tops) != len(ids):
        raise SGLangError(f"{where}: meta_info.output_top_logprobs has "
                          f"{len(tops) if isinstance(tops, list) else tops!r} entries for "
                          f"{len(ids)} output_ids (was top_logprobs_num set?)")
    out = []
    for k, top in enumerate(tops):
        if not isinstance(top, list) or not top or not all(
                isinstance(e, list) and len(e) >= 2 and isinstance(e[0], (int, float))
                and not math.isnan(e[0]) and e[0] <= 0 for e in top):
            raise SGLangError(f"{where}: output_top_logprobs[{k}] = {str(top)[:200]} is not a "
                              "list of [logprob <= 0, token_id, text]")
        ps = [(math.exp(e[0]), float(e[0])) for e in top]
        rest = max(0.0, 1.0 - sum(p for p, _ in ps))
        out.append(sum(-p * lp for p, lp in ps if p > 0) - (rest * math.log(rest) if rest > 0 else 0.0))
    return out


def parse_routes(reply: dict, where: str, *, n_input: int, start: int,
                 shape: tuple[int, int, int]) -> torch.Tensor | None:
    """The routes of a /generate reply to n_input input ids asked with `return_routed_experts` and
    `routed_experts_start_len` = start: [n_input + output - 1 - start, L, k] expert ids, uint8 when
    the model has E <= 256 experts, else int32 (qurl/pipeline/payload.py). shape = (L, k, E).
    None when the reply carries none (a request aborted before its first forward); a reply of the
    wrong size or with ids outside [0, E) is an SGLangError."""
    layers, k, experts = shape
    raw = reply["meta_info"].get("routed_experts")
    if raw is None:
        return None
    n_out = len(reply.get("output_ids") or [])
    try:
        flat = np.frombuffer(base64.b64decode(raw, validate=True), dtype="<i4")
    except (TypeError, ValueError, binascii.Error):
        raise SGLangError(f"{where}: meta_info.routed_experts is not base64 of int32: "
                          f"{str(raw)[:80]!r}") from None
    rows = n_input + n_out - 1 - start
    if rows < 0 or flat.size != rows * layers * k:
        raise SGLangError(f"{where}: meta_info.routed_experts has {flat.size} ids, expected "
                          f"[{n_input} + {n_out} - 1 - {start}, {layers}, {k}] (input + output - 1 "
                          "positions from routed_experts_start_len)")
    if flat.size and (flat.min() < 0 or flat.max() >= experts):
        raise SGLangError(f"{where}: meta_info.routed_experts holds expert ids in "
                          f"[{flat.min()}, {flat.max()}], outside [0, {experts})")
    out = torch.from_numpy(flat.astype(np.uint8 if experts <= 256 else np.int32))
    return out.reshape(rows, layers, k)
