"""Learner side of delta and verified syncs to real SGLang servers (mixed into SGLangEngine).

A server launched with qurl's sync loader (`--custom-weight-loader
qurl.engines.sglang_loader.prepare_sync`, which server_command adds to every server qurl
launches) and TP size 1 can take a delta and prove what it holds (qurl/engines/sglang_server.py
does both inside the server). For such engines:

- `load_weights(chunks, version, base=(v-1, digest))` sends a delta (qurl/sync/delta.py chunks)
  over the same weight group and `update_weights_from_distributed` calls as a full sync,
  preceded by the control chunk `qurl.sync.header` {version, base, HF shapes}. A server that does
  not hold exactly the base verified refuses before writing anything; that comes back as
  `StaleBase` (the sync loop then sends the version in full, counted as `refused`).
- `verify(digests)` runs one short update session per server — pause, begin, qurl's prepare, one
  bucket holding only `qurl.sync.verify` {version, {name: [digest, shape, dtype]}}, end — in
  which the server hashes what it holds; [] and `digest` set when every server matches, else the
  names that differ (the servers then stay PAUSED: nothing is sampled from weights that are not
  the learner's until the next sync, which continues them). The sync loop resyncs in full and
  counts it (`sync/verify_mismatches`, `sync/fallbacks/mismatch`).
- the adapter keeps its own copy of the last version's chunks (to re-send to a restarted server),
  updated in place by each delta (O(changes)); a restarted server gets that full version and is
  unverified until the next sync (so the next sync is full: reason `holder`).

Engines without the loader on every server, or with TP > 1, have `verify` = None: the sync loop
then sends full syncs (`unsupported`) and records `sync/verified` = NaN.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import torch

from qurl.engines.sglang_layout import (HEADER, MISMATCH_MARK, STALE_MARK, VERIFY, json_chunk)
from qurl.engines.sglang_loader import SYNC_LOAD_FORMAT
from qurl.sync.delta import apply_positions, check_delta, group_delta_chunks
from qurl.sync.digest import combine

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


def verify_chunk(version: int, digests: dict[str, str], meta: dict[str, tuple[list[int], str]]
                 ) -> tuple[str, torch.Tensor]:
    """The verification request; a name the adapter never sent is a KeyError (caller's bug)."""
    return VERIFY, json_chunk({"version": int(version),
                               "digests": {n: [d, *meta[n]] for n, d in digests.items()}})


def chunk_meta(chunks: Chunks) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype name)} of a full version's chunks."""
    return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in chunks}


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
        kept[name] = t.detach().clone()
    for target, pos, val in checked:
        apply_positions(target, pos, val)


class SGLangDeltaMixin:
    """Delta / verification methods of SGLangEngine (see the module docstring)."""

    servers: list
    _version: int
    _digest: str | None = None
    _meta: dict[str, tuple[list[int], str]] | None = None
    _kept: dict[str, torch.Tensor] | None = None

    @property
    def delta_capable(self) -> bool:
        """Every server runs qurl's sync loader at TP size 1."""
        return all(SYNC_LOAD_FORMAT in (getattr(s, "custom_loaders", None) or ())
                   and s.spec.tp == 1 for s in self.servers)

    @property
    def digest(self) -> str | None:
        """Combined digest of the version every server verified last (None: not verified)."""
        return self._digest

    @property
    def verify(self) -> Callable[[dict[str, str]], list[str]] | None:
        return self._verify if self.delta_capable else None

    def _wire(self, chunks: Chunks, version: int, base: tuple[int, str] | None) -> Chunks:
        """What goes on the wire for one load: the header first when the servers take it."""
        if base is not None and not self.delta_capable:
            raise ValueError("this SGLang engine cannot apply deltas (servers without qurl's "
                             f"{SYNC_LOAD_FORMAT} loader, or TP > 1)")
        if not self.delta_capable:
            return chunks
        if base is None:
            self._meta = chunk_meta(chunks)
        elif self._meta is None:
            raise ValueError("a delta before any full sync")
        self._digest = None
        return [header_chunk(version, base, self._meta), *chunks]

    def _keep_version(self, chunks: Chunks, base: tuple[int, str] | None) -> Chunks | None:
        """The full chunks of the version just loaded, for a restarted server (module docstring);
        None when there is no full copy to keep."""
        if not self.delta_capable:
            return chunks
        if base is None:
            self._kept = {n: t.detach().clone() for n, t in chunks}
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

    def _verify(self, digests: dict[str, str]) -> list[str]:
        """See the module docstring."""
        from qurl.engines.sglang.protocol import SGLangError

        if self._meta is None:
            return sorted(digests)  # nothing loaded through qurl's sync: nothing vouched for
        unknown = sorted(set(digests) - set(self._meta))
        if unknown:
            return unknown
        chunk = verify_chunk(self._version, digests, self._meta)
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
            if bad:  # the refused bucket closed our side of the group: form it anew; stay paused
                self._digest = None
                self._form_group()
                return bad
            self._each(lambda s: s.post_json("/continue_generation", {}, c), 2 * c)
        self._digest = combine(digests)
        return []
