"""Server-side half of qurl's delta and verified syncs: runs INSIDE an SGLang server process.

A delta sync (qurl/sync/delta.py) sends only the changed positions of each tensor, under the HF
names (`<name>#dpos`, `#dend`, `#dval`); after every sync, delta or full, the engine must prove it
holds exactly the learner's bits (qurl/sync/digest.py). SGLang has no such operations, so qurl
adds them at the one place every weight update passes through: `model.load_weights`, which
`update_weights_from_distributed` calls with each received bucket (SGLang 0.5.23
`model_runner_components/weight_updater.py: load_weights_from_distributed`, which turns any
exception into the reply `{"success": false, "message": "Failed to update parameter online:
<error> ..."}` — the scheduler survives it; an exception in a custom loader called through
`update_weights_from_tensor` would kill the scheduler instead, so nothing there raises).

`prepare(model, [], restore)` — run through SGLang's custom-loader extension point at the start of
every qurl update session (qurl.engines.sglang_loader.prepare_sync) — undoes the W8A8 repacking
(`restore`, see sglang_loader.py: every parameter back in its [out, in] loading layout over the
same storage) and, once per process, wraps the model's `load_weights`. The wrapper takes from
each bucket:

- the control chunks (qurl/engines/sglang_layout.py): `qurl.sync.header` opens a qurl sync of
  version v. A delta's header names its base (v-1, combined digest): unless this process
  verified exactly that version, the sync is refused before anything is written (reply message
  `qurl-stale-base: ...`; the rest of that sync's buckets are refused too). Any load that is not
  part of a qurl sync marks the weights unverified;
- whole tensors: handed to SGLang's own `load_weights` (fusion, padding, TP slicing: a full
  sync's path);
- deltas: buffered until all three parts of a tensor arrived, validated (positions ascending and
  in range, value dtype = the held dtype), then written at their positions into the HF tensor's
  rows of the fused parameter (qurl/engines/sglang_layout.py: `hf_view`, a view of the
  parameter's storage): in place, every `data_ptr` kept (CUDA graphs captured at startup read
  those addresses). Server-side work is O(changes) per tensor;
- `qurl.sync.verify`: hashes every tensor it names, as the server holds it (its rows of the
  parameter, in the dtype it travelled in), exactly as the sender hashed its chunks; any
  difference raises `qurl-mismatch: [names]`, else the version becomes this process's verified
  base (the only thing a later delta may build on).

Limits: TP size 1 (a rank holds only its slice of each tensor; the adapter sends deltas and
verification only to TP-1 servers); hashing runs on the CPU (a GPU server copies each tensor to
the host to hash it: one device-to-host pass over the weights per sync).
This module imports only torch and qurl's torch-only sync modules (and blake3, qurl's
dependency), never sglang.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from qurl.engines.sglang_layout import (CONTROL, HEADER, MISMATCH_MARK, STALE_MARK, VERIFY,
                                        hf_view, read_json_chunk, sglang_name)
from qurl.sync.delta import apply_positions, check_delta, delta_owner, is_delta_name
from qurl.sync.digest import combine, tensor_digest

log = logging.getLogger(__name__)
TIED = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class _State:
    """What this server process knows about its weights (one per TP process)."""
    verified: tuple[int, str] | None = None  # (version, combined digest) last verified
    loaded: int | None = None  # version of the last qurl sync, if nothing else loaded since
    open: bool = False  # between a sync's header and its verification: its buckets follow
    refused: bool = False  # the current sync's header was refused: refuse its other buckets
    shapes: dict[str, list[int]] = field(default_factory=dict)  # HF shapes, from the header
    parts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # partial deltas
    error: str | None = None  # a failure in prepare, reported by the next load


STATE = _State()


def prepare(model: torch.nn.Module, named_tensors: list, restore: Callable) -> None:
    """Custom loader body: restore W8A8 layouts, install the wrapper. Never raises (a raise here
    kills SGLang's scheduler): a failure is kept and raised by the next load (an HTTP 400)."""
    try:
        if named_tensors:
            raise ValueError(f"the qurl prepare loader takes no tensors (got {len(named_tensors)})")
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError("qurl delta / verified syncs need a TP size 1 server")
        restore(model, [])
        _install(model)
    except Exception as e:  # noqa: BLE001 - reported through the next load
        STATE.error = f"qurl prepare failed: {type(e).__name__}: {e}"
        log.error(STATE.error)


def _install(model: torch.nn.Module) -> None:
    inner = model.load_weights
    if getattr(inner, "_qurl_sync", False):
        return

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kw: Any) -> Any:
        return load_bucket(model, inner, list(weights), *args, **kw)

    load_weights._qurl_sync = True  # type: ignore[attr-defined]
    model.load_weights = load_weights  # an instance attribute: SGLang calls model.load_weights


