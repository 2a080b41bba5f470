"""The learner's checkpoint shards: what each rank writes, and reading them back.

Each TP rank writes its model shard (`model_rank<tp>.pt`, by DP rank 0: the shard is the same on
every DP rank) and its optimizer state (fp32 masters, AdamW moments, schedule position:
`optim_rank<tp>.pt`, or `optim_rank<tp>_dp<dp>.pt` per DP rank when DP > 1). With expert
parallelism (learner.ep > 1) the model shard differs by EP rank (each holds E/ep experts, under
megatron's local numbering from 0): `model_rank<tp>_ep<ep>.pt`, written by the first DP replica
that holds those experts (expert-DP rank 0); the optimizer files are per DP rank as before. Files are hashed as
they are written (checksums.py `save_torch`), for the checkpoint manifest. Model keys are
megatron's local-spec names whichever layer spec built the model, so a run resumes with or without
Transformer Engine; `save`/`load` give bit-identical continuation on the same TP, DP and EP sizes.

`ShardCheckpoint` is that part of `MegatronLearner` (qurl/learner/megatron.py); it uses the
learner's ranks (`tp_rank`, `tp_size`, `dp_rank`, `dp_size`, `ep`: expert_parallel.py's
`ExpertParallel`), `model`, `te`, `optimizer`, `step` and `device`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qurl.checkpoint.checksums import FileSum, save_torch
from qurl.models import convert


class ShardCheckpoint:
    """MegatronLearner's save / load (see the module docstring)."""


    def _files(self) -> tuple[str, str]:
        """(model shard file, optimizer file) of this rank. The model shard is the same on every DP
        rank (DP rank 0 writes it); the optimizer state is per DP rank when DP > 1."""
        optim = f"optim_rank{self.tp_rank}.pt" if self.dp_size == 1 else \
            f"optim_rank{self.tp_rank}_dp{self.dp_rank}.pt"
        if self.ep.size > 1:  # this EP rank's experts
            return f"model_rank{self.tp_rank}_ep{self.ep.rank}.pt", optim
        return f"model_rank{self.tp_rank}.pt", optim

    def _writes_model(self) -> bool:
        """The first DP replica holding this rank's model shard writes it."""
        return self.ep.data_rank == 0 if self.ep.size > 1 else self.dp_rank == 0

    def state_dict(self) -> dict[str, Any]:
        """This rank's model shard, optimizer (fp32 masters + AdamW moments) and schedule position.
        Model keys are local-spec names whichever spec built the model (TE's `_extra_state` FP8
        metadata is not kept: the learner trains in bf16/fp32), so a run resumes with or without TE."""
        model = {convert.from_te_name(k): v for k, v in self.model.state_dict().items()
                 if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        return {"format": 2, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "ep_rank": self.ep.rank, "ep_size": self.ep.size, "step": self.step,
                "model": model, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != 2:
            raise ValueError(f"learner checkpoint format {state.get('format')!r}: this qurl reads 2")
        if (state.get("tp_rank"), state.get("tp_size")) != (self.tp_rank, self.tp_size):
            raise ValueError(f"checkpoint shard is TP rank {state.get('tp_rank')} of "
                             f"{state.get('tp_size')}, this learner is {self.tp_rank} of {self.tp_size}")
        saved_ep = (state.get("ep_rank", 0), state.get("ep_size", 1))  # before EP: 0 of 1
        if saved_ep != (self.ep.rank, self.ep.size):
            raise ValueError(f"checkpoint shard is expert-parallel rank {saved_ep[0]} of "
                             f"{saved_ep[1]}, this learner is {self.ep.rank} of {self.ep.size} "
                             f"(learner.ep must be the run's)")
        model = {convert.from_te_name(k): v for k, v in state["model"].items()}  # either spec's names
        missing, unexpected = self.model.load_state_dict(
            convert.to_te_names(model) if self.te else model, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint model shard: missing {missing}, unexpected {unexpected}")
        self.optimizer.load_state_dict(state["optimizer"])  # also re-publishes the masters
        self.step = int(state["step"])

    def save(self, directory: str | Path) -> dict[str, FileSum]:
        """Write this rank's model shard (its first DP replica) and optimizer file into directory; return
        each written file's size and checksum, taken as it was written (the checkpoint manifest)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        optim = {k: state.pop(k) for k in ("optimizer", "step")}
        model_file, optim_file = self._files()
        parts = [(optim_file, optim)] + ([(model_file, state)] if self._writes_model() else [])
        return {fname: save_torch(obj, d / fname) for fname, obj in parts}

    def load(self, directory: str | Path) -> None:
        d = Path(directory)
        parts = {}
        for fname in self._files():
            if not (d / fname).is_file():
                raise FileNotFoundError(f"{d / fname}: learner checkpoint shard missing")
            parts.update(torch.load(d / fname, map_location=self.device, weights_only=False))
        self.load_state_dict(parts)
