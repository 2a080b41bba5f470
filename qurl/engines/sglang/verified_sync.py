"""Learner side of delta and verified syncs to real SGLang servers (mixed into SGLangEngine).

A server launched with qurl's sync loader (`--custom-weight-loader
qurl.engines.sglang.inside.loader.prepare_sync`, which server_command adds to every server qurl
launches) can take a delta and prove what it holds (qurl/engines/sglang/inside/apply.py does both
inside the server), at any TP size whose cut qurl can map (qurl/engines/sglang/inside/tp_cut.py: that
needs the model's head counts, from the engine's `layout` or the config.json of the model path
the server reports in /model_info). For such engines:

- `load_weights(chunks, version, base=(v-1, digest))` sends a delta (qurl/weights/delta.py chunks)
  over the same weight group and `update_weights_from_distributed` calls as a full sync,
  preceded by the control chunk `qurl.sync.header` {version, base, HF shapes}. A server that does
  not hold exactly the base verified refuses before writing anything; that comes back as
  `StaleBase` (the sync loop then sends the version in full, counted as `refused`).
- `verify(digests)` runs one short update session per server — pause, begin, qurl's prepare, one
  bucket holding only `qurl.sync.verify` {version, {name: [digest, shape, dtype]}, and for TP
  sizes T > 1 "tp": {T: {name: [digest of rank r's box, r = 0..T-1]}}}, end — in which every
  rank hashes what it holds; the per-rank digests are computed from the adapter's own copy of
  the version (below), after checking that copy against the learner's digests; [] and `digest`
  set when every server matches, else the names that differ (the servers then stay PAUSED:
  nothing is sampled from weights that are not the learner's until the next sync, which
  continues them). The sync loop resyncs in full and
  counts it (`sync/verify_mismatches`, `sync/fallbacks/mismatch`).
- after a full sync and every `verify_kernels_every`-th delta (deploy.sync.verify_kernels_every; 0 =
  never), once the in-session check passed, a second short session reads back what the kernels
  read AFTER SGLang's closing repack (qurl/engines/sglang/inside/readback.py: the W8A8 weights in
  their transposed [in, out] layout, recomputed to the HF values and hashed, every region of a
  tied head too) against the same digests; a difference is a mismatch like any other, named
  `<name> (kernel layout)`. Servers launched without that loader
  (`qurl.engines.sglang.inside.loader.read_kernels`) are not read back (`kernel_checks` counts
  the read-backs that passed).
- the adapter keeps its own copy of the last version's chunks (to re-send to a restarted server),
  updated in place by each delta (O(changes)); a restarted server gets that full version and is
  unverified until the next sync (so the next sync is full: reason `holder`). The copy is in host
  memory, pinned when CUDA is available (qurl/weights/host.py): not on the learner's GPU.

Engines without the loader on every server, or with a TP > 1 server whose cut cannot be mapped
(head counts unknown; a tensor the map does not know, found at the first full sync: then
`tp_refusal` says why and the engine stops offering `verify`), have `verify` = None: the sync
loop then sends full syncs (`unsupported`) and records `sync/verified` = NaN.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from qurl.engines.sglang.inside.layout import (HEADER, KERNELS, MISMATCH_MARK, STALE_MARK, VERIFY,
                                               json_chunk)
from qurl.engines.sglang.inside.loader import KERNELS_LOAD_FORMAT, SYNC_LOAD_FORMAT
from qurl.engines.sglang.inside.tp_cut import Layout, cpu_padding, rank_digests, shard_box
from qurl.weights.delta import apply_positions, check_delta, group_delta_chunks
from qurl.weights.digest import combine, digest_target, tensor_digest
from qurl.weights.host import to_host

log = logging.getLogger(__name__)

Chunks = list[tuple[str, torch.Tensor]]


def parse_mismatch(message: str) -> list[str] | None:
    """The tensor names of a server's `qurl-mismatch: [...]` refusal, None if it is not one."""
    i = message.find(MISMATCH_MARK)
    if i < 0:
        return None
    try:
        names, _ = json.JSONDecoder().raw_decode(message[i + len(MISMATCH_MARK):])
    except json.JSONDecodeError:
        return ["<unparsed>"]
    return [str(n) for n in names] or ["<unparsed>"]


