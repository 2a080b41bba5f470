"""What the run's kind of rollout engine means for the code around it, asked by name.

A run generates with the local torch decoder (rollout.engine = local: local.py) or
through adapters over SGLang servers (rollout.engine = sglang: qurl/engines/sglang/), which qurl
launches or attaches to when sglang.urls names them. The rooms around the engines never need that
choice itself, only its consequences: whether an async worker needs a GPU, what a
full-precision element costs on the wire, whether a worker may hand its receive buffers to the
engine, how long a worker takes to stop. `EngineKind.of(rollout, sglang)` answers each as a
property, so a site names the question it asks and the answer lives here once.

The config's own cross-field rules (qurl/config/rules.py) still read rollout.engine: the config is
the lowest room and imports no engine. This module imports nothing but the config's section types,
so every room above engines may ask it without loading torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qurl.config import RolloutConfig, SGLangConfig


@dataclass(frozen=True)
class EngineKind:
    """rollout.engine and whether sglang.urls attaches running servers (module docstring)."""
    engine: Literal["local", "sglang"]
    """rollout.engine."""
    urls: bool | None
    """sglang.urls names running servers (only read with engine = sglang); None: not known."""

    @classmethod
    def of(cls, rollout: RolloutConfig, sglang: SGLangConfig | None = None) -> EngineKind:
        """The kind of a run's engines from its `rollout` and `sglang` sections. sglang None: a
        caller that asks only about the engine itself (every property but `servers_attached`)."""
        return cls(rollout.engine, None if sglang is None else bool(sglang.urls))

    @property
    def in_process(self) -> bool:
        """The engine is the local torch decoder, computing in the process that builds it (not an
        adapter whose SGLang servers compute)."""
        return self.engine == "local"

    @property
    def runs_on_servers(self) -> bool:
        """The rollout runs on SGLang servers, which a deployment places: launched on free GPUs,
        or attached at sglang.urls."""
        return self.engine == "sglang"

    @property
    def servers_attached(self) -> bool:
        """The engines are running SGLang servers that qurl attaches to (sglang.urls), not ones it
        launches: nothing to export or place, and their workers need no GPU."""
        if self.urls is None:
            raise ValueError("EngineKind.servers_attached: built without the sglang section")
        return self.engine == "sglang" and self.urls

    @property
    def keeps_fp32(self) -> bool:
        """The engine holds full-precision tensors (embeddings, head, norms, biases) in fp32, as
        the learner's masters: the sync sends them unconverted (SGLang servers hold them in their
        --dtype: qurl.engines.factory.engine_wire_dtype)."""
        return self.engine == "local"

    @property
    def wire_element_bytes(self) -> int:
        """Bytes of one full-precision element on the wire, as the memory plan counts them: 4 (the
        local engine's fp32) or 2 (SGLang's bf16 / fp16)."""
        return 4 if self.keeps_fp32 else 2

    @property
    def worker_holds_gpu(self) -> bool:
        """An async worker's engine computes on a GPU the worker takes for itself (local, after the
        learner's: qurl/node/placement.py `worker_gpu`); an SGLang worker drives servers, which
        hold the GPUs."""
        return self.engine == "local"

    @property
    def adopts_receive_buffers(self) -> bool:
        """The engine may take a worker's receive buffers as its weights without a copy (local: two
        banks, qurl/weights/receiver.py); an SGLang adapter keeps the chunks to send them again to
        a restarted server, so each sync needs fresh buffers."""
        return self.engine == "local"

    @property
    def forwards_weights(self) -> bool:
        """An async worker forwards each version to its servers from host memory instead of loading
        it into an engine of its own (SGLang): its weight groups need no GPU, so they run over
        gloo."""
        return self.engine == "sglang"

    @property
    def worker_stop_waits_for_server(self) -> bool:
        """Stopping an async worker waits while it stops the SGLang server it drives (a server in
        its own session, which a killed worker would leave running); a local worker exits at
        once."""
        return self.engine == "sglang"
