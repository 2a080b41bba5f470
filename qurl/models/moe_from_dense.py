"""A mixture-of-experts model made from a dense Llama: each SwiGLU MLP split into E experts (Mixtral).

Why. The 8-bit engine and the full-precision learner disagree most on a MoE (a rounding error can
move a token to another expert), but a randomly initialised tiny MoE carries almost none of a real
model's mismatch: its weights and activations have none of a trained model's outliers. Splitting a
trained dense model's MLP gives a MoE whose every expert is trained weights (issue 67).

The split (upcycling without training). A dense SwiGLU MLP of width I is a sum over its neurons j:

    mlp(x) = sum_j  down[:, j] * silu(gate[j] . x) * (up[j] . x)

Partition the neurons into E groups of I/E: expert e's gate / up are its neurons' rows of gate /
up, its down their columns of down, multiplied by k (the top-k). A Mixtral layer computes
y = sum_{e in S} w_e * expert_e(x) with w the renormalised top-k of softmax(W_r x). With every
expert active (k = E) and a zero router every w_e = 1/E, so y = sum_e (1/E) * E * group_e(x) =
mlp(x): the derived model *is* the dense model (tested against its logits in fp32). With k < E
and top-k weights near 1/k the token gets k * (1/k) * its k groups: the dense MLP restricted to
those neurons. (Multiplying down by E instead, as this file once did, makes that E/k times too
large: 4x at top-2 of 8.)

Which neurons, which router (`method`):
- "cluster" (the default): MoEfication (qurl/models/moe_calibrate.py). The dense model runs on
  calibration text the project owns (gsm8k_test questions in the chat template with their
  reference answers); the neurons are grouped by balanced k-means of their |activation| patterns
  (neurons large on the same tokens share an expert), and the router is the least-squares fit
  from the MLP input to each expert's relative contribution ||down_e a_e||, times `router_scale`
  (default ROUTER_SCALE = 0.03; the logits rank the experts, their scale sets how far the top-k
  weights are from 1/k: the flatter the closer to the dense MLP on those neurons, measured in
  docs/moe.md). Below k = E each layer's down is then refitted by ridge least squares so that the
  kept experts' output approaches the dense MLP's on the calibration tokens (the dropped neurons'
  share carried by the kept ones); at k = E it is the dense down. Deterministic given `seed`
  (the k-means start).
- "blocks": expert e takes the consecutive neurons e*I/E .. (e+1)*I/E - 1, and W_r [E, H] is drawn
  N(0, 1) from the seeded generator, per layer scaled by `router_scale / (sqrt(H) * rms(g))` (g the
  post-attention RMSNorm gain): logits of std ~`router_scale` on a unit-RMS input. Arbitrary
  neurons: at top-2 of 8 not a language model (docs/moe.md).
`router_scale=0` gives the zero router of the equality above.

The result is a `MixtralForCausalLM` checkpoint (transformers' Mixtral is Llama's attention plus
that sparse MLP; Qwen3-MoE cannot hold it, its attention always normalises q and k): config.json
(the dense config's attention, norms, RoPE, vocabulary and tie; `intermediate_size` = I/E,
`num_local_experts` = E, `num_experts_per_tok` = k, no router jitter, no sliding window), the
weights under Mixtral's checkpoint names in the source's dtype (the down columns are multiplied by
k in fp32 and cast back: exact for k a power of two, barring overflow), the source's tokenizer,
chat template and generation config, and `derived.json` recording how it was made.

Refused in one line (ValueError): a source that is not a Llama checkpoint, E that does not divide
I, k outside [2, E] (top-1 renormalised has no megatron twin, qurl/models/moe.py), linear biases,
an unknown method, a negative or non-finite router_scale.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from qurl.models.hf import check_checkpoint, read_state_dict, write_state_dict
from qurl.models.moe import to_disk

DERIVED = "derived.json"
# the fitted router's logits multiplier: top-k weights within a few % of 1/k (docs/moe.md)
ROUTER_SCALE = 0.03
_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
         "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
# dense Llama config.json fields a Mixtral config carries over unchanged
_KEEP = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
         "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings", "bos_token_id",
         "eos_token_id", "pad_token_id", "attention_dropout", "initializer_range", "use_cache")


def split_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, experts: int, *,
              top_k: int | None = None, perm: torch.Tensor | None = None
              ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One dense SwiGLU MLP as `experts` experts (module docstring): gate, up [I, H], down [H, I]
    -> per expert (gate [I/E, H], up [I/E, H], down [H, I/E] times k), in the input dtype.
    perm [I]: expert e takes neurons perm[e*I/E : (e+1)*I/E] (default: consecutive blocks);
    top_k: the down scale k (default E: every expert active)."""
    I = gate.shape[0]
    if I % experts:
        raise ValueError(f"intermediate_size={I} is not divisible by experts={experts}")
    if perm is None:
        perm = torch.arange(I)
    elif not torch.equal(perm.sort().values, torch.arange(I)):
        raise ValueError(f"perm is not a permutation of the {I} neurons")
    w = I // experts
    scaled = (down.float() * (experts if top_k is None else top_k)).to(down.dtype)
    cols = perm.reshape(experts, w)
    return [(gate[c].clone(), up[c].clone(), scaled[:, c].clone()) for c in cols]


def router_weight(norm_gain: torch.Tensor, experts: int, gen: torch.Generator,
                  router_scale: float) -> torch.Tensor:
    """A router [E, H] (fp32) whose logits have std ~router_scale on a unit-RMS input times
    `norm_gain` [H] (module docstring); zeros for router_scale 0."""
    H = norm_gain.shape[0]
    draw = torch.randn(experts, H, generator=gen)
    rms = float(norm_gain.float().pow(2).mean().sqrt())
    return draw * (router_scale / (math.sqrt(H) * max(rms, 1e-12)))


