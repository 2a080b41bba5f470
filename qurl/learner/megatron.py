"""The tensor-parallel learner: a megatron-core GPTModel trained with the QuRL surrogate.
(Model construction is build.py; writing and reading this rank's checkpoint shards is qurl/checkpoint/shards.py.)

One instance per learner rank (after `init_learner_dist`; TP shards × DP replicas). At start the
HF checkpoint is read, cast to fp32, UAQ-scaled once (`algo.uaq_scale`; the function is unchanged,
see qurl/quant/uaq.py), and this rank's shard is loaded into a GPTModel (build.py:
megatron's Transformer Engine layer spec on CUDA when installed, its local spec with SDPA attention
otherwise; megatron's activation recompute per learner.recompute). Those weights are the master
weights: `named_weights()` streams them (TP-gathered, HF names) to the weight sync.

A step (`train_step`) on a batch of B right-padded sequences:
1. prox_logp = logprobs of the current weights, once (π_prox of the whole step): a no-grad forward
   for every mini-batch but the first, whose training forward runs at those same weights;
2. for each of algo.epochs × algo.mini_batches mini-batches (B split in order):
   logp with grad -> `policy_loss(preset=algo.loss, …)` -> backward -> TP-correct global grad
   norm -> clip -> AdamW step (skipped, and counted, if the norm is not finite);
3. the LR schedule advances once.
Mini-batches are split further into micro-batches (a memory budget, measured on GPU and agreed by
every rank: membudget.py; rows sorted by length, each row computed only up to its last loss token)
whose losses use the mini-batch's denominator, so their gradients sum to the mini-batch gradient.

Log-probs: out[:, j] = log softmax(logits(tokens[:, :j]) / T)[tokens[:, j]], out[:, 0] = 0, from
megatron's vocab-parallel cross entropy (logits never gathered), the head run only from the
micro-batch's first loss column and in chunks of positions (logits.py). Padded vocab rows (the
vocab is padded to a multiple of 128·TP) are masked to -inf so the distribution is exactly HF's.
The optimizer (distopt.py) keeps fp32 master weights and AdamW moments, sharded over
the data-parallel ranks with ranks.distributed_optimizer (ZeRO-1); in bfloat16 mode the model runs
in bf16 and receives the masters after every update. With DP > 1 each DP rank computes its rows of
every mini-batch and the gradients are summed over DP.

Mixture-of-experts (Qwen3-MoE): train_step takes the engine's routes [B, L, layers, k]; with
algo.routing_replay=rollout every forward of the trained model replays them (replay.py),
and the step's record gets the moe/ route-flip and expert-load entries (moe_step.py). With
learner.ep > 1 each rank holds E/ep experts of every layer (expert_parallel.py): the EP group's
ranks agree on their micro-batch widths, the optimizer sums the experts' gradients over
expert-DP, and `named_weights` gathers them back into every expert.

Invariants: all ranks must call every method with identical inputs (rank 0 broadcasts batches);
`named_weights()` is a collective that every rank must exhaust; `save`/`load` give bit-identical
continuation on the same TP, DP and EP sizes.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qurl.algo.loss import loss_denominator, loss_options, policy_loss
from qurl.checkpoint.shards import ShardCheckpoint
from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig, RanksDeployConfig
from qurl.learner import optim as lopt
from qurl.learner.build import build_gpt, read_hf, use_transformer_engine
from qurl.learner.distopt import DistributedAdamW, Parallel, all_gather_tensor
from qurl.learner.expert_parallel import ExpertParallel, expert_flags, plan_widths
from qurl.learner.logits import first_loss_columns, head_logp, head_weight, hidden_states_out
from qurl.learner.membudget import agreed_free, free_bytes, rows_per_micro
from qurl.learner.memory_plan import token_cost_from_fields
from qurl.learner.moe_step import check_routes, moe_watch, routed_stats, watched_positions
from qurl.models import convert, moe

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOGITS_BUDGET = 2**26  # CPU: fp32 logits per micro-batch (256 MiB); GPU: free memory (membudget.py)


class MegatronLearner(ShardCheckpoint):
    def __init__(self, model_dir: str | Path | None, model: ModelConfig, algo: AlgoConfig,
                 optim: OptimConfig, learner: LearnerConfig, *, total_steps: int, seed: int,
                 ranks: RanksDeployConfig = RanksDeployConfig(),
                 hf_state: dict[str, torch.Tensor] | None = None, hf_config: Any = None,
                 norm_len: int | None = None) -> None:
        """norm_len: the constant that `seq-mean-token-sum-norm` (Dr.GRPO) divides each sequence's
        token sum by — the generation budget (rollout.max_new_tokens); required for that agg, so
        the loss does not depend on how rows are grouped into micro-batches."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("MegatronLearner: call qurl.learner.dist.init_learner_dist first")
        if model.dtype not in _DTYPES:
            raise ValueError(f"model.dtype={model.dtype!r}: must be one of {', '.join(_DTYPES)}")
        self.algo, self.optim, self.total_steps = algo, optim, total_steps
        if norm_len is not None and norm_len <= 0:
            raise ValueError(f"norm_len must be > 0, got {norm_len}")
        self.norm_len = norm_len
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        if self.tp_size != learner.tp:
            raise ValueError(f"learner.tp={learner.tp} but megatron's TP group has {self.tp_size} ranks")
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group() if self.dp_size > 1 else None
        if self.dp_size != learner.dp:
            raise ValueError(f"learner.dp={learner.dp} but megatron's DP group has {self.dp_size} ranks")
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            from megatron_patches.cpu import apply_cpu_patches

            self.device = torch.device("cpu")
            apply_cpu_patches()
        if hf_state is None or hf_config is None:
            if model_dir is None:
                raise ValueError("MegatronLearner: pass model_dir or both hf_state and hf_config")
            hf_state, hf_config = read_hf(model_dir)
        self.hf_config = hf_config
        num_experts = moe.num_experts(hf_config) if convert.is_moe(hf_config) else 0
        self.ep = ExpertParallel.current(num_experts, self.dp_rank, self.device)
        if self.ep.size != learner.ep:
            raise ValueError(f"learner.ep={learner.ep} but megatron's expert-parallel group has "
                             f"{self.ep.size} ranks")
        hf_state = {k: v.float() if v.is_floating_point() else v for k, v in hf_state.items()}
        if convert.is_moe(hf_config):
            hf_state = moe.per_expert(hf_state)  # qurl's expert names (Mixtral's differ on disk)
        if algo.uaq_scale != 1.0:
            from qurl.quant.uaq import apply_uaq

            hf_state = apply_uaq(hf_state, algo.uaq_scale)
        self.dtype = _DTYPES[model.dtype]
        model_parallel_cuda_manual_seed(seed)  # attention forks megatron's RNG tracker every call
        # a MoE runs on the local spec (build.py): "auto" picks it, "on" is refused there
        self.te = use_transformer_engine(ranks.transformer_engine) and not (
            ranks.transformer_engine == "auto" and convert.is_moe(hf_config))
        self.sdpa = not self.te and ranks.attention == "sdpa"

        shard = convert.hf_to_megatron(hf_state, hf_config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        shard = self.ep.local_shard(shard, num_experts)  # learner.ep > 1: this rank's experts only
        spec = dict(tp=self.tp_size, dtype=self.dtype, device=self.device, te=self.te,
                    attention=ranks.attention, recompute=learner.recompute, ep=self.ep.size)
        if algo.routing_replay != "off" and not convert.is_moe(hf_config):
            raise ValueError(f"algo.routing_replay={algo.routing_replay!r}: the model is dense "
                             f"(no experts to replay); set it to off")
        self.model = build_gpt(shard, hf_config, **spec,
                               routing_replay=algo.routing_replay == "rollout")
        self.routes = moe_watch(self.model, hf_config, algo.routing_replay)  # None: dense
        self.ref_model = None
        if algo.kl_coef > 0:  # frozen initial policy for the k3 KL term
            self.ref_model = build_gpt(shard, hf_config, **spec).requires_grad_(False)
        del hf_state
        # Local-spec names (what convert.py maps), whichever layer spec built the model.
        self.named_params = [(convert.from_te_name(n), p) for n, p in self.model.named_parameters()]
        # Masters start from the checkpoint's own precision, not from the (maybe bf16) model copy
        # (a parameter the shard does not name under its local-spec name starts from the model).
        initial = [shard.get(n, p) for n, p in self.named_params]
        del shard
        # Qwen3's q/k norm gains: each TP rank's gradient covers its own heads only (summed below)
        self._tp_partial = [p for n, p in self.named_params if convert.tp_partial_grad(n)] \
            if self.tp_size > 1 else []
        # Norm counting: TP-split params on every rank, TP-replicated ones (norm gains) on rank 0.
        counted = [convert.partition_dim(n) is not None or self.tp_rank == 0 for n, _ in self.named_params]
        par = Parallel(self.tp_rank, self.tp_size, self.tp_group if self.tp_size > 1 else None,
                       self.dp_rank, self.dp_size, self.dp_group, self.ep.size, self.ep.group,
                       self.ep.data_rank, self.ep.data_size, self.ep.data_group)
        self.optimizer = DistributedAdamW([p for _, p in self.named_params], counted, optim, par,
                                          distributed=ranks.distributed_optimizer, initial=initial,
                                          expert=expert_flags([n for n, _ in self.named_params]))
        del initial
        self.step = 0
        padded = convert.padded_vocab_size(int(hf_config.vocab_size), self.tp_size)
        local = padded // self.tp_size
        cols = torch.arange(self.tp_rank * local, (self.tp_rank + 1) * local, device=self.device)
        pad = cols >= int(hf_config.vocab_size)
        self._vocab_pad = pad if bool(pad.any()) else None
        self._local_vocab = local
        self._token_cost = token_cost_from_fields(
            hf_config.to_dict(), tp=self.tp_size, elem=torch.finfo(self.dtype).bits // 8,
            attention="flash" if self.te or self.sdpa else "unfused", recompute=learner.recompute)

    # ------------------------------------------------------------------ model

    def _causal_mask(self, L: int) -> torch.Tensor | None:
        """[1, 1, L, L] bool, True = hidden. megatron's unfused attention needs it explicitly (its
        default mask is allocated on "cuda"); TE attention and SDPA (attention.py) are causal by
        themselves and take None — an explicit mask would send SDPA to its L x L math kernel."""
        if self.te or self.sdpa:
            return None
        return torch.ones(L, L, dtype=torch.bool, device=self.device).triu(1)[None, None]

    def _forward_logp(self, model: torch.nn.Module, tokens: torch.Tensor, temperature: float,
                      start: int = 1, entropy: bool = False, routes: torch.Tensor | None = None,
                      watch: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens: [b, L] -> ([b, L] fp32 log-probs, differentiable; [b, L] fp32 entropies of the
        distributions they are read from, detached, or None unless `entropy`); columns before `start` (>= 1) are 0 and their
        logits are never computed (logits.py: the head runs on positions start-1 .. L-2 only, in
        chunks). MoE (self.routes, the trained model only): routes [b, L, layers, k] the engine's
        experts, replayed with algo.routing_replay=rollout; watch [b, L] bool: positions whose own
        routing enters the moe/ metrics (replay.py, moe_step.py)."""
        b, L = tokens.shape
        start = min(max(1, start), L - 1)
        pos = torch.arange(L, device=self.device).unsqueeze(0).expand(b, L)
        moe = self.routes if model is self.model else None
        if moe is not None:
            moe.replay.begin(routes, watch=watch is not None)
        with hidden_states_out(model):
            hidden = model(tokens, pos, self._causal_mask(L))  # [b, L, h]
        if moe is not None:
            moe.observe(moe.replay.end(), routes, watch)
        lp, ent = head_logp(hidden[:, start - 1:-1], head_weight(model), tokens[:, start:],
                            temperature=temperature, vocab_pad=self._vocab_pad,
                            local_vocab=self._local_vocab, entropy=entropy)
        pad = lp.new_zeros(b, start)
        return torch.cat([pad, lp], dim=1), None if ent is None else torch.cat([pad, ent], dim=1)

    def _rows_per_micro(self, L: int, free: int | None) -> int:
        """Rows of width L per micro-batch: the fixed logits budget on CPU, GPU memory free now."""
        return rows_per_micro(L, self._token_cost, free, LOGITS_BUDGET)

    def _micro_batches(self, rows: torch.Tensor, ends: torch.Tensor, starts: torch.Tensor | None = None,
                       peer_ends: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, int, int]]:
        """Split row indices `rows` into micro-batches (idx, width, start): rows sorted by their end
        (longest first), each micro-batch as many rows as the logits budget allows at its width =
        its longest row's end. Columns at or past a row's end are never computed (right padding
        of a short response next to a long one costs nothing); start = the earliest of its rows'
        `starts` (first loss columns; 1 when not given): the head skips the columns before it.
        peer_ends [P, len(rows)]: with expert parallelism, the ends of every EP group member's rows
        (this rank's among them): each micro-batch is then as wide as the widest of the group's at
        its place (expert_parallel.py `plan_widths`: the token dispatcher's collectives need equal
        shapes on every member)."""
        order = torch.sort(ends[rows], descending=True, stable=True).indices
        rows = rows[order]
        lead = ends[rows] if peer_ends is None else plan_widths(peer_ends)  # width from each place
        # measured once per split, the minimum over every rank: one plan, the same pass count
        free = agreed_free(free_bytes(self.device), self.device)
        i = 0
        while i < len(rows):
            width = int(lead[i])
            n = self._rows_per_micro(width, free)
            idx = rows[i:i + n]
            start = 1 if starts is None else max(1, int(starts[idx].min()))
            yield idx, width, start
            i += n

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, tokens: torch.Tensor, temperature: float,
                  ends: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                  entropy: bool = False, routes: torch.Tensor | None = None,
                  watch: torch.Tensor | None = None, peer_ends: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, L] log-probs, [B, L] entropies or None unless `entropy`); ends: [B], columns from ends[i] on are left 0
        (default: none); starts: [B], columns before a micro-batch's earliest start may be left 0
        (default: 1); routes [B, L, layers, k], watch [B, L]: as `_forward_logp`'s; peer_ends
        [P, B]: as `_micro_batches`'."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, L], got shape {tuple(tokens.shape)}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        tokens = tokens.to(self.device, torch.long)
        B, L = tokens.shape
        out = torch.zeros(B, L, dtype=torch.float32, device=self.device)
        ent = torch.zeros_like(out) if entropy else None
        if L < 2:
            return out, ent
        if ends is None:
            ends = torch.full((B,), L, dtype=torch.long, device=self.device)
        for idx, width, start in self._micro_batches(torch.arange(B, device=self.device), ends, starts,
                                                     peer_ends):
            out[idx, :width], e = self._forward_logp(
                model, tokens[idx, :width], temperature, start, entropy,
                None if routes is None else routes[idx, :width],
                None if watch is None else watch[idx, :width])
            if ent is not None:
                ent[idx, :width] = e
        return out, ent

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, L] -> [B, L, V] fp32 full-vocab logits (TP-gathered, vocab padding removed),
        on the learner's device, for checks against a reference; a collective when TP > 1."""
        self.model.eval()
        if self.routes is not None:
            self.routes.replay.release()  # the model's own routing
        tokens = tokens.to(self.device, torch.long)
        B, L = tokens.shape
        pos = torch.arange(L, device=self.device).unsqueeze(0).expand(B, L)
        local = self.model(tokens, pos, self._causal_mask(L)).float().contiguous()
        if self.tp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp_size)]
            dist.all_gather(parts, local, group=self.tp_group)
            local = torch.cat(parts, dim=-1)
        return local[..., : int(self.hf_config.vocab_size)]

    def logprobs(self, tokens: torch.Tensor, *, temperature: float = 1.0,
                 routes: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, L] int64 -> [B, L] float32 log p(tokens[:, j] | tokens[:, :j]) under
        softmax(logits / temperature); out[:, 0] = 0. No grad; on the learner's device.
        routes: [B, L, layers, k] experts to replay (MoE with algo.routing_replay=rollout)."""
        self.model.eval()
        routes = check_routes(self.routes, routes, tokens.shape, self.device)
        try:
            return self._logprobs(self.model, tokens, temperature, routes=routes)[0]
        finally:
            if self.routes is not None:
                self.routes.replay.release()

    # ------------------------------------------------------------------ training

    def train_step(self, tokens: torch.Tensor, loss_mask: torch.Tensor, behav_logp: torch.Tensor,
                   adv: torch.Tensor, *, staleness: torch.Tensor | None = None,
                   temperature: float = 1.0, norm_len: int | None = None,
                   routes: torch.Tensor | None = None) -> dict[str, float]:
        """One learner step. tokens, loss_mask, behav_logp: [B, L]; adv: [B] or [B, L];
        staleness: [B] or [B, L] (stats only). Every rank passes the whole batch; with data
        parallelism DP rank d computes rows [d·m/D, (d+1)·m/D) of each mini-batch of m rows (and
        its share of prox_logp), against the whole mini-batch's loss denominator. Returns mean
        stats over the mini-batches (of whole mini-batches, the same on every rank) plus grad_norm
        (mean), grad_norm_max, grad_norm_last, lr, tokens, skipped_updates, and entropy: the
        token mean over the loss tokens of π_prox's entropy at each sampled position.
        norm_len: overrides the constructor's (see there). routes: [B, L, layers, k] the engine's
        experts (MoE; qurl/train/batch.py pads them): replayed with algo.routing_replay=rollout,
        compared with the learner's own in the moe/ stats (moe_step.py) either way."""
        B, L = tokens.shape
        norm_len = self.norm_len if norm_len is None else norm_len
        if self.algo.agg == "seq-mean-token-sum-norm" and norm_len is None:
            # micro-batches are cut at their longest row: a width-based default would change the
            # loss with the grouping (and from step to step)
            raise ValueError("algo.agg='seq-mean-token-sum-norm' needs a constant norm_len (the "
                             "generation budget): pass norm_len to MegatronLearner or train_step")
        for name, t in (("loss_mask", loss_mask), ("behav_logp", behav_logp)):
            if tuple(t.shape) != (B, L):
                raise ValueError(f"{name} must be [B, L]={B, L}, got {tuple(t.shape)}")
        n_mb = self.algo.mini_batches
        if B % (n_mb * self.dp_size):
            raise ValueError(f"batch of {B} sequences not divisible by algo.mini_batches={n_mb} "
                             f"x learner.dp={self.dp_size}")
        dev = self.device
        tokens, mask = tokens.to(dev, torch.long), loss_mask.to(dev).bool()
        behav, adv = behav_logp.to(dev).float(), adv.to(dev).float()
        staleness = None if staleness is None else staleness.to(dev)
        routes = check_routes(self.routes, routes, (B, L), dev)
        watch = watched_positions(mask) if self.routes is not None else None
        if self.routes is not None:
            self.routes.reset()
        lr = lopt.lr_at(self.optim, self.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        mb = B // n_mb
        # Each row runs up to its last loss token (padding after it never reaches earlier
        # positions under causal attention); at least 2 columns.
        pos = torch.arange(L, device=dev)
        ends = (torch.where(mask, pos, -1).max(dim=1).values + 1).clamp(min=min(2, L))
        starts = first_loss_columns(mask)  # the head runs from each micro-batch's earliest one
        # π_prox is the policy at the start of the step: the first mini-batch's forward runs at
        # those weights, so only the others need the no-grad forward (1/mini_batches saved).
        self.model.eval()
        prox = torch.zeros(B, L, dtype=torch.float32, device=dev)  # rows [:mb]: filled below
        prox_ent = torch.zeros_like(prox)  # π_prox's entropy at each position, the same way
        if n_mb > 1:
            prox[mb:], prox_ent[mb:] = self._dp_logprobs(
                self.model, tokens[mb:], temperature, ends[mb:], starts[mb:], entropy=True,
                routes=None if routes is None else routes[mb:],
                watch=None if watch is None else watch[mb:])
        ref = None if self.ref_model is None else \
            self._dp_logprobs(self.ref_model, tokens, temperature, ends, starts)[0]
        kw = dict(loss_options(self.algo), norm_len=norm_len)
        self.model.train()
        share = mb // self.dp_size  # rows of each mini-batch this DP rank computes
        per_mb: list[dict[str, float]] = []
        norms: list[float] = []
        skipped = 0
        for epoch in range(self.algo.epochs):
            for i in range(n_mb):
                sl = slice(i * mb, (i + 1) * mb)
                if not bool(mask[sl].any()):
                    continue  # nothing to learn from: no optimizer step either (on every rank)
                at_start = epoch == 0 and i == 0  # no update yet: this forward is π_prox
                cut = lambda t: None if t is None else t[sl]  # noqa: E731
                denom = loss_denominator(mask[sl], self.algo.agg)
                self.optimizer.zero_grad()
                own = i * mb + self.dp_rank * share
                logp_own = torch.zeros(share, L, dtype=torch.float32, device=dev)
                ent_own = torch.zeros_like(logp_own)
                for idx, width, start in self._micro_batches(
                        torch.arange(own, own + share, device=dev), ends, starts,
                        self.ep.peer_ends(ends, i * mb, share)):
                    def take(t: torch.Tensor | None) -> torch.Tensor | None:
                        return None if t is None else (t[idx, :width] if t.dim() == 2 else t[idx])

                    logp, ent = self._forward_logp(
                        self.model, take(tokens), temperature, start, entropy=at_start,  # π_prox's
                        routes=None if routes is None else routes[idx, :width],
                        watch=take(watch) if at_start else None)
                    loss, _ = policy_loss(logp, logp.detach() if at_start else take(prox),
                                          take(behav), take(adv), take(mask), ref_logp=take(ref),
                                          staleness=take(staleness), denom=denom, **kw)
                    loss.backward()
                    logp_own[idx - own, :width] = logp.detach()
                    if ent is not None:
                        ent_own[idx - own, :width] = ent
                logp_mb = self._dp_gather(logp_own)
                if at_start:
                    prox[sl], prox_ent[sl] = logp_mb, self._dp_gather(ent_own)
                with torch.no_grad():  # stats of the whole mini-batch, from the same logp
                    _, stats = policy_loss(logp_mb, cut(prox), cut(behav), cut(adv), cut(mask),
                                           ref_logp=cut(ref), staleness=cut(staleness), **kw)
                for p in self._tp_partial:  # the whole gradient on every TP rank, as megatron's
                    dist.all_reduce(p.grad, group=self.tp_group)  # finalize_model_grads does
                norm = self.optimizer.step(self.optim.grad_clip)
                skipped += int(not math.isfinite(norm))
                norms.append(norm)
                per_mb.append(stats)
        self.step += 1
        out = _combine(per_mb)
        out.update(routed_stats(self.routes, self.dp_group))  # also forgets the routes
        n_tok = mask.sum()
        out.update({"lr": lr, "tokens": float(n_tok), "skipped_updates": float(skipped),
                    "entropy": float((prox_ent * mask).sum() / n_tok) if n_tok else float("nan"),
                    "grad_norm": sum(norms) / len(norms) if norms else float("nan"),
                    "grad_norm_max": max(norms) if norms else float("nan"),
                    "grad_norm_last": norms[-1] if norms else float("nan")})
        return out

    def _dp_gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, L] from each DP rank -> [D·n, L] in DP rank order (identity when D = 1)."""
        if self.dp_size == 1:
            return rows
        out = torch.empty((self.dp_size * rows.shape[0], *rows.shape[1:]), dtype=rows.dtype,
                          device=rows.device)
        all_gather_tensor(out, rows.contiguous(), group=self.dp_group)
        return out

    def _dp_logprobs(self, model: torch.nn.Module, tokens: torch.Tensor, temperature: float,
                     ends: torch.Tensor, starts: torch.Tensor, entropy: bool = False,
                     routes: torch.Tensor | None = None, watch: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, L] log-probs, [B, L] entropies or None unless `entropy`) from each row's start to
        its end, each DP rank computing B/D rows (no grad); routes, watch as `_forward_logp`'s."""
        n = tokens.shape[0] // self.dp_size
        mine = slice(self.dp_rank * n, (self.dp_rank + 1) * n)
        cut = lambda t: None if t is None else t[mine]  # noqa: E731
        lp, ent = self._logprobs(model, tokens[mine], temperature, ends[mine], starts[mine], entropy,
                                 cut(routes), cut(watch), self.ep.peer_ends(ends, 0, n))
        return self._dp_gather(lp), None if ent is None else self._dp_gather(ent)

    # ------------------------------------------------------------------ weights out

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every weight, fp32 masters, on this learner's device;
        rank 0 yields, the other ranks yield nothing. A collective (TP, DP when the optimizer is
        sharded, EP with learner.ep > 1: every expert of every EP rank, in ep = 1's order and
        names): every rank must exhaust it. Tied models yield no lm_head.weight. Tensors are
        fresh copies."""
        masters = self.optimizer.full_masters()

        def tp_gathered() -> Iterator[tuple[str, list[torch.Tensor]]]:
            for (name, _), t in zip(self.named_params, masters):
                if convert.partition_dim(name) is not None and self.tp_size > 1:
                    shards = [torch.empty_like(t) for _ in range(self.tp_size)]
                    dist.all_gather(shards, t.contiguous(), group=self.tp_group)
                else:
                    shards = [t]
                yield name, shards

        # learner.ep > 1: every EP rank's experts, under their global names, in ep = 1's order
        for name, shards in self.ep.gather_experts(tp_gathered()):
            if self.tp_rank == 0 and self.dp_rank == 0:
                yield from convert.megatron_param_to_hf(name, shards, self.hf_config)


def _combine(per_mb: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each stat over the mini-batches that report it (max for *_max keys, also per
    staleness bucket, e.g. is_ratio_max/s1). A stat a
    mini-batch has no tokens for (e.g. a staleness bucket) is absent or NaN there and is averaged
    over the others; all-NaN stays NaN."""
    keys = sorted({k for s in per_mb for k in s})
    out = {}
    for k in keys:
        vals = [s[k] for s in per_mb if k in s and not math.isnan(s[k])]
        if not vals:
            out[k] = float("nan")
        else:
            out[k] = max(vals) if k.split("/")[0].endswith("_max") else sum(vals) / len(vals)
    return out