def is_stale_refusal(message: str) -> bool:
    return STALE_MARK in message


def header_chunk(version: int, base: tuple[int, str] | None,
                 meta: dict[str, tuple[list[int], str]]) -> tuple[str, torch.Tensor]:
    return HEADER, json_chunk({"version": int(version),
                               "base": None if base is None else [int(base[0]), str(base[1])],
                               "shapes": {n: s for n, (s, _) in meta.items()}})


def verify_chunk(version: int, digests: dict[str, str], meta: dict[str, tuple[list[int], str]],
                 tp: dict[int, dict[str, list[str]]] | None = None, name: str = VERIFY
                 ) -> tuple[str, torch.Tensor]:
    """The verification request; a name the adapter never sent is a KeyError (caller's bug).
    tp: {T: {name: [digest of rank r's box]}} for the TP sizes > 1 among the servers."""
    msg: dict[str, Any] = {"version": int(version),
                           "digests": {n: [d, *_meta_of(meta, n)] for n, d in digests.items()}}
    if tp:
        msg["tp"] = {str(t): d for t, d in tp.items()}
    return name, json_chunk(msg)


def _meta_of(meta: dict[str, tuple[list[int], str]], key: str) -> tuple[list[int], str]:
    got = key_meta(meta, key)
    if got is None:
        raise KeyError(key)
    return got


def check_cuts(meta: dict[str, tuple[list[int], str]], tp: int, layout: Layout | None,
               cpu: bool = False) -> None:
    """ValueError naming the first tensor whose TP-`tp` cut qurl cannot map (cpu: a server on
    SGLang's CPU path, which pads cuts that TP does not divide)."""
    for name, (shape, _) in meta.items():
        for r in range(tp):
            shard_box(name, shape, r, tp, layout)
    if cpu and layout is not None:
        mlp = [s[0] for n, (s, _) in meta.items() if n.endswith("mlp.gate_proj.weight")]
        block = any(n.endswith("weight_scale_inv") for n in meta)
        why = cpu_padding(layout, tp, mlp[0] if mlp else None, 128 if block else None)
        if why:
            raise ValueError(why)


def tp_digests(kept: dict[str, torch.Tensor], names: list[str], tp: int, layout: Layout | None
               ) -> dict[str, list[str]]:
    """{name: [digest of rank r's box of the kept tensor, r = 0..tp-1]}."""
    return {n: rank_digests(n, kept[n], tp, layout) for n in names}


def layout_of_model_dir(path: str | None) -> Layout | None:
    """Head counts from `path`/config.json, None when it cannot be read here."""
    try:
        return Layout.of_config(json.loads((Path(str(path)) / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def chunk_meta(chunks: Chunks) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype name)} of a full version's chunks."""
    return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in chunks}


def key_meta(meta: dict[str, tuple[list[int], str]], key: str) -> tuple[list[int], str] | None:
    """(shape, dtype name) of digest key `key`: a chunk's, or for one expert's slice of a fused
    expert tensor (`<name>@expert<e>`, qurl/weights/digest.py) the slice's; None if not sent."""
    name, expert = digest_target(key)
    if name not in meta:
        return None
    shape, dtype = meta[name]
    if expert is None:
        return meta[name]
    return (list(shape[1:]), dtype) if shape and 0 <= expert < shape[0] else None


def apply_to_kept(kept: dict[str, torch.Tensor], chunks: Chunks) -> None:
    """Apply a version's delta chunks to the adapter's own copy of the previous one, in place
    (validated first, like the server)."""
    whole, deltas = group_delta_chunks(chunks)
    checked = []
    for name, parts in deltas.items():
        if name not in kept:
            raise ValueError(f"{name}: delta for a tensor the kept copy does not hold")
        checked.append((kept[name], *check_delta(name, kept[name], parts)))
    for name, t in whole.items():
        kept[name] = to_host(t)
    for target, pos, val in checked:
        apply_positions(target, pos, val)


