"""Server-side half of qurl's delta and verified syncs: runs INSIDE an SGLang server process.

A delta sync (qurl/weights/delta.py) sends only the changed positions of each tensor, under the HF
names (`<name>#dpos`, `#dend`, `#dval`); after every sync, delta or full, the engine must prove it
holds exactly the learner's bits (qurl/weights/digest.py). SGLang has no such operations, so qurl
adds them at the one place every weight update passes through: `model.load_weights`, which
`update_weights_from_distributed` calls with each received bucket (SGLang 0.5.23
`model_runner_components/weight_updater.py: load_weights_from_distributed`, which turns any
exception into the reply `{"success": false, "message": "Failed to update parameter online:
<error> ..."}` — the scheduler survives it; an exception in a custom loader called through
`update_weights_from_tensor` would kill the scheduler instead, so nothing there raises).

`prepare(model, [], restore)` — run through SGLang's custom-loader extension point at the start of
every qurl update session (qurl.engines.sglang.inside.loader.prepare_sync) — undoes the W8A8 repacking
(`restore`, see loader.py: every parameter back in its [out, in] loading layout over the
same storage) and, once per process, wraps the model's `load_weights`. The wrapper takes from
each bucket:

- the control chunks (layout.py): `qurl.sync.header` opens a qurl sync of
  version v. A delta's header names its base (v-1, combined digest): unless this process
  verified exactly that version, the sync is refused before anything is written (reply message
  `qurl-stale-base: ...`; the rest of that sync's buckets are refused too). Any load that is not
  part of a qurl sync marks the weights unverified;
- whole tensors: handed to SGLang's own `load_weights` (fusion, padding, TP slicing: a full
  sync's path);
- deltas: buffered until all three parts of a tensor arrived, validated (positions ascending and
  in range, value dtype = the held dtype), then written at their positions into the HF tensor's
  rows of the fused parameter (layout.py: `hf_view`, a view of the
  parameter's storage): in place, every `data_ptr` kept (CUDA graphs captured at startup read
  those addresses). Server-side work is O(changes) per tensor;
- `qurl.sync.verify`: hashes every tensor it names, as the server holds it (its rows of the
  parameter, in the dtype it travelled in), exactly as the sender hashed its chunks; any
  difference raises `qurl-mismatch: [names]`, else the version becomes this process's verified
  base (the only thing a later delta may build on);
- `qurl.sync.kernels`: the same hashes over the tensors the kernels read after SGLang's repack
  (`check_kernels`), in a session opened by `prepare_read_back`: the post-repack read-back whose
  layout rules are kernels.py.

Tensor parallelism (TP size T > 1): every rank runs this code on every bucket. Rank r holds only
its box of each HF tensor (tp_cut.py, SGLang's own cutting rules): a delta's
positions are validated against the whole HF tensor, then only those inside the rank's box are
written, re-indexed to the box; verification hashes the rank's box and compares it with the
digest the learner computed for that rank (`qurl.sync.verify` carries {T: {name: [digest per
rank]}}). Only TP rank 0 answers SGLang's HTTP call, so at the end of every bucket the ranks
exchange their outcomes (`all_gather_object` on SGLang's TP CPU group, one small message per
bucket); a refusal, mismatch or error on any rank fails the call on every rank, with the union
of the names that differ, and no rank keeps a verified base.

Limits: hashing runs on the CPU (a GPU server copies each tensor to the host to hash it: one
device-to-host pass over the weights per sync); TP only (no pipeline or data parallelism inside
a server).
This module imports only torch and qurl's torch-only sync modules (and blake3, qurl's
dependency); sglang only for its TP group, inside a TP > 1 server.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from qurl.engines.sglang.inside.experts import is_fused_expert_tensor, load_fused_experts
from qurl.engines.sglang.inside.readback import (KERNEL_MARK, clear_skips, kernel_params,
                                                skip_next_repack)
from qurl.engines.sglang.inside.layout import (CONTROL, HEADER, KERNELS, MISMATCH_MARK, STALE_MARK,
                                               VERIFY, hf_view, read_json_chunk, sglang_name)
from qurl.engines.sglang.inside.tp_cut import (Box, Layout, local_positions, shard_box, slice_shape,
                                               whole)
from qurl.weights.delta import apply_positions, check_delta, delta_owner, is_delta_name
from qurl.weights.digest import combine, digest_target, tensor_digest

log = logging.getLogger(__name__)
TIED = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class _State:
    """What this server process (one TP rank) knows about its weights."""
    verified: tuple[int, str] | None = None  # (version, combined digest) last verified
    loaded: int | None = None  # version of the last qurl sync, if nothing else loaded since
    open: bool = False  # between a sync's header and its verification: its buckets follow
    refused: bool = False  # the current sync's header was refused: refuse its other buckets
    shapes: dict[str, list[int]] = field(default_factory=dict)  # HF shapes, from the header
    parts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # partial deltas
    error: str | None = None  # a failure in prepare, reported by the next load
    rank: int = 0  # TP rank of this process, of `tp`
    tp: int = 1
    layout: Layout | None = None  # head counts (from the model's config), for TP > 1 cuts
    gather: Callable[[Any], list] | None = None  # all_gather_object over the TP ranks


STATE = _State()


class Mismatch(ValueError):
    """Verification failed: `names` differ from the learner's."""

    def __init__(self, names: list[str], version: int, total: int) -> None:
        self.names = names
        super().__init__(f"{MISMATCH_MARK}{json.dumps(names)} (v{version}: {len(names)} of "
                         f"{total} tensors differ from the learner's)")


