"""A rollout worker process: one engine, fed prompts by the controller, streaming trajectories back.

    python -m qurl.pipeline.worker --run-dir runs/<run> --slot 0 [--host H] [--parent-pid PID]

The worker reads the run's config, stream key and the controller's endpoint from the run directory
(session.py), builds its engine from the model dir the controller names (the local
engine, or an SGLang adapter driving this slot's one server: each weight version then goes
controller -> worker -> its server, the second hop through the adapter's own weight group), binds
its own inbox (prompts + control; only authenticated messages are accepted) and then:

1. says hello with its inbox address and whether its engine can apply delta syncs (it has
   `verify`: the local engine; an SGLang adapter whose server runs qurl's sync loader at TP 1 or
   at a TP size whose cut qurl maps, qurl/engines/sglang/inside/tp_cut.py), every
   second until the controller answers with a weight group to join; the controller connects to
   that inbox;
2. joins the weight-update group (qurl/weights/group.py: advertising its address toward the
   controller; if the group cannot form from here it logs one line and exits 2) as rank slot+1
   and receives the current
   weights — every version after that arrives the same way: bucket announcements on the control
   channel, then broadcasts, then the engine commits the version (qurl/weights/receiver.py);
3. collects the prompts dispatched to it (one dispatch burst at a time: the controller marks the
   last prompt of a burst), builds G requests per prompt with the sync loop's `make_requests`
   (seeded by run seed, dispatch version + 1, dataset uid, sample index), generates and scores them
   (qurl/train/generate.py `generate_groups`), and sends the whole batch back as one trajectory
   message whose prompt_uids are the dispatch keys (`uid@did`); a task marked `eval` is one
   evaluation request of the controller, run as given and answered unscored, never trained
   (remote_eval.py).

Receiving and verifying weights is worker_sync.py (`WeightClient`).

Prompts and control share one ordered channel per slot, so a weight update announced before a prompt
is always seen before it. Between decode steps the worker polls that channel: a weight update that
lands mid-generation is loaded at once and the remaining tokens are sampled, and tagged, with the new
version (partial rollout); prompts that arrive meanwhile wait for the next batch.

The worker exits when its parent (the controller that spawned it) is gone, or on a `stop` message.
A worker started by hand (no --parent-pid) that hears nothing for RECONNECT_S re-reads
controller.json and, if a new controller has taken over the run, reconnects to it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from qurl.data.datasets import ANSWER_KINDS
from qurl.types import verifiable
from qurl.pipeline.worker_sync import Abort, Unverified, WeightClient

log = logging.getLogger("qurl.worker")

HELLO_EVERY_S = 1.0
RECONNECT_S = 30.0
BURST_WAIT_S = 0.5  # how long to wait for the rest of a dispatch burst before generating anyway
MAX_PROMPT_TOKENS = 1 << 16


def _wait_for_session(run_dir: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """controller.json of the run; a worker started before its controller waits for it."""
    from qurl.pipeline.session import read_session

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return read_session(run_dir)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _default_host(controller_endpoint: str) -> str:
    """127.0.0.1 when the controller is on this machine's loopback, else the address of the
    interface this machine reaches the controller through (qurl/node/netif.py), as the
    learner's ranks pick theirs: the hostname's address is loopback on many nodes."""
    from qurl.node.netif import source_address

    host = controller_endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return source_address(host)


class RolloutWorker(WeightClient):
    def __init__(self, run_dir: str | Path, slot: int, *, parent_pid: int = 0,
                 host: str = "", reconnect_s: float = RECONNECT_S, threads: int = 0) -> None:
        """threads: torch CPU threads, as the controller decided for the workers it starts;
        0 (a worker started by hand on its own machine) = deploy.torch_threads or every core."""
        from qurl.checkpoint.rundir import read_config
        from qurl.engines.factory import ServerSite, make_engine
        from qurl.engines.kind import EngineKind
        from qurl.node.placement import set_threads, threads_for
        from qurl.pipeline.session import read_key
        from qurl.train.requests import PromptCodec
        from qurl.weights.settings import SyncSettings

        self.run_dir, self.slot, self.parent_pid = Path(run_dir), int(slot), int(parent_pid)
        self.reconnect_s = float(reconnect_s)
        info = _wait_for_session(self.run_dir)  # written after the config and the key
        cfg = self.cfg = read_config(self.run_dir)
        self.kind = EngineKind.of(cfg.rollout, cfg.sglang)
        set_threads(threads or threads_for(cfg.deploy, busy=1))
        self.key = read_key(self.run_dir)
        if not 0 <= self.slot < int(info["num_workers"]):
            raise ValueError(f"--slot {slot}: the controller has {info['num_workers']} slots")
        self.host = host or _default_host(info["inbound"])
        if self.kind.worker_holds_gpu and torch.cuda.is_available():
            from qurl.node.placement import worker_gpu  # one GPU per worker, after the learner's

            # spawned: among the learner's GPUs; planned by `qurl launch`: its one GPU is cuda:0
            torch.cuda.set_device(worker_gpu(cfg.learner, cfg.deploy, self.slot,
                                             torch.cuda.device_count()) if self.parent_pid else 0)
        self.engine = make_engine(cfg.rollout, cfg.sglang, SyncSettings.of(cfg.deploy.sync),
                                  info["model_dir"], seed=cfg.run.seed,
                                  site=ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner),
                                  slot=self.slot, host=self.host)
        self.codec = PromptCodec(self.engine.tokenizer, self.cfg.data.template)
        self.tasks: deque[tuple[Any, dict[str, Any], float]] = deque()  # (PromptTask, extra, t_recv)
        self.inbox = self.outbox = None
        self.group = self.weights_rx = None
        self.session = ""
        self.joined = False
        self.gen_seen = -1  # latest weight-group generation we were invited to
        self.stop = False
        self.exit_code = 0  # 2: the weight group cannot form from here (one line logged)
        self.weights_ok = True  # False after a failed verification, until a sync verifies
        self.counts = {"batches": 0, "trajectories": 0, "syncs": 0, "sync_failures": 0,
                       "bad_control": 0, "delta_refused": 0, "verify_mismatches": 0,
                       "unverified_redone": 0, "eval_answers": 0}
        self._connect(info)

    # ------------------------------------------------------------------ connection

    def _connect(self, info: dict[str, Any]) -> None:
        from qurl.pipeline.channel import Receiver, Sender

        self._leave_group()
        self.tasks.clear()  # a new controller re-dispatches from its own ledger
        self.gen_seen = -1
        self.session = str(info["session"])
        hwm = self.cfg.deploy.stream.hwm
        if self.inbox is None:
            self.inbox = Receiver(f"tcp://{self.host}:0", self.key, bind=True,
                                  kinds=("prompt", "control"), vocab_size=self.engine.vocab_size,
                                  max_len=MAX_PROMPT_TOKENS, hwm=hwm)
        if self.outbox is not None:
            self.outbox.close(linger_ms=0)
        self.outbox = Sender(info["inbound"], self.key, bind=False, name=f"worker{self.slot}",
                             hwm=hwm, linger_ms=2000)
        self.last_heard = time.monotonic()
        self._next_hello = 0.0
        log.info("slot %d: connected to controller session %s", self.slot, self.session)

    def _close_sockets(self) -> None:
        for s in (self.inbox, self.outbox):
            if s is not None:
                s.close()
        self.inbox = self.outbox = None

    def _send_control(self, meta: dict[str, Any]) -> None:
        meta = {"slot": self.slot, "pid": os.getpid(), "session": self.session, **meta}
        self.outbox.send("control", meta, timeout_ms=10_000)

    def _orphaned(self) -> bool:
        return self.parent_pid > 0 and os.getppid() != self.parent_pid

    def _maybe_reconnect(self) -> None:
        from qurl.pipeline.session import read_session

        self.last_heard = time.monotonic()
        try:
            info = read_session(self.run_dir)
        except (OSError, ValueError) as e:
            log.warning("slot %d: cannot re-read controller info: %s", self.slot, e)
            return
        if str(info.get("session")) != self.session:
            log.info("slot %d: controller changed (%s -> %s), reconnecting", self.slot,
                     self.session, info.get("session"))
            self._connect(info)
            raise Abort()

    # ------------------------------------------------------------------ messages

    def _pump(self, timeout_ms: int) -> None:
        """Handle every queued message (waiting up to timeout_ms for the first)."""
        unverified = None
        for msg in self.inbox.recv_many(1000, timeout_ms=timeout_ms):
            try:
                self._handle(msg)
            except Unverified as e:  # handle the rest first: they may hold prompts
                unverified = e
        if unverified is not None:
            raise unverified

    def _handle(self, msg: Any) -> None:
        meta = msg.meta
        if meta.get("session") != self.session:
            self.counts["bad_control"] += 1  # an old controller's message: not ours to act on
            return
        self.last_heard = time.monotonic()
        if msg.kind == "prompt":
            self._queue_prompt(msg)
            return
        op = meta.get("op")
        if op == "group":
            self._join_group(meta)
        elif op == "weights":
            self._receive_weights(meta)
        elif op == "stop":
            self.stop = True
            raise Abort()
        elif op != "ping":
            self.counts["bad_control"] += 1

    def _queue_prompt(self, msg: Any) -> None:
        meta = msg.meta
        if not isinstance(meta.get("key"), str) or not isinstance(meta.get("answer"), str) \
                or meta.get("answer_kind", "math") not in ANSWER_KINDS:
            self.counts["bad_control"] += 1
            return
        self.tasks.append((msg.payload, meta, time.monotonic()))

    # ------------------------------------------------------------------ rollout

    def _between_steps(self) -> None:
        if self._orphaned():
            raise Abort()
        self._pump(0)

    def _take_batch(self) -> list[tuple[Any, dict[str, Any], float]]:
        """Every queued task once the dispatch burst is complete (or has waited BURST_WAIT_S)."""
        if not self.tasks or not self.joined or not self.weights_ok:
            return []
        if not self.tasks[-1][1].get("burst_end") and \
                time.monotonic() - self.tasks[0][2] < BURST_WAIT_S:
            return []
        batch = list(self.tasks)
        self.tasks.clear()
        return batch

    def _rollout(self, batch: list[tuple[Any, dict[str, Any], float]]) -> None:
        """Generate a batch of tasks, each kind as its own generation: training prompts, and the
        controller's evaluation requests (meta `eval`; remote_eval.py)."""
        evals = [b for b in batch if b[1].get("eval")]
        train = [b for b in batch if not b[1].get("eval")]
        if train:
            self._rollout_train(train)
        if evals:
            self._answer_eval(evals)

    def _redo(self, batch: list[tuple[Any, dict[str, Any], float]]) -> None:
        """Sampled partly from unverified weights: queue again, to redo after the resync."""
        self.tasks.extendleft(reversed(batch))
        self.counts["unverified_redone"] += len(batch)
        self._send_control({"op": "redone", "prompts": len(batch)})

    def _answer_eval(self, batch: list[tuple[Any, dict[str, Any], float]]) -> None:
        """Evaluation requests: each task is one request, run as given (its params carry the
        evaluator's seed), answered unscored under its key in a trajectory message marked
        `eval`, which the controller hands to the evaluator: never trained, never scored here."""
        from qurl.train.generate import unscored
        from qurl.pipeline.payload import pack_trajectories
        from qurl.types import GenRequest

        requests = [GenRequest(rid=f"{meta['key']}#0", prompt_ids=task.prompt_ids.tolist(),
                               params=task.params) for task, meta, _ in batch]
        t0 = time.perf_counter()
        try:
            results = self.engine.generate(requests, between_steps=self._between_steps)
        except Unverified:
            self._redo(batch)
            return
        meta, tensors = pack_trajectories(unscored(results))
        meta.update({"slot": self.slot, "session": self.session, "eval": 1,
                     "gen_s": time.perf_counter() - t0})
        if not self.outbox.send("trajectory", meta, tensors, timeout_ms=60_000):
            log.warning("slot %d: evaluation answers not sent (controller queue full)", self.slot)
            return
        self.counts["eval_answers"] += len(results)

    def _rollout_train(self, batch: list[tuple[Any, dict[str, Any], float]]) -> None:
        from qurl.data.datasets import Example
        from qurl.pipeline.ledger import split_key
        from qurl.train.generate import generate_groups
        from qurl.train.requests import make_requests
        from qurl.pipeline.payload import pack_trajectories

        requests, examples = [], []
        for task, meta, _ in batch:  # each prompt trains at step = its dispatch version + 1
            uid, _did = split_key(meta["key"])
            requests += make_requests([Example(uid=uid, prompt="", answer=meta["answer"])],
                                      [task.prompt_ids.tolist()], task.params,
                                      group_size=task.group_size, run_seed=self.cfg.run.seed,
                                      step=task.version + 1, keys=[meta["key"]])
            examples.append(Example(uid=meta["key"], prompt="", answer=meta["answer"],
                                    answer_kind=meta.get("answer_kind", "math")))
        v_start = int(self.engine.version)
        try:
            groups, gen = generate_groups(self.engine, requests, examples, self.codec,
                                          reward_timeout_s=self.cfg.deploy.reward_timeout_s,
                                          between_steps=self._between_steps)
        except Unverified:
            self._redo(batch)
            return
        trajs = [t for g in groups for t in g]
        meta, tensors = pack_trajectories(trajs)
        meta.update({"slot": self.slot, "session": self.session, "engine_version_start": v_start,
                     "gen_s": gen["time/generate"], "reward_s": gen["time/reward"],
                     "new_tokens": int(gen["new_tokens"])})
        if not self.outbox.send("trajectory", meta, tensors, timeout_ms=60_000):
            log.warning("slot %d: trajectory batch not sent (controller queue full)", self.slot)
            return
        self.counts["batches"] += 1
        self.counts["trajectories"] += len(trajs)

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        while not self.stop:
            if self._orphaned():
                log.info("slot %d: parent %d is gone, exiting", self.slot, self.parent_pid)
                return 0
            now = time.monotonic()
            try:
                if not self.joined and now >= self._next_hello:
                    self._send_control({"op": "hello", "gen": self.gen_seen,
                                        "endpoint": self.inbox.endpoint,
                                        "engine_version": int(self.engine.version),
                                        "deltas": verifiable(self.engine) is not None})
                    self._next_hello = now + HELLO_EVERY_S
                if self.parent_pid == 0 and now - self.last_heard > self.reconnect_s:
                    self._maybe_reconnect()
                self._pump(0 if self.tasks else 50)
                batch = self._take_batch()
                if batch:
                    self._rollout(batch)
            except Abort:
                continue
        return self.exit_code

    def close(self) -> None:
        self._leave_group()
        self._close_sockets()
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:  # SGLang: stop the servers this worker launched
            close_engine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.pipeline.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when this process is no longer our parent (0: never)")
    p.add_argument("--host", default="", help="address to bind this worker's inbox on and announce "
                   "to the controller (default: 127.0.0.1 for a local controller, else this "
                   "machine's address)")
    p.add_argument("--reconnect-s", type=float, default=RECONNECT_S,
                   help="without --parent-pid: after this long without a word from the controller, "
                        "look for a new one in controller.json")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (the controller passes its decision; 0: "
                        "deploy.torch_threads, else every core)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s worker{args.slot} %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from qurl.weights.nccl_env import apply_nccl_defaults

    apply_nccl_defaults()  # before any communicator: the same settings as its weight groups' peers
    worker = RolloutWorker(args.run_dir, args.slot, parent_pid=args.parent_pid, host=args.host,
                           reconnect_s=args.reconnect_s, threads=args.threads)
    # the controller ends workers with SIGTERM: exit through `finally`, so the SGLang servers this
    # worker launched (in their own sessions) are stopped with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return worker.run()
    finally:
        # the controller sends `stop` and SIGTERM back to back: a SIGTERM arriving while close()
        # stops the server would cut its SIGTERM -> SIGKILL escalation short and leave it running
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
