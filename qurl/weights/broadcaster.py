"""Rank 0 of a weight group shared with remote peers: form it, announce and broadcast, recover.

Two callers push weights to peers in other processes, and both follow one sequence:

    form(world, invite):  gen += 1; pick the rendezvous (host, port); `invite(spec)` asks every
                          peer to join rank `offset + i` (peers block in their own join);
                          rank 0 joins (WeightGroup waits for the whole world); wait for the
                          peers' replies (their errors are reported with the join failure)
    send(chunks, v, announce):  WeightSender.send — per bucket announce -> broadcast -> wait
    on any failure:       close the group; the caller re-forms it (a peer restarted, died, or
                          a new one came) before the next send

- the async controller (qurl/pipeline/fleet.py): peers are rollout workers, invited and
  announced over ZeroMQ control messages;
- the SGLang engine (qurl/engines/sglang/engine.py): peers are every TP rank of every server, invited
  with `POST /init_weights_update_group` and announced with `POST
  /update_weights_from_distributed`.

Rendezvous ports: with a configured `port` (deploy.sync.port, for firewalled clusters)
generation g uses `port + g - 1`; with port 0 a free one each time. Group names carry the
generation so a peer can tell a stale invitation from the current one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from qurl.weights.group import WeightGroup, free_port
from qurl.weights.nccl_env import apply_nccl_defaults, check_known
from qurl.weights.sender import BucketAnnouncement, SyncStats, WeightSender


@dataclass(frozen=True)
class GroupSpec:
    """What a peer needs to join generation `gen` of the group (ranks 1..world-1 are the peers')."""
    host: str
    port: int
    world: int
    backend: str
    name: str
    gen: int


class GroupFormError(RuntimeError):
    """The group did not form: rank 0's join failed or timed out; the peers' errors are attached."""


class Broadcaster:
    def __init__(self, host: str, port: int, backend: str, *, name: str, bucket_bytes: int,
                 timeout_s: float, load_format: str = "flattened_bucket") -> None:
        self.host, self.port, self.backend, self.name = host, port, backend, name
        apply_nccl_defaults()  # rank 0 of a qurl group runs with what qurl gives its peers
        self.bucket_bytes, self.timeout_s, self.load_format = bucket_bytes, timeout_s, load_format
        self.gen = 0
        self.group: WeightGroup | None = None
        self.sender: WeightSender | None = None

    @property
    def formed(self) -> bool:
        return self.group is not None

    def form(self, world: int, invite: Callable[[GroupSpec], Callable[[], None]], *,
             timeout_s: float | None = None, reporters: Iterable[int] | None = None,
             known: Mapping[str, Mapping[str, str]] | None = None) -> GroupSpec:
        """(Re)form the group for `world` ranks. `invite(spec)` must start every peer's join
        without waiting for it and return a function that waits for the peers' replies (raising
        what they reported). timeout_s: of the join and of every broadcast (default: the
        constructor's). NCCL settings (nccl_env.py): `known` {peer: settings} of peers
        that cannot report (SGLang servers, from how they were launched) are checked before any
        invitation; `reporters` are the peers that report at the join (default: every peer).
        Either raises NcclMismatch (one line): a deployment error, not retried."""
        self.close()
        check_known(known or {})
        self.gen += 1
        port = self.port + self.gen - 1 if self.port else free_port(self.host)
        spec = GroupSpec(self.host, port, world, self.backend, f"{self.name}_{self.gen}", self.gen)
        wait_for_peers = invite(spec)
        try:
            group = WeightGroup(spec.host, spec.port, 0, world, self.backend, spec.name,
                                timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                                reporters=reporters)
        except RuntimeError as e:
            try:
                wait_for_peers()
                said = "nothing"
            except Exception as peer:  # noqa: BLE001 - reported with the join failure
                said = str(peer)
            raise GroupFormError(f"weight group {spec.name} did not form: {e}; peers said: "
                                 f"{said}") from e
        wait_for_peers()
        self.group = group
        self.sender = WeightSender(group, bucket_bytes=self.bucket_bytes,
                                   load_format=self.load_format)
        return spec

    def send(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int,
             announce: Callable[[BucketAnnouncement], Callable[[], None] | None]) -> SyncStats:
        """Broadcast one version to the formed group; on failure the group is closed (re-form
        before the next send) and the error raised."""
        if self.sender is None:
            raise RuntimeError("Broadcaster.send: form the group first")
        try:
            return self.sender.send(chunks, version, announce=announce)
        except BaseException:
            self.close(abandon=True)  # a broadcast may be in flight: see WeightGroup.close
            raise

    def close(self, abandon: bool = False) -> None:
        if self.group is not None:
            self.group.close(abandon=abandon)
        self.group = self.sender = None
