"""Will the learner fit? The memory plan of every learner rank, printed before launch.

A run whose learner cannot hold one row of the preset's length fails only after its servers are
up and its first rollout is done — on the paper's lengths, an hour in. This module prices each
learner rank with the checked cost model (membudget.py) before anything starts:

- weights (model dtype), gradients (plus a tied head's second gradient), fp32 master weights and
  AdamW moments (DP-sharded with deploy.ranks.distributed_optimizer) and the step's flat fp32 gradient;
  for a mixture of experts (Qwen3-MoE) every layer's router (E x H, replicated over TP) and
  E/ep of its experts (3·I·H each: gate, up, down; I/tp rows on each TP rank): expert parallelism
  (learner.ep, qurl/learner/expert_parallel.py) gives each rank E/ep experts, whose fp32 masters
  and moments are sharded over the dp/ep ranks holding the same experts (expert-DP) where the
  dense parameters' are sharded over dp;
- the frozen reference model when algo.kl_coef > 0;
- on learner rank 0, the weight sync's device staging: its copies of the 8-bit model (two
  alternating arenas, the SGLang adapter's kept copy: ~3 bytes per parameter of the whole model)
  live in pinned host memory (qurl/weights/host.py), so the GPU holds only the two buffers a bucket is
  staged through: each max(deploy.sync.bucket_mb, the largest single tensor on the wire — the
  embedding or head in the engines' dtype);
- one micro-batch of one row at the run's length L = `prompt_tokens` + rollout.max_new_tokens,
  at the run's attention (TE or SDPA: no L x L scores; unfused) and learner.recompute. A token of
  a mixture of experts runs k of the E experts, so its MLP activations are those of a dense SwiGLU
  of width k·I (`token_cost_from_fields`), whatever E is; the dispatcher's permuted copies of the
  token (k·H in and out of the experts) and the router's E scores are not priced (not measured).

What it reads of the config: `[model]` (dtype; base, for the shape), `[learner]` (tp, dp, ep,
recompute), `[rollout]` (max_new_tokens, engine), `[deploy]` (ranks.attention,
ranks.distributed_optimizer, sync.bucket_mb) and algo.kl_coef, passed as those sections and that
value. `plan_ranks` returns the per-rank figures; `render` prints them with the rows per
micro-batch the rest of the memory allows; `refusal` says in one line why a plan cannot fit at one row per
micro-batch and which field to change (learner.tp, learner.ep, learner.recompute, the length),
and for a MoE what its experts take. The model's shape comes from the checkpoint's config.json, or for the
presets' hub ids, which are not on disk before a run, from their published config fields
(`KNOWN_SHAPES`).

`param_counts` gives a model's whole and per-token (active) parameter counts from the same
arithmetic: for Qwen3-30B-A3B 30.53B and 3.35B, the model card's "30.5B" and "3.3B"
(tests/test_moe_at_scale.py checks both, and a built tiny Qwen3-MoE's count exactly).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from qurl.config import DeployConfig, LearnerConfig, ModelConfig, RanksDeployConfig, RolloutConfig
from qurl.engines.kind import EngineKind
from qurl.learner.membudget import GPU_FRACTION, TokenCost, fixed_bytes, grad_bytes, rows_per_micro

GB = 1e9
RESERVE = 2 * 2**30  # CUDA context, NCCL buffers and allocator slack: never planned for tensors
PROMPT_TOKENS = 512  # prompt tokens assumed in front of rollout.max_new_tokens

# config.json fields (as published with the checkpoints) of the paper presets' bases
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"]),
    "Qwen/Qwen2.5-Math-7B": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"]),
    # Qwen3-30B-A3B's config.json (huggingface.co/Qwen/Qwen3-30B-A3B, the model card's file): 48
    # layers, each 32 query / 4 KV heads of 128 and 128 routed experts of width 768, 8 per token
    # (top-8 renormalised, norm_topk_prob); no dense MLP layer (decoder_sparse_step 1, no
    # mlp_only_layers), so intermediate_size (6144) is unused; q/k norms as every Qwen3.
    "Qwen/Qwen3-30B-A3B": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]),
}


@dataclass(frozen=True)
class RankPlan:
    """One learner rank's planned bytes (module docstring)."""
    rank: int
    weights: float  # model weights, their gradients, a KL reference copy
    optimizer: float  # fp32 masters, AdamW moments, the step's flat gradient
    sync: float  # rank 0: the weight sync's two device staging buffers (host copies not counted)
    row: float  # one micro-batch of one row at width L
    L: int
    rows: int  # rows per micro-batch the remaining memory allows (>= 1 even when it does not fit)
    fits: bool
    params: int = 0  # parameters on this rank
    experts: int = 0  # a MoE's routed experts per layer on this rank (0: dense): E / ep
    expert_params: int = 0  # the parameters of those experts, every layer's
    expert_bytes: float = 0.0  # their weights, gradients and optimizer state (part of fixed)
    ep: int = 1  # learner.ep: the model has experts * ep routed experts per layer

    @property
    def fixed(self) -> float:
        return self.weights + self.optimizer + self.sync