class SGLangDeltaMixin:
    """Delta / verification methods of SGLangEngine (see the module docstring)."""

    servers: list
    _version: int
    _digest: str | None = None
    _meta: dict[str, tuple[list[int], str]] | None = None
    _kept: dict[str, torch.Tensor] | None = None
    layout: Layout | None = None  # the model's head counts, when the engine was told them
    tp_refusal: str | None = None  # why a TP > 1 server's cut cannot be mapped (then: full)
    verify_kernels_every: int = 10  # deploy.sync.verify_kernels_every (module docstring); 0 = never
    kernel_checks = 0  # post-repack read-backs that passed
    _kernels_due = False
    _deltas_unread = 0  # deltas since the last kernel read-back

    @property
    def can_read_kernels(self) -> bool:
        """Every server has qurl's post-repack read-back loader (and takes verified syncs)."""
        return self.delta_capable and all(
            KERNELS_LOAD_FORMAT in (getattr(s, "custom_loaders", None) or ()) for s in self.servers)

    @property
    def delta_capable(self) -> bool:
        """Every server runs qurl's sync loader, at TP size 1 or with a cut qurl can map."""
        return self.tp_refusal is None and all(
            SYNC_LOAD_FORMAT in (getattr(s, "custom_loaders", None) or ())
            and (s.spec.tp == 1 or getattr(s, "layout", None) is not None) for s in self.servers)

    def _find_layout(self, s: Any) -> Layout | None:
        """Head counts for a TP > 1 server: the engine's, else the config.json of the model
        path the server reports (/model_info), when this process can read it."""
        from qurl.engines.sglang.protocol import SGLangError

        if self.layout is not None:
            return self.layout
        try:
            status, raw = s.call("GET", "/model_info", None, self.timeouts.control_s)
            path = json.loads(raw).get("model_path") if status == 200 else None
        except (SGLangError, json.JSONDecodeError, AttributeError):
            path = None
        return layout_of_model_dir(path)

    def _tp_sizes(self) -> list[int]:
        return sorted({s.spec.tp for s in self.servers if s.spec.tp > 1})

    def _tp_layout(self, tp: int) -> Layout | None:
        return next(s.layout for s in self.servers if s.spec.tp == tp)

    @property
    def digest(self) -> str | None:
        """Combined digest of the version every server verified last (None: not verified)."""
        return self._digest

    @property
    def can_verify(self) -> bool:
        """Deltas and verification need qurl's sync loader and a TP cut qurl can map."""
        return self.delta_capable

    def _wire(self, chunks: Chunks, version: int, base: tuple[int, str] | None) -> Chunks:
        """What goes on the wire for one load: the header first when the servers take it."""
        if base is not None and not self.delta_capable:
            raise ValueError("this SGLang engine cannot apply deltas (servers without qurl's "
                             f"{SYNC_LOAD_FORMAT} loader, or a TP > 1 cut qurl cannot map: "
                             f"{self.tp_refusal or 'head counts unknown'})")
        if not self.delta_capable:
            return chunks
        if base is None:
            self._meta = chunk_meta(chunks)
            for tp in self._tp_sizes():
                try:
                    check_cuts(self._meta, tp, self._tp_layout(tp), cpu=any(
                        getattr(s, "device", None) == "cpu" for s in self.servers
                        if s.spec.tp == tp))
                except ValueError as e:  # full, unverified syncs from now on, saying why
                    self.tp_refusal = f"TP {tp} server: qurl cannot map its cut ({e})"
                    log.warning("SGLang delta / verified syncs off: %s", self.tp_refusal)
                    self._meta = None
                    return chunks
        elif self._meta is None:
            raise ValueError("a delta before any full sync")
        self._deltas_unread = 0 if base is None else self._deltas_unread + 1
        k = self.verify_kernels_every
        self._kernels_due = k > 0 and (base is None or self._deltas_unread >= k)
        self._digest = None
        return [header_chunk(version, base, self._meta), *chunks]

    def _keep_version(self, chunks: Chunks, base: tuple[int, str] | None) -> Chunks | None:
        """The full chunks of the version just loaded, for a restarted server (module docstring);
        None when there is no full copy to keep."""
        if not self.delta_capable:
            return chunks
        if base is None:
            self._kept = {n: to_host(t) for n, t in chunks}  # host, pinned on CUDA hosts
        elif self._kept is not None:
            apply_to_kept(self._kept, chunks)
        return None if self._kept is None else list(self._kept.items())

    def _prepare(self, s: Any) -> None:
        """qurl's prepare loader on every TP rank of `s` (restore W8A8 + install the hook)."""
        from qurl.engines.sglang.protocol import NO_TENSORS
        body = {"serialized_named_tensors": [NO_TENSORS] * s.spec.tp,
                "load_format": SYNC_LOAD_FORMAT, "flush_cache": False,
                "abort_all_requests": False}
        s.post_json("/update_weights_from_tensor", body, self.timeouts.control_s)

    def verify(self, digests: dict[str, str]) -> list[str]:
        """See the module docstring."""
        from qurl.engines.sglang.protocol import SGLangError

        if self._meta is None:
            return sorted(digests)  # nothing loaded through qurl's sync: nothing vouched for
        unknown = sorted(k for k in digests if key_meta(self._meta, k) is None)
        if unknown:
            return unknown
        tp = {}
        if self._tp_sizes():  # per-rank digests, from the kept copy: first check it is v
            if self._kept is None:
                return sorted(digests)
            off = sorted(n for n in digests
                         if n not in self._kept or tensor_digest(self._kept[n]) != digests[n])
            if off:
                return off
            tp = {t: tp_digests(self._kept, sorted(digests), t, self._tp_layout(t))
                  for t in self._tp_sizes()}
        chunk = verify_chunk(self._version, digests, self._meta, tp)
        c = self.timeouts.control_s
        bad: list[str] = []
        with self._hold():
            self._pauses += 1
            self._each(lambda s: s.post_json("/pause_generation", {"mode": "abort"}, c), 2 * c)
            self._each(lambda s: s.post_json("/begin_weight_update", {}, c), 2 * c)
            try:
                self._each(self._prepare, 2 * c)
                self.weights.send([chunk], self._version, announce=self._announce(self._version))
            except SGLangError as e:
                names = parse_mismatch(str(e))
                if names is None:
                    raise
                bad = names
            finally:
                self._each(lambda s: s.post_json("/end_weight_update", {}, c), 2 * c)
            if not bad and self._kernels_due and self.can_read_kernels:
                bad = self._read_kernels(digests, tp)
            if bad:  # the refused bucket closed our side of the group: form it anew; stay paused
                self._digest = None
                self._form_group()
                return bad
            self._each(lambda s: s.post_json("/continue_generation", {}, c), 2 * c)
        self._digest = combine(digests)
        return []

    def _read_kernels(self, digests: dict[str, str], tp: dict) -> list[str]:
        """The post-repack read-back session on every server (module docstring): [] when the
        kernels read the learner's values, else the names that differ (`... (kernel layout)`)."""
        from qurl.engines.sglang.protocol import NO_TENSORS, SGLangError

        assert self._meta is not None
        chunk = verify_chunk(self._version, digests, self._meta, tp, name=KERNELS)
        c = self.timeouts.control_s
        self._each(lambda s: s.post_json("/begin_weight_update", {}, c), 2 * c)
        try:
            self._each(lambda s: s.post_json("/update_weights_from_tensor", {
                "serialized_named_tensors": [NO_TENSORS] * s.spec.tp,
                "load_format": KERNELS_LOAD_FORMAT, "flush_cache": False,
                "abort_all_requests": False}, c), 2 * c)
            self.weights.send([chunk], self._version, announce=self._announce(self._version))
        except SGLangError as e:
            names = parse_mismatch(str(e))
            if names is None:
                raise
            return names
        finally:  # the read-back loader made this session's closing repack a no-op
            self._each(lambda s: s.post_json("/end_weight_update", {}, c), 2 * c)
        self._kernels_due, self._deltas_unread = False, 0
        self.kernel_checks += 1
        return []
