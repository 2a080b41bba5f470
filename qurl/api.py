"""qurl's public Python face: what code outside the product may use (the studies, the benchmarks,
a user's notebook). The command line (cli.py) is the other entry point.

Research code (qurl/research/studies, qurl/research/bench) imports the product only from here (tests/test_layout.py
checks it), so the product's rooms can be rearranged by changing this file alone. Each name is
re-exported from the room that owns it; grouped by what a caller wants to do:

- configure and run: load a config, override fields, train a run (the synchronous loop), read
  what a run directory holds (its config, metrics), plot runs;
- models and data: resolve a model name to a checkpoint, build / read HF models, the math sets,
  rewards, the synthetic tasks;
- generate: make the configured engine, the local engine and its 8-bit kernels, rollouts;
- learn: the Megatron learner, its process group, the memory model;
- quantize and sync: the 8-bit formats, UAQ, flips, the weight sync (sender, receiver, group,
  delta encoding, digests);
- stream: the trajectory wire format and channel;
- the algorithm: the loss, its corrections, ratio statistics.

Names resolve on first use (`from qurl.api import LocalEngine` imports the local engine, not
megatron): reading a run's tables must not pay for the learner's imports.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> "module" (same name there), "module:name", or "module:*" (the module itself)
FACE: dict[str, str] = {
    "CUT_PRESETS": "qurl.algo.corrections",
    "Correction": "qurl.algo.corrections",
    "is_weights": "qurl.algo.corrections",
    "policy_loss": "qurl.algo.loss",
    "ratio_stats": "qurl.algo.stats",
    "read_config": "qurl.checkpoint.rundir",
    "CheckpointDir": "qurl.checkpoint.rundir",
    "TRAINING_SECTIONS": "qurl.config",
    "AlgoConfig": "qurl.config",
    "Config": "qurl.config",
    "ConfigError": "qurl.config",
    "DeployConfig": "qurl.config",
    "LearnerConfig": "qurl.config",
    "ModelConfig": "qurl.config",
    "OptimConfig": "qurl.config",
    "leaves": "qurl.config",
    "load_config": "qurl.config",
    "override": "qurl.config",
    "to_toml": "qurl.config",
    "validate": "qurl.config",
    "first_box_close": "qurl.data.rewards",
    "score": "qurl.data.rewards",
    "load_datasets": "qurl.data.splits",
    "load_eval_sets": "qurl.data.splits",
    "arithmetic_task": "qurl.data.synthetic",
    "worked_solution": "qurl.data.synthetic",
    "make_engine": "qurl.engines.factory",
    "engine_wire_dtype": "qurl.engines.factory",
    "run_ranks": "qurl.deploy.ranks",
    "Evaluator": "qurl.evaluation.suite",
    "fbgemm_int8_available": "qurl.engines.kernels",
    "fbgemm_int8_product": "qurl.engines.kernels",
    "fbgemm_pack": "qurl.engines.kernels",
    "int8_matmul": "qurl.engines.kernels",
    "scaled_mm_available": "qurl.engines.kernels",
    "LINEAR_KINDS": "qurl.engines.local",
    "LocalEngine": "qurl.engines.local",
    "from_linear": "qurl.engines.qlinear",
    "learner_internals": "qurl.learner.megatron:*",
    "destroy_learner_dist": "qurl.learner.dist",
    "free_port": "qurl.learner.dist",
    "init_learner_dist": "qurl.learner.dist",
    "spawn": "qurl.learner.dist",
    "MegatronLearner": "qurl.learner.megatron",
    "grad_bytes": "qurl.learner.membudget",
    "token_cost_from_fields": "qurl.learner.memory_plan",
    "build_base_apart": "qurl.models.base",
    "builds_base": "qurl.models.base",
    "build_model": "qurl.models.hf",
    "load_checkpoint": "qurl.models.hf",
    "param_count": "qurl.models.hf",
    "read_state_dict": "qurl.models.hf",
    "MODELS": "qurl.models.registry",
    "resolve_base": "qurl.models.registry",
    "flip_fractions": "qurl.quant.flips",
    "all_finite": "qurl.quant.formats",
    "quantize_per_token": "qurl.quant.formats",
    "engine_chunks": "qurl.quant.named",
    "is_quantized_linear": "qurl.quant.named",
    "quantize_named": "qurl.quant.named",
    "apply_uaq": "qurl.quant.uaq",
    "build_batch": "qurl.rollout.batch",
    "rollout": "qurl.rollout.generate",
    "PromptCodec": "qurl.rollout.requests",
    "Receiver": "qurl.stream.channel",
    "Sender": "qurl.stream.channel",
    "pack_trajectories": "qurl.stream.payload",
    "unpack_trajectories": "qurl.stream.payload",
    "validate_packed": "qurl.stream.payload",
    "DTYPES": "qurl.stream.frames",
    "compute_mac": "qurl.stream.frames",
    "tensor_frame": "qurl.stream.frames",
    "ArenaQuantizer": "qurl.weights.arena",
    "ChunkArena": "qurl.weights.arena",
    "WeightSync": "qurl.weights.publish",
    "WeightReceiver": "qurl.weights.receiver",
    "train": "qurl.train.inline",
    "read_metrics": "qurl.train.metrics_log",
    "plot_runs": "qurl.train.report",
    "apply_positions": "qurl.weights.delta",
    "sync_memory": "qurl.weights.host",
    "changed_positions": "qurl.weights.delta",
    "changed_positions_bytewise": "qurl.weights.delta",
    "check_delta": "qurl.weights.delta",
    "delta_nbytes": "qurl.weights.delta",
    "diff_named": "qurl.weights.delta",
    "encode_named": "qurl.weights.delta",
    "group_delta_chunks": "qurl.weights.delta",
    "combine": "qurl.weights.digest",
    "named_digests": "qurl.weights.digest",
    "WeightGroup": "qurl.weights.group",
    "WeightSender": "qurl.weights.sender",
}

__all__ = sorted(FACE)


def __getattr__(name: str) -> Any:
    try:
        target = FACE[name]
    except KeyError:
        raise AttributeError(f"qurl.api has no {name!r}: the public face is qurl.api.FACE") from None
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    value = mod if attr == "*" else getattr(mod, attr or name)
    globals()[name] = value
    return value