def prepare(model: torch.nn.Module, named_tensors: list, restore: Callable) -> None:
    """Custom loader body: restore W8A8 layouts, learn this rank's place, install the wrapper.
    Never raises (a raise here kills SGLang's scheduler): a failure is kept and raised by the
    next load (an HTTP 400)."""
    try:
        if named_tensors:
            raise ValueError(f"the qurl prepare loader takes no tensors (got {len(named_tensors)})")
        clear_skips(model)  # a read-back session that never ended must not skip this repack
        _bind_ranks(model)
        restore(model, [])
        _install(model)
    except Exception as e:  # noqa: BLE001 - reported through the next load
        STATE.error = f"qurl prepare failed: {type(e).__name__}: {e}"
        log.error(STATE.error)


def prepare_read_back(model: torch.nn.Module, named_tensors: list) -> None:
    """Custom loader body opening a read-back session (readback.py,
    step 2): learn this rank's place, install the wrapper, skip the closing repack once. Never
    raises: a failure is kept and fails the next bucket."""
    try:
        if named_tensors:
            raise ValueError(f"the qurl kernel read-back takes no tensors (got {len(named_tensors)})")
        _bind_ranks(model)
        _install(model)
        skip_next_repack(model)
    except Exception as e:  # noqa: BLE001 - reported through the next load
        STATE.error = f"qurl kernel read-back failed: {type(e).__name__}: {e}"
        log.error(STATE.error)


def _bind_ranks(model: torch.nn.Module) -> None:
    st = STATE
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        st.rank, st.tp, st.gather = 0, 1, None
        return
    from qurl.engines.sglang.inside.tp_group import (
        tp_group,  # imports sglang: inside the server only
    )

    g = tp_group()
    if g.world_size != dist.get_world_size():
        raise ValueError(f"qurl delta / verified syncs need plain TP (world {dist.get_world_size()}"
                         f", TP {g.world_size})")
    st.rank, st.tp, st.gather = int(g.rank_in_group), int(g.world_size), g.all_gather_object
    cfg = model.config
    st.layout = Layout.of_config(cfg)
    padded = [k for k, now in (("original_num_attention_heads", "num_attention_heads"),
                               ("original_total_num_kv_heads", "num_key_value_heads"),
                               ("original_intermediate_size", "intermediate_size"))
              if getattr(cfg, k, None) not in (None, getattr(cfg, now, None))]
    if padded:  # SGLang's CPU path padded the cut (tp_cut.py): no layout
        log.warning("qurl: SGLang padded %s at TP %d: no delta / verified syncs", padded, st.tp)
        st.layout = None


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
    """One received bucket (module docstring), on every TP rank; the ranks' outcomes are
    exchanged so that any rank's refusal / mismatch / error fails the call on all of them."""
    st = STATE
    try:
        out, fail = _load_bucket(model, inner, weights, *args, **kw), None
    except Exception as e:  # noqa: BLE001 - re-raised below, merged over the ranks
        out, fail = None, e
    if st.tp > 1 and st.gather is not None:
        fails = st.gather(_outcome(fail))
        if any(f is not None for f in fails):
            raise _merged(fails)
    elif fail is not None:
        raise fail
    return out


