"""Tiny random HF Qwen2 / Qwen3 / Llama / Qwen3-MoE / Mixtral models for the Megatron conversion and learner tests.

Weights are drawn from a seeded generator with a wide spread (and non-trivial norm gains and q/k/v
biases) so that logits are far from uniform and every mapped tensor matters.
"""
from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

VOCAB = 100


def qwen2_config(tie: bool = True) -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=tie, max_position_embeddings=64,
                       architectures=["Qwen2ForCausalLM"])


def llama_config() -> LlamaConfig:
    # head_dim 32 != hidden/heads (16): exercises kv_channels; untied embeddings.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       rope_theta=20000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       max_position_embeddings=64, architectures=["LlamaForCausalLM"])


def qwen3_config() -> Qwen3Config:
    # q/k norms; head_dim 32 != hidden/heads (16), as Qwen3-0.6B's 128 != 1024/16; tied.
    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=64, architectures=["Qwen3ForCausalLM"])


_KINDS = {"qwen2": (lambda: qwen2_config(True), Qwen2ForCausalLM),
          "qwen2-untied": (lambda: qwen2_config(False), Qwen2ForCausalLM),
          "qwen3": (qwen3_config, Qwen3ForCausalLM), "llama": (llama_config, LlamaForCausalLM)}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """kind: 'qwen2' (qkv bias, tied) | 'qwen2-untied' | 'qwen3' (q/k norms, tied) | 'llama' (no
    bias, untied). fp32, eval mode."""
    make_config, cls = _KINDS[kind]
    cfg = make_config()
    cfg._attn_implementation = "eager"
    model = cls(cfg)
    return _randomized(model, seed)


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict as a checkpoint holds it: a tied lm_head is not stored."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def qwen3_moe_config(**overrides) -> "Qwen3MoeConfig":
    # Qwen3 attention + 8 experts of width 32, top-2 renormalised (Qwen3-30B-A3B's routing); tied
    from transformers import Qwen3MoeConfig

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=64,
                  architectures=["Qwen3MoeForCausalLM"])
    return Qwen3MoeConfig(**dict(fields, **overrides))


def build_moe(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random Qwen3-MoE (`qwen3_moe_config` + overrides), drawn as `build` draws, with the
    experts run by transformers' eager loop; fp32, eval mode."""
    from transformers import Qwen3MoeForCausalLM

    cfg = qwen3_moe_config(**overrides)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = Qwen3MoeForCausalLM(cfg)
    return _randomized(model, seed)


def mixtral_config(**overrides) -> "MixtralConfig":
    # Llama attention (no q/k norms; head_dim 32 != hidden/heads) + 8 experts of width 32, top-2,
    # always renormalised (Mixtral's routing); tied
    from transformers import MixtralConfig

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_local_experts=8,
                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, max_position_embeddings=64, router_jitter_noise=0.0,
                  sliding_window=None, architectures=["MixtralForCausalLM"])
    return MixtralConfig(**dict(fields, **overrides))


def build_mixtral(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random Mixtral (`mixtral_config` + overrides), drawn as `build` draws, experts run
    by transformers' eager loop; fp32, eval mode."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(**overrides)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return _randomized(MixtralForCausalLM(cfg), seed)


def _randomized(model, seed: int):
    """Seeded weights of a scale a forward stays well-conditioned at: norm gains in [0.5, 1.5),
    everything else N(0, 0.15^2); eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save_llama(d) -> "Path":
    """A tiny random Llama checkpoint (untied, head_dim != hidden/heads, seed 5) with the
    character tokenizer, written to `d`: the dense source of the derived-MoE tests."""
    from qurl.models.tokenizer import build_tokenizer

    build("llama", seed=5).save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    return d


def load_eager(path) -> torch.nn.Module:
    """A checkpoint in fp32 with transformers' per-expert (eager) MoE loop, so that a test's
    hooks see every expert."""
    from qurl.models.hf import load_checkpoint

    model = load_checkpoint(path, dtype=torch.float32)[0]
    model.config._experts_implementation = "eager"
    return model