def _mlp(f: dict[str, Any]) -> tuple[int, int, int]:
    """One layer's MLP as (elements split over TP, elements on every TP rank, routed experts E
    (0 for a dense MLP)). Dense: gate, up, down [I, H] each. Qwen3-MoE: E experts of the same three
    matrices at I = moe_intermediate_size, and the router [E, H], which megatron replicates."""
    from qurl.models.convert import dims, is_moe
    from qurl.models.moe import moe_dims

    cfg = SimpleNamespace(**f)
    d = dims(cfg)  # d["I"]: one expert's width for a MoE
    if not is_moe(cfg):
        return 3 * d["I"] * d["H"], 0, 0
    E = moe_dims(cfg)["E"]
    return 3 * d["I"] * d["H"], E * d["H"], E


def _params(f: dict[str, Any], tp: int, vocab_pad: int, ep: int = 1) -> tuple[int, int, int]:
    """(parameters on one TP rank, of the whole model, tied-head elements on one rank); a MoE's
    experts divided over `ep` expert-parallel ranks (learner.ep; 1: every rank holds all E)."""
    from qurl.models.convert import dims, qk_norm, qkv_bias

    cfg = SimpleNamespace(**f)
    d = dims(cfg)
    h, q, kv = d["H"], d["nh"] * d["hd"], d["ng"] * d["hd"]
    expert, router, E = _mlp(f)
    bias = (q + 2 * kv) if qkv_bias(cfg) else 0
    norms = 2 * h + (2 * d["hd"] if qk_norm(cfg) else 0)  # replicated on every TP rank
    attn = (q + 2 * kv) * h + bias + q * h  # split over TP
    mlp_rank = expert * (E // ep if E else 1) // tp + router
    layer = attn // tp + mlp_rank + norms
    tied = bool(f.get("tie_word_embeddings", False))
    embed = vocab_pad * h // tp * (1 if tied else 2)
    per_rank = d["L"] * layer + embed + h
    whole = d["L"] * (attn + expert * max(E, 1) + router + norms) + embed * tp + h
    return per_rank, whole, (vocab_pad // tp * h if tied else 0)


def param_counts(f: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, those one token uses) of the model whose config.json fields are `f`, at the
    unpadded vocabulary (as the checkpoint holds it): a MoE token runs k of the E experts (and the
    whole router); a dense model uses all of them."""
    from qurl.models.convert import dims, is_moe
    from qurl.models.moe import moe_dims

    _, whole, _ = _params(f, 1, int(f["vocab_size"]))
    cfg = SimpleNamespace(**f)
    if not is_moe(cfg):
        return whole, whole
    m, expert = moe_dims(cfg), _mlp(f)[0]
    return whole, whole - dims(cfg)["L"] * (m["E"] - m["k"]) * expert


def token_cost_from_fields(f: dict[str, Any], *, tp: int, elem: int, attention: str,
                           recompute: str) -> TokenCost:
    """membudget.TokenCost of one TP rank of the model whose config.json fields are `f`; a MoE's
    token runs k experts of width I: its MLP activations are a dense SwiGLU's of width k·I."""
    from qurl.models.convert import dims, is_moe, padded_vocab_size
    from qurl.models.moe import moe_dims

    cfg = SimpleNamespace(**f)
    d = dims(cfg)
    ffn = d["I"] * (moe_dims(cfg)["k"] if is_moe(cfg) else 1)
    return TokenCost(padded_vocab_size(int(f["vocab_size"]), tp) // tp, layers=d["L"],
                     hidden=d["H"], heads=d["nh"], groups=d["ng"], head_dim=d["hd"], ffn=ffn,
                     tp=tp, elem=elem, attention=attention, recompute=recompute)


def attention_kind(ranks: RanksDeployConfig, te: bool) -> str:
    """'flash' (TE or SDPA) or 'unfused', as the learner will build it."""
    return "flash" if te or ranks.attention == "sdpa" else "unfused"


def plan_ranks(model: ModelConfig, learner: LearnerConfig, rollout: RolloutConfig,
               deploy: DeployConfig, fields: dict[str, Any], gpu_bytes: float, *, kl_coef: float,
               te: bool = False, prompt_tokens: int = PROMPT_TOKENS,
               reserve: float = RESERVE) -> list[RankPlan]:
    """Every learner rank's plan (TP rank order within DP replica 0; DP replicas hold the same);
    kl_coef: algo.kl_coef (> 0: a frozen reference copy)."""
    from qurl.models.convert import padded_vocab_size

    tp, dp, ep = learner.tp, learner.dp, learner.ep
    elem = 2 if model.dtype == "bfloat16" else 4
    cost = token_cost_from_fields(fields, tp=tp, elem=elem,
                                  attention=attention_kind(deploy.ranks, te),
                                  recompute=learner.recompute)
    vocab_pad = padded_vocab_size(int(fields["vocab_size"]), tp)
    per_rank, _, tied = _params(fields, tp, vocab_pad, ep)
    expert, _, E = _mlp(fields)
    experts = int(fields["num_hidden_layers"]) * (E // ep) * expert // tp  # this rank's E/ep
    distributed = deploy.ranks.distributed_optimizer
    # the experts' optimizer state is sharded over expert-DP (dp/ep ranks), the rest over dp
    expert_bytes = fixed_bytes(experts, elem, dp // ep, distributed) + (experts * elem if kl_coef > 0 else 0)
    L = prompt_tokens + rollout.max_new_tokens
    ref = per_rank * elem if kl_coef > 0 else 0
    weights = per_rank * elem + grad_bytes(per_rank, elem, tied) + ref
    optimizer = (fixed_bytes(per_rank - experts, elem, dp, distributed)
                 + fixed_bytes(experts, elem, dp // ep, distributed) - 2 * per_rank * elem)
    # the largest wire tensor: embedding / head rows in bf16 (SGLang) or fp32 (the local engine)
    wire_elem = EngineKind.of(rollout).wire_element_bytes
    largest = int(fields["vocab_size"]) * int(fields["hidden_size"]) * wire_elem
    staging = 2.0 * max(deploy.sync.bucket_mb * 2**20, largest)
    out = []
    for rank in range(tp * dp):
        sync = staging if rank == 0 else 0.0
        left = gpu_bytes - reserve - weights - optimizer - sync
        fits = cost.micro_bytes(1, L) <= GPU_FRACTION * left
        rows = rows_per_micro(L, cost, max(left, 0), 0)
        out.append(RankPlan(rank, weights, optimizer, sync, cost.micro_bytes(1, L), L, rows, fits,
                            params=per_rank, experts=E // ep if E else 0, expert_params=experts,
                            expert_bytes=expert_bytes, ep=ep))
    return out


def longest_fit(model: ModelConfig, learner: LearnerConfig, rollout: RolloutConfig,
                deploy: DeployConfig, fields: dict[str, Any], gpu_bytes: float, *, kl_coef: float,
                te: bool = False, prompt_tokens: int = PROMPT_TOKENS) -> int:
    """The largest rollout.max_new_tokens (a multiple of 256; 0 if none) at which every learner
    rank holds one row, all else as given (plan_ranks' arguments)."""
    def fits(n: int) -> bool:
        r = replace(rollout, max_new_tokens=n)
        return all(p.fits for p in plan_ranks(model, learner, r, deploy, fields, gpu_bytes,
                                              kl_coef=kl_coef, te=te, prompt_tokens=prompt_tokens))

    lo, hi = 0, 1 << 10  # in 256-token steps: up to 262,144 tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * 256) else (lo, mid - 1)
    return lo * 256


def _count(n: int) -> str:
    """7.64B, 6.2M: a parameter count as a reader says it."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def render(plans: list[RankPlan], memory: str, gpu: bool = True) -> str:
    """The plan as printed by `qurl launch --dry-run` and `qurl train` (`memory`: what each rank
    is planned against, in words)."""
    head = (f"{RESERVE / GB:.1f} GB reserved for CUDA/NCCL, micro-batches use "
            f"{GPU_FRACTION:.0%} of the rest; " if gpu else "")
    lines = [f"# learner memory plan ({memory}; {head}rows of L = {plans[0].L} tokens: "
             f"{PROMPT_TOKENS} assumed prompt + rollout.max_new_tokens)"]
    seen: set[tuple] = set()
    for p in plans:
        key = (p.weights, p.optimizer, p.sync, p.row)
        if key in seen:
            continue  # ranks with the same figures are printed once
        seen.add(key)
        same = [q.rank for q in plans if (q.weights, q.optimizer, q.sync, q.row) == key]
        who = f"rank {same[0]}" if len(same) == 1 else f"ranks {same[0]}-{same[-1]}"
        verdict = "DOES NOT FIT at 1 row" if not p.fits else \
            f"fits, room for {p.rows} rows" if gpu else "fits"
        lines.append(f"#   {who:12s} weights+grads {p.weights / GB:6.1f} GB  optimizer "
                     f"{p.optimizer / GB:6.1f} GB  sync {p.sync / GB:5.1f} GB  one row "
                     f"{p.row / GB:6.1f} GB  = {(p.fixed + p.row) / GB:6.1f} GB: {verdict}")
    p = plans[0]
    if p.experts:
        share = (f"its share of all {p.experts} experts of every layer (" if p.ep == 1 else
                 f"its {p.experts} of the {p.experts * p.ep} experts of every layer "
                 f"(learner.ep={p.ep}; ")
        lines.append(f"#   every rank holds {_count(p.params)} parameters, {_count(p.expert_params)} "
                     f"of them {share}{p.expert_bytes / GB:.1f} GB with their gradients and "
                     f"optimizer state)")
    if gpu:
        lines.append(f"#   micro-batches: {min(p.rows for p in plans)} rows each (the minimum over "
                     f"the ranks: every rank runs the same plan)")
    return "\n".join(lines)


def refusal(learner: LearnerConfig, rollout: RolloutConfig, ranks: RanksDeployConfig,
            fields: dict[str, Any], plans: list[RankPlan], gpu_bytes: float) -> str | None:
    """One line when some rank cannot hold one row, naming the fields that would change it; for a
    mixture of experts also what its experts take on the rank and the learner.ep that would divide
    them further (the only way to hold fewer of them: learner.tp is not open to a MoE), or, when
    learner.dp leaves no larger one, that expert parallelism needs more data-parallel ranks."""
    bad = [p for p in plans if not p.fits]
    if not bad:
        return None
    p = max(bad, key=lambda q: q.fixed + q.row)
    heads, groups = int(fields["num_attention_heads"]), int(fields.get("num_key_value_heads")
                                                             or fields["num_attention_heads"])
    fixes = []
    bigger = [t for t in (2, 4, 8) if t > learner.tp and heads % t == 0 and groups % t == 0]
    if bigger and not p.experts:  # a MoE trains at TP 1 only (qurl/models/fits.py check_moe_run)
        fixes.append(f"learner.tp={bigger[0]} (now {learner.tp})")
    if learner.recompute != "full":
        fixes.append(f"learner.recompute=full (now {learner.recompute})")
    if ranks.attention == "unfused":
        fixes.append("deploy.ranks.attention=sdpa (now unfused)")
    fixes.append(f"a shorter rollout.max_new_tokens (now {rollout.max_new_tokens})")
    room = gpu_bytes - RESERVE - p.fixed
    line = (f"learner rank {p.rank} needs {(p.fixed + p.row) / GB:.1f} GB for one {p.L}-token row "
            f"({p.fixed / GB:.1f} GB weights, optimizer and sync + {p.row / GB:.1f} GB the row) "
            + (f"but a {gpu_bytes / GB:.0f} GB GPU leaves {GPU_FRACTION * room / GB:.1f} GB for it"
               if room > 0 else f"but a {gpu_bytes / GB:.0f} GB GPU holds "
               f"{(gpu_bytes - RESERVE) / GB:.1f} GB after the reserve"))
    if not p.experts:
        return f"{line}: set {' or '.join(fixes)}"
    E = p.experts * p.ep
    wider = [e for e in range(p.ep + 1, learner.dp + 1) if learner.dp % e == 0 and E % e == 0]
    held = (f"{'all' if p.ep == 1 else f'its {p.experts} of the'} {E} experts of every layer take "
            f"{p.expert_bytes / GB:.1f} GB with their gradients and optimizer state")
    ep = (f"{held}: set learner.ep={wider[0]} (now {p.ep}; expert parallelism divides them over "
          f"the data-parallel ranks)" if wider else
          f"{held}, and expert parallelism (learner.ep, which must divide learner.dp="
          f"{learner.dp}) has no more data-parallel ranks to divide them over: raise learner.dp")
    if room <= 0:  # no length or recompute makes room: only fewer experts per rank would
        return f"{line}: {ep}"
    return f"{line}: set {' or '.join(fixes)}; or {ep}"


def model_fields(base: str) -> dict[str, Any] | None:
    """config.json fields of model.base: a checkpoint dir, a local preset, a fetched registered
    model, or a paper preset's hub id (KNOWN_SHAPES); None when none of these is here."""
    from qurl.errors import InputError
    from qurl.models.fits import read_fields
    from qurl.models.registry import MODELS, model_path

    if base in KNOWN_SHAPES:
        return dict(KNOWN_SHAPES[base])
    for where in ((str(model_path(base)),) if base in MODELS else ()) + (base,):
        try:
            return read_fields(where)
        except InputError:
            continue
    return None


def plan_text(model: ModelConfig, learner: LearnerConfig, rollout: RolloutConfig,
              deploy: DeployConfig, memory_bytes: float, memory: str, *, kl_coef: float,
              gpu: bool = True, te: bool = False,
              prompt_tokens: int = PROMPT_TOKENS) -> tuple[str, str | None]:
    """(the printed plan, a one-line refusal or None) for these sections (plan_ranks') with
    `memory_bytes` per learner rank (a GPU's, or on CPU a share of the host's: no reserve, no
    refusal)."""
    fields = model_fields(model.base)
    if fields is None:
        return (f"# learner memory plan: skipped: model.base={model.base!r} has no config.json "
                f"here to read its shape from", None)
    plans = plan_ranks(model, learner, rollout, deploy, fields, memory_bytes, kl_coef=kl_coef,
                       te=te, prompt_tokens=prompt_tokens, reserve=RESERVE if gpu else 0.0)
    text = render(plans, f"{memory} {memory_bytes / GB:.0f} GB", gpu)
    if gpu:
        longest = longest_fit(model, learner, rollout, deploy, fields, memory_bytes,
                              kl_coef=kl_coef, te=te, prompt_tokens=prompt_tokens)
        text += (f"\n#   longest rollout.max_new_tokens at which every rank holds one row: {longest:,}"
                 f" (learner.recompute={learner.recompute})")
    if not gpu:
        return text, None
    return text, refusal(learner, rollout, deploy.ranks, fields, plans, memory_bytes)