def _outcome(e: BaseException | None) -> tuple[str, Any] | None:
    if e is None:
        return None
    if isinstance(e, Mismatch):
        return "mismatch", e.names
    kind = "stale" if STALE_MARK in str(e) else "error"
    return kind, f"{type(e).__name__}: {e}"


def _merged(fails: list) -> Exception:
    """Every rank's state forgets what it vouched for; one error for all ranks."""
    st = STATE
    stale = any(f is not None and f[0] == "stale" for f in fails)
    st.verified = st.loaded = None
    st.open, st.refused = False, stale
    per_rank = "; ".join(f"rank {r}: {f[1]}" for r, f in enumerate(fails) if f is not None)
    if stale:
        return ValueError(f"{STALE_MARK} {per_rank}")
    names = sorted({n for f in fails if f is not None and f[0] == "mismatch" for n in f[1]})
    if names and all(f is None or f[0] == "mismatch" for f in fails):
        return ValueError(f"{MISMATCH_MARK}{json.dumps(names)} ({per_rank})")
    return RuntimeError(f"qurl sync failed on TP ranks: {per_rank}")


def _load_bucket(model: torch.nn.Module, inner: Callable,
                 weights: list[tuple[str, torch.Tensor]], *args: Any, **kw: Any) -> Any:
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
    experts = [(n, t) for n, t in whole if is_fused_expert_tensor(n)]
    whole = [(n, t) for n, t in whole if not is_fused_expert_tensor(n)]
    load_fused_experts(model, experts)  # in place: SGLang cannot load fused names (experts.py)
    if whole:
        out = inner(whole, *args, **kw)
    for name, t in rest:
        if is_delta_name(name):
            st.parts.setdefault(delta_owner(name), {})[name[-3:]] = t
    ready = {n: p for n, p in st.parts.items() if len(p) == 3}
    checked = []
    for name, parts in ready.items():  # validate every complete delta before writing any
        shape = st.shapes.get(name)
        targets, box = targets_of(model, name, shape)
        # positions are checked against the whole HF tensor, then cut to this rank's box
        hf = torch.empty(shape, dtype=targets[0].dtype, device="meta")
        pos, val = check_delta(name, hf, parts)
        checked.append((targets, *local_positions(pos, val, shape, box)))
        del st.parts[name]
    for targets, pos, val in checked:
        for t in targets:
            apply_positions(t, pos, val)
    if VERIFY in control:
        verify(model, read_json_chunk(control[VERIFY]))
    if KERNELS in control:  # the post-repack read-back (readback.py)
        check_kernels(model, read_json_chunk(control[KERNELS]))
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


def targets_of(model: torch.nn.Module, hf_name: str, hf_shape: list[int] | None,
               params: dict[str, torch.Tensor] | None = None) -> tuple[list[torch.Tensor], Box]:
    """(views of every parameter region that holds this rank's box of the HF tensor — the
    embedding also in a tied lm_head with storage of its own —, the box); ValueError when the
    server has no place for it. params: {name: tensor in the loading orientation} to read
    instead of the model's parameters (the kernels' tensors: readback.py)."""
    st = STATE
    if hf_shape is None:
        raise ValueError(f"{hf_name}: no shape in the sync's header")
    fused, expert = digest_target(hf_name)
    if expert is not None:  # one expert's slice of a fused expert tensor (experts.py)
        return _expert_target(model, fused, expert, hf_shape, params), whole(hf_shape)
    box = shard_box(hf_name, hf_shape, st.rank, st.tp, st.layout)
    shape = slice_shape(hf_shape, box)
    params = params if params is not None else {n: p.data for n, p in model.named_parameters()}
    pname, part = sglang_name(hf_name)
    if pname not in params:
        raise ValueError(f"{hf_name}: this server has no parameter {pname}")
    sizes = None
    layer = model.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else model
    if part is not None:
        sizes = list(getattr(layer, "output_partition_sizes", None) or [])
    idx = getattr(layer, "shard_indices", None)  # a vocabulary layer: SGLang's own cut
    if idx is not None and box.rows != (idx.org_vocab_start_index,
                                        idx.org_vocab_end_index - idx.org_vocab_start_index):
        raise ValueError(f"{hf_name}: qurl's vocabulary rows {box.rows} on TP rank {st.rank} are "
                         f"not the layer's [{idx.org_vocab_start_index}, "
                         f"{idx.org_vocab_end_index})")
    views = [hf_view(params[pname], part, sizes, shape)]
    if hf_name == TIED[0] and TIED[1] in params and \
            params[TIED[1]].data_ptr() != params[TIED[0]].data_ptr() and \
            getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        views.append(hf_view(params[TIED[1]], None, None, shape))
    return views, box


