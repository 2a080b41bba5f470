"""The learner's optimizer: AdamW on flat fp32 master weights, sharded over data parallel (ZeRO-1).

Why not megatron's DistributedOptimizer: in megatron-core 0.16 it allocates `device='cuda'` tensors
and checks `param.type() == 'torch.cuda.BFloat16Tensor'` in its constructor, so it cannot run on the
CPU machines where qurl is developed and tested. This module does the same job (fp32 master weights
and Adam moments split across the data-parallel ranks, gradients reduce-scattered, updated weights
all-gathered) with plain torch.distributed collectives that gloo and NCCL both provide.

Layout. A learner rank's parameters (its TP shards, in model order) form two groups, matrices
(weight decay) and vectors (norm gains, biases: no decay, as in megatron). Each group is laid end to
end in one flat fp32 buffer of N elements, padded to a multiple of the DP size D:

    group buffer  [ p0 | p1 | p2 | ... | pad ]       N_pad = ceil(N / D) · D
    DP rank d owns [d · N_pad/D, (d+1) · N_pad/D)

- `distributed=True` (deploy.ranks.distributed_optimizer): the master weights and both Adam moments exist
  only for the owned slice, 12 bytes/param / D per rank instead of 12. A step: flatten the grads ->
  reduce-scatter (sum) over DP -> global grad norm -> clip -> AdamW on the slice -> all-gather the
  slices -> copy into the model's parameters (bf16 or fp32).
- `distributed=False`: every DP rank holds the whole buffer; grads are all-reduced (sum) over DP.
  With D = 1 both are the plain single-rank optimizer.

Expert parallelism (learner.ep = P > 1, qurl/learner/expert_parallel.py): an EP rank's routed
experts are its own (other EP ranks hold other experts), so they go into groups of their own
(decay / no-decay), replicated over the expert-data-parallel group of D/P ranks instead of DP: their
gradients are summed, their masters and moments sharded, and their slices gathered over expert-DP.
At P = 1 the experts stay in the two dense groups and nothing changes.

Gradients are summed, not averaged, over DP: each DP rank's loss is already divided by the whole
mini-batch's denominator (`qurl.algo.loss.loss_denominator`), so the sum is the mini-batch gradient.

Grad norm = sqrt(Σ g²) over the full (unsharded) model gradient. An element is counted where its
parameter is split across TP ranks, or is replicated across them (norm gains: same gradient on every
TP rank without sequence parallelism) and this is TP rank 0. The partial sums are added over the TP
group, and, when the buffer is DP-sharded, over the DP group too; float64 throughout. With expert
parallelism the experts' part is kept apart and summed over TP and over the EP group (whole
experts per EP rank), or over DP when sharded (expert-DP x EP = DP). Clipping uses
megatron's rule (coefficient max_norm / (norm + 1e-6) when < 1); a non-finite norm skips the update
on every rank alike.

Invariants: every rank calls `step`, `full_masters`, `load_state_dict` together (they are collectives
when TP or DP > 1); after `step` the model's parameters equal the masters cast to their dtype.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qurl.config import OptimConfig

# torch 2.13 renamed the tensor collectives; older releases (the GPU image) have the old names only.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_NORM_CHUNK = 1 << 18  # fp64 elements (2 MiB) per step of the CPU grad-norm sum


@dataclass(frozen=True)
class Parallel:
    """Where this rank sits: TP rank/size/group, DP rank/size/group and, with expert parallelism,
    EP size/group and expert-DP rank/size/group (groups None when size 1)."""
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    ep_size: int = 1
    ep_group: Any = None
    edp_rank: int = 0
    edp_size: int = 1
    edp_group: Any = None


class _Group:
    """One flat buffer: which parameters, where each starts, and this rank's master slice."""

    def __init__(self, index: list[int], params: Sequence[torch.nn.Parameter], counted: Sequence[bool],
                 par: Parallel, distributed: bool, initial: Sequence[torch.Tensor] | None,
                 expert: bool = False) -> None:
        self.index = index  # positions of this group's params in the model's parameter list
        self.params = [params[i] for i in index]
        # replicas of these params: the DP group, or for an EP rank's own experts the expert-DP one
        self.expert = expert
        self.rank, self.size, self.group = ((par.edp_rank, par.edp_size, par.edp_group) if expert
                                            else (par.dp_rank, par.dp_size, par.dp_group))
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        d = self.size if distributed else 1
        self.padded = -(-n // d) * d
        shard = self.padded // d
        self.lo = (self.rank if distributed else 0) * shard
        self.hi = self.lo + shard
        device = self.params[0].device if self.params else torch.device("cpu")
        start = self.params if initial is None else [initial[i] for i in index]
        full = self.flatten([t.detach() for t in start], device)
        self.master = torch.nn.Parameter(full[self.lo:self.hi].clone())
        # Elements of this slice that count towards the grad norm (None: all of them).
        mask = torch.zeros(self.padded, dtype=torch.bool, device=device)
        for i, off, p in zip(index, self.offsets, self.params):
            mask[off:off + p.numel()] = bool(counted[i])
        own = mask[self.lo:self.hi]
        self.counted = None if bool(own.all()) else own.clone()

    def flatten(self, tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """[padded] fp32: tensors[i] (one per parameter of the group, None = zeros) end to end."""
        flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for off, p, t in zip(self.offsets, self.params, tensors):
            if t is not None:
                flat[off:off + p.numel()].copy_(t.reshape(-1))
        return flat


class DistributedAdamW:
    """AdamW over flat fp32 masters of `params` (this rank's model parameters, any float dtype).

    counted[i]: parameter i's elements count towards the grad norm on this rank (see module doc).
    initial[i]: the full-precision value parameter i's master starts from (default: the parameter
    itself). A bf16 model built from an fp32 checkpoint passes the checkpoint here, so the masters
    keep the bits the bf16 copy rounded away.
    `param_groups` are torch AdamW's (the learner sets "lr" there before each step)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], counted: Sequence[bool], optim: OptimConfig,
                 par: Parallel = Parallel(), *, distributed: bool = False,
                 initial: Sequence[torch.Tensor] | None = None,
                 expert: Sequence[bool] | None = None) -> None:
        if len(params) != len(counted):
            raise ValueError(f"{len(params)} params but {len(counted)} counted flags")
        if initial is not None and [tuple(t.shape) for t in initial] != [tuple(p.shape) for p in params]:
            raise ValueError("initial: one tensor per parameter, of the parameter's shape")
        self.params, self.par, self.distributed = list(params), par, bool(distributed)
        # with expert parallelism an EP rank's experts get groups of their own (module docstring)
        split = par.ep_size > 1
        if split and (expert is None or len(expert) != len(self.params)):
            raise ValueError(f"expert parallelism (ep={par.ep_size}): one expert flag per parameter")
        own = [bool(split and expert[i]) for i in range(len(self.params))]  # type: ignore[index]
        self.groups = []
        decays = []
        for is_expert in (False, True) if split else (False,):
            for decay in (True, False):
                index = [i for i, p in enumerate(self.params)
                         if own[i] == is_expert and (p.dim() >= 2) == decay]
                if is_expert and not index:
                    continue  # e.g. experts without biases: no expert no-decay group
                self.groups.append(_Group(index, self.params, counted, par, self.distributed,
                                          initial, expert=is_expert))
                decays.append(optim.weight_decay if decay else 0.0)
        # fused: one pass over master, grad and both moments per step (torch's CPU and CUDA
        # kernels); the unfused CPU path makes fresh temporaries of the whole buffer (3x slower).
        self.opt = torch.optim.AdamW(
            [{"params": [g.master], "weight_decay": wd} for g, wd in zip(self.groups, decays)],
            lr=optim.lr, betas=tuple(optim.adam[:2]), eps=optim.adam[2], fused=True)
        self._scratch: torch.Tensor | None = None  # fp64 chunk for the grad norm on CPU

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    @property
    def sharded(self) -> bool:
        return self.distributed and self.par.dp_size > 1

    def _sharded(self, g: _Group) -> bool:
        return self.distributed and g.size > 1

    def master_numel(self) -> int:
        """fp32 master elements held by this rank (the Adam moments are the same size each)."""
        return sum(g.master.numel() for g in self.groups)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for g in self.groups:
            g.master.grad = None

    # ------------------------------------------------------------------ the step

    def step(self, max_norm: float) -> float:
        """Reduce grads over DP, clip to max_norm (<= 0: no clipping), AdamW, publish the new weights
        into the model's parameters. Returns the global grad norm (the update is skipped if it is
        not finite). Clears every gradient."""
        self._reduce_grads()
        norm = self._global_norm()
        if math.isfinite(norm):
            coeff = max_norm / (norm + 1e-6)
            if max_norm > 0 and coeff < 1.0:
                for g in self.groups:
                    g.master.grad.mul_(coeff)
            self.opt.step()
            self._publish()
        self.zero_grad()
        return norm

    def _reduce_grads(self) -> None:
        for g in self.groups:
            flat = g.flatten([p.grad for p in g.params], g.master.device)
            if self._sharded(g):
                own = torch.empty(g.hi - g.lo, dtype=torch.float32, device=flat.device)
                reduce_scatter_tensor(own, flat, op=dist.ReduceOp.SUM, group=g.group)
                flat = own
            elif g.size > 1:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g.group)
            g.master.grad = flat

    def _global_norm(self) -> float:
        # [dense, experts]: Σ g² of the counted elements this rank holds, float64
        total = torch.zeros(2, dtype=torch.float64, device=self.groups[0].master.device)
        for g in self.groups:
            grad = g.master.grad if g.counted is None else g.master.grad[g.counted]
            total[int(g.expert)] += self._sum_squares_f64(grad)
        if self.par.tp_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.par.tp_group)
        if self.sharded:  # dense slices over DP; expert slices over expert-DP x EP = DP as well
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.par.dp_group)
        elif self.par.ep_size > 1:  # each EP rank holds other experts, whole
            expert = total[1:].clone()
            dist.all_reduce(expert, op=dist.ReduceOp.SUM, group=self.par.ep_group)
            total[1:] = expert
        return float((total[0] + total[1]).sqrt())

    def _sum_squares_f64(self, x: torch.Tensor) -> torch.Tensor:
        """Σ x² of a flat fp32 tensor, in float64. On CUDA one reduction; on CPU chunk by chunk
        through one reused fp64 scratch (a whole-buffer fp64 temporary is a fresh allocation every
        step, and its page faults cost 4x the sum itself)."""
        if x.device.type != "cpu":
            return torch.linalg.vector_norm(x, dtype=torch.float64).square()
        if self._scratch is None:
            self._scratch = torch.empty(_NORM_CHUNK, dtype=torch.float64)
        total = torch.zeros((), dtype=torch.float64)
        for i in range(0, x.numel(), _NORM_CHUNK):
            buf = self._scratch[:min(_NORM_CHUNK, x.numel() - i)]
            buf.copy_(x[i:i + _NORM_CHUNK])
            total += torch.dot(buf, buf)
        return total

    def _full(self, g: _Group) -> torch.Tensor:
        """The group's whole fp32 buffer (all-gathered over its DP or expert-DP group when sharded)."""
        if not self._sharded(g):
            return g.master.detach()
        full = torch.empty(g.padded, dtype=torch.float32, device=g.master.device)
        all_gather_tensor(full, g.master.detach().contiguous(), group=g.group)
        return full

    @torch.no_grad()
    def _publish(self) -> None:
        for g in self.groups:
            full = self._full(g)
            for off, p in zip(g.offsets, g.params):
                p.copy_(full[off:off + p.numel()].view_as(p))

    # ------------------------------------------------------------------ weights and state

    def full_masters(self) -> list[torch.Tensor]:
        """fp32 master of every parameter, in the order given, shaped like it (fresh tensors).
        A collective over DP when sharded."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for g in self.groups:
            full = self._full(g)
            for i, off, p in zip(g.index, g.offsets, g.params):
                out[i] = full[off:off + p.numel()].view_as(p).clone()
        return out  # type: ignore[return-value]

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank": self.par.dp_rank, "dp_size": self.par.dp_size,
                "ep_size": self.par.ep_size,
                "distributed": self.distributed, "numel": [g.numel for g in self.groups],
                "masters": [g.master.detach().clone() for g in self.groups],
                "adamw": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore masters and moments saved by the same layout, then publish them into the model."""
        mine = (self.par.dp_rank, self.par.dp_size, self.par.ep_size, self.distributed,
                [g.numel for g in self.groups])
        saved = (state.get("dp_rank"), state.get("dp_size"), state.get("ep_size", 1),
                 state.get("distributed"), state.get("numel"))
        if saved != mine:
            raise ValueError(f"optimizer state is for (dp_rank, dp_size, ep_size, distributed, "
                             f"numel)={saved}, this learner is {mine}")
        with torch.no_grad():
            for g, m in zip(self.groups, state["masters"], strict=True):
                g.master.copy_(m)
        self.opt.load_state_dict(state["adamw"])
        self._publish()