def mixtral_config(dense: dict[str, Any], *, experts: int, top_k: int) -> dict[str, Any]:
    """config.json fields of the derived Mixtral from a dense Llama's (module docstring)."""
    out = {k: dense[k] for k in _KEEP if k in dense}
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               intermediate_size=int(dense["intermediate_size"]) // experts,
               num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
               sliding_window=None, output_router_logits=False, router_aux_loss_coef=0.0)
    if "torch_dtype" in dense or "dtype" in dense:
        out["torch_dtype"] = dense.get("torch_dtype") or dense.get("dtype")
    return out


def _check_source(src: Path, dense: dict[str, Any], experts: int, top_k: int) -> None:
    if "LlamaForCausalLM" not in (dense.get("architectures") or []):
        raise ValueError(f"{src}: architectures={dense.get('architectures')}; a MoE is derived "
                         "from a dense LlamaForCausalLM only")
    if dense.get("attention_bias") or dense.get("mlp_bias"):
        raise ValueError(f"{src}: attention_bias/mlp_bias set; Mixtral has no linear biases")
    if experts < 2 or int(dense["intermediate_size"]) % experts:
        raise ValueError(f"experts={experts}: must be >= 2 and divide intermediate_size="
                         f"{dense['intermediate_size']}")
    if not 2 <= top_k <= experts:
        raise ValueError(f"top_k={top_k}: must be in [2, experts={experts}] (top-1 renormalised "
                         "gives every token weight 1; megatron-core has no such router)")


METHODS = ("cluster", "blocks")


def derive_moe(src: str | Path, out: str | Path, *, experts: int = 8, top_k: int = 4,
               seed: int = 0, method: str = "cluster", router_scale: float | None = None,
               calib_tokens: int = 3000) -> Path:
    """Write the Mixtral derived from dense Llama checkpoint `src` into `out` (module docstring);
    deterministic given `seed`. Written to `<out>.tmp` and renamed. Returns `out`.

    method "cluster": co-activation partition and least-squares router from `calib_tokens`
    calibration tokens (qurl/models/moe_calibrate.py), router times `router_scale` (default
    ROUTER_SCALE); "blocks": consecutive blocks and a seeded random router whose logits have std
    ~`router_scale` (default 1). Either way down is multiplied by top_k."""
    src, out = Path(src), Path(out)
    dense = check_checkpoint(src)
    _check_source(src, dense, experts, top_k)
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {', '.join(METHODS)}")
    if router_scale is None:
        router_scale = ROUTER_SCALE if method == "cluster" else 1.0
    if not math.isfinite(router_scale) or router_scale < 0:
        raise ValueError(f"router_scale={router_scale}: must be finite and >= 0")
    state = read_state_dict(src)
    layers = int(dense["num_hidden_layers"])
    record: dict[str, Any] = {"source": str(src), "experts": experts, "top_k": top_k,
                              "seed": seed, "method": method, "router_scale": router_scale,
                              "down_scale": f"x top_k = {top_k}"}
    if method == "cluster":
        from qurl.models.moe_calibrate import calibrate

        perms, routers, downs, stats = calibrate(src, experts, top_k, seed=seed,
                                                 tokens=calib_tokens)
        routers = [r * router_scale for r in routers]
        record.update(partition="balanced k-means of |activation| patterns (moe_calibrate.py)",
                      router="least squares to relative expert contributions, x router_scale",
                      down="least-squares refit for the kept experts (k < E), then x top_k",
                      **stats)
    else:
        gen = torch.Generator().manual_seed(seed)
        perms, downs = [None] * layers, [None] * layers
        routers = [router_weight(state[f"model.layers.{i}.post_attention_layernorm.weight"],
                                 experts, gen, router_scale) for i in range(layers)]
        record.update(partition="expert e = dense MLP neurons [e*I/E, (e+1)*I/E)",
                      router="seeded N(0,1), logits std ~router_scale")
    moe_state: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".mlp." not in name:
            moe_state[name] = t
    for i in range(layers):
        p = f"model.layers.{i}."
        down = state[p + "mlp.down_proj.weight"]
        if downs[i] is not None:
            down = downs[i].to(down.dtype)
        parts = split_mlp(state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"],
                          down, experts, top_k=top_k, perm=perms[i])
        for e, (g, u, d) in enumerate(parts):
            for proj, w in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
                moe_state[f"{p}mlp.experts.{e}.{proj}.weight"] = w
        gain = state[p + "post_attention_layernorm.weight"]
        moe_state[p + "mlp.gate.weight"] = routers[i].to(gain.dtype)
        if perms[i] is not None:
            record.setdefault("perms", []).append(perms[i].tolist())
    config = mixtral_config(dense, experts=experts, top_k=top_k)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_state_dict(tmp, to_disk(moe_state, config))  # Mixtral's checkpoint names
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPY:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    (tmp / DERIVED).write_text(json.dumps(record) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.models.moe_from_dense",
                                description="derive a Mixtral MoE from a dense Llama checkpoint")
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", choices=METHODS, default="cluster",
                   help="cluster: calibrated partition and fitted router; blocks: consecutive "
                        "blocks and a random router")
    p.add_argument("--router-scale", type=float, default=None,
                   help=f"router logits' scale (default {ROUTER_SCALE} for cluster, 1 for blocks)")
    p.add_argument("--calib-tokens", type=int, default=3000)
    a = p.parse_args(argv)
    print(derive_moe(a.src, a.out, experts=a.experts, top_k=a.top_k, seed=a.seed,
                     method=a.method, router_scale=a.router_scale, calib_tokens=a.calib_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