def _expert_target(model: torch.nn.Module, name: str, expert: int, shape: list[int],
                   params: dict[str, torch.Tensor] | None) -> list[torch.Tensor]:
    """[the view of expert `expert` in fused parameter `name`] (TP 1 only: a TP > 1 rank holds
    a cut of each expert that this map does not know)."""
    if STATE.tp > 1:
        raise ValueError(f"{name}@expert{expert}: per-expert verification at TP > 1 is not built")
    params = params if params is not None else {n: p.data for n, p in model.named_parameters()}
    if name not in params or not 0 <= expert < params[name].shape[0]:
        raise ValueError(f"{name}@expert{expert}: this server holds no such expert")
    return [hf_view(params[name][expert], None, None, shape)]


def held_digests(model: torch.nn.Module, spec: dict[str, list],
                 params: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """{HF name: digest of this rank's box of it, as held}, spec {name: [_, shape, dtype]};
    a tensor the server cannot find gets the digest "missing". Every region that holds it is
    hashed (the embedding's tied lm_head with storage of its own too): regions that disagree
    give "views-differ", so a stale second copy cannot hide behind a correct first one."""
    out = {}
    for name, (_, shape, dtype) in spec.items():
        try:
            views = targets_of(model, name, shape, params)[0]
        except ValueError:
            out[name] = "missing"
            continue
        want = getattr(torch, dtype)
        digests = {tensor_digest(v if v.dtype == want else v.to(want)) for v in views}
        out[name] = digests.pop() if len(digests) == 1 else "views-differ"
    return out


def expected_digests(msg: dict, rank: int, tp: int) -> dict[str, str | None]:
    """What this rank must hold: the whole-tensor digests at TP 1, else the learner's digest of
    this rank's box ({T: {name: [per rank]}} under "tp"; None where the learner sent none)."""
    spec = msg["digests"]
    if tp == 1:
        return {str(n): v[0] for n, v in spec.items()}
    mine = (msg.get("tp") or {}).get(str(tp)) or {}
    return {str(n): (mine[n][rank] if n in mine and len(mine[n]) == tp else None) for n in spec}


def verify(model: torch.nn.Module, msg: dict) -> None:
    """Compare the held tensors with the sender's digests; on success this version becomes the
    verified base, else Mismatch `qurl-mismatch: [names]` and nothing is verified."""
    st = STATE
    spec = {str(k): v for k, v in msg["digests"].items()}
    want = expected_digests(msg, st.rank, st.tp)
    got = held_digests(model, spec)
    bad = sorted(n for n in spec if want[n] is None or got[n] != want[n])
    version = int(msg["version"])
    st.open = False
    if st.loaded != version and not bad:
        bad = ["<version>"]  # loaded by something else than qurl's sync of this version
    if bad:
        st.verified = None
        raise Mismatch(bad, version, len(spec))
    st.verified = (version, combine({n: v[0] for n, v in spec.items()}))


def check_kernels(model: torch.nn.Module, msg: dict) -> None:
    """Compare the kernels' tensors with the sender's digests (kernels.py's docstring, step 3);
    Mismatch naming `<name> (kernel layout)` for each that differs, and nothing stays verified."""
    st = STATE
    spec = {str(k): v for k, v in msg["digests"].items()}
    want = expected_digests(msg, st.rank, st.tp)
    params, unknown = kernel_params(model)
    got = held_digests(model, spec, params=params)
    bad = []
    for name in sorted(spec):
        pname = sglang_name(digest_target(name)[0])[0]  # an expert's slice: its fused tensor
        if pname in unknown:
            bad.append(f"{name}{KERNEL_MARK}: {unknown[pname]}")
        elif want[name] is None or got[name] != want[name]:
            bad.append(name + KERNEL_MARK)
    version = int(msg["version"])
    if st.verified is None or st.verified[0] != version:
        bad = bad or ["<version>" + KERNEL_MARK]  # the in-session check did not pass for v
    if bad:
        st.verified = st.loaded = None
        raise Mismatch(bad, version, len(spec))