def load_bucket(model: torch.nn.Module, inner: Callable, weights: list[tuple[str, torch.Tensor]],
                *args: Any, **kw: Any) -> Any:
    """One received bucket (module docstring). Raises ValueError for a refusal or mismatch."""
    st = STATE
    if st.error is not None:
        err, st.error = st.error, None
        raise RuntimeError(err)
    control = {n: t for n, t in weights if n in CONTROL}
    rest = [(n, t) for n, t in weights if n not in CONTROL]
    if HEADER in control:
        _open(read_json_chunk(control[HEADER]))
    elif rest and st.refused:
        raise ValueError(f"{STALE_MARK} a bucket of a refused delta sync")
    elif rest and not st.open:  # someone else's update: nothing is vouched for now
        st.verified = st.loaded = None
        if any(is_delta_name(n) for n, _ in rest):
            raise ValueError(f"{STALE_MARK} delta chunks outside a qurl sync")
    out = None
    whole = [(n, t) for n, t in rest if not is_delta_name(n)]
    if whole:
        out = inner(whole, *args, **kw)
    for name, t in rest:
        if is_delta_name(name):
            st.parts.setdefault(delta_owner(name), {})[name[-3:]] = t
    ready = {n: p for n, p in st.parts.items() if len(p) == 3}
    checked = []
    for name, parts in ready.items():  # validate every complete delta before writing any
        targets = targets_of(model, name, st.shapes.get(name))
        pos, val = check_delta(name, targets[0], parts)
        checked.append((targets, pos, val))
        del st.parts[name]
    for targets, pos, val in checked:
        for t in targets:
            apply_positions(t, pos, val)
    if VERIFY in control:
        verify(model, read_json_chunk(control[VERIFY]))
    return out


def _open(header: dict) -> None:
    st = STATE
    st.parts.clear()
    st.shapes = {str(k): list(v) for k, v in (header.get("shapes") or {}).items()}
    base = header.get("base")
    if base is not None and st.verified != (int(base[0]), str(base[1])):
        st.loaded, st.open, st.refused = None, False, True
        held = "nothing verified" if st.verified is None else \
            f"v{st.verified[0]} ({st.verified[1]})"
        raise ValueError(f"{STALE_MARK} this server holds {held}; the delta of "
                         f"v{header.get('version')} needs v{base[0]} ({base[1]})")
    st.loaded, st.open, st.refused, st.verified = int(header["version"]), True, False, None


def targets_of(model: torch.nn.Module, hf_name: str, hf_shape: list[int] | None
               ) -> list[torch.Tensor]:
    """Views of every parameter region that holds the HF tensor (the embedding also in a tied
    lm_head with storage of its own); ValueError when the server has no place for it."""
    if hf_shape is None:
        raise ValueError(f"{hf_name}: no shape in the sync's header")
    params = dict(model.named_parameters())
    pname, part = sglang_name(hf_name)
    if pname not in params:
        raise ValueError(f"{hf_name}: this server has no parameter {pname}")
    sizes = None
    if part is not None:
        layer = model.get_submodule(pname.rsplit(".", 1)[0])
        sizes = list(getattr(layer, "output_partition_sizes", None) or [])
    views = [hf_view(params[pname].data, part, sizes, hf_shape)]
    if hf_name == TIED[0] and TIED[1] in params and \
            params[TIED[1]].data_ptr() != params[TIED[0]].data_ptr() and \
            getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        views.append(hf_view(params[TIED[1]].data, None, None, hf_shape))
    return views


def held_digests(model: torch.nn.Module, spec: dict[str, list]) -> dict[str, str]:
    """{HF name: digest of what the server holds for it}, spec {name: [_, shape, dtype]};
    a tensor the server cannot find gets the digest "missing"."""
    out = {}
    for name, (_, shape, dtype) in spec.items():
        try:
            view = targets_of(model, name, shape)[0]
        except ValueError:
            out[name] = "missing"
            continue
        want = getattr(torch, dtype)
        out[name] = tensor_digest(view if view.dtype == want else view.to(want))
    return out


def verify(model: torch.nn.Module, msg: dict) -> None:
    """Compare the held tensors with the sender's digests; on success this version becomes the
    verified base, else ValueError `qurl-mismatch: [names]` and nothing is verified."""
    st = STATE
    spec = {str(k): v for k, v in msg["digests"].items()}
    got = held_digests(model, spec)
    bad = sorted(n for n in spec if got[n] != spec[n][0])
    version = int(msg["version"])
    st.open = False
    if st.loaded != version and not bad:
        bad = ["<version>"]  # loaded by something else than qurl's sync of this version
    if bad:
        st.verified = None
        raise ValueError(f"{MISMATCH_MARK}{json.dumps(bad)} (v{version}: {len(bad)} of "
                         f"{len(spec)} tensors differ from the learner's)")
    st.verified = (version, combine({n: v[0] for n, v in spec.items()}))
