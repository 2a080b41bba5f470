"""The asynchronous QuRL pipeline: a controller (learner rank 0) and rollout worker processes.

    controller.py  the training loop's (qurl/train/loop.py) async batch source: dispatch
                   prompts under the staleness bound, buffer trajectories, pop complete batches,
                   broadcast 8-bit weights; its state makes checkpoints lossless
    worker.py      one rollout worker process: engine + stream + weight-group member
    dispatch.py    cursor + staleness + buffer + ledger: what is dispatched, filed, trained
    staleness.py   the staleness policy: AReaL's dispatch rule and the trajectory buffer (η)
    ledger.py      which dispatched prompt is where (in flight per worker, accepted, late)
    procs.py       start / monitor / restart worker processes
    fleet.py       the workers as one set: start, weight pushes, the verify / resend rule
    worker_sync.py a worker's end of the weight push; remote_eval.py: evaluation by the workers
    session.py     the run key; records.py: trained.jsonl; procs.py: start / monitor / restart

The stream between them (ZeroMQ, one direction each: prompts out, trajectories and control in):
    frames.py      the wire format: typed multipart messages, HMAC over BLAKE3 digests, limits
    payload.py     what a prompt, trajectory or control message carries, validated on receipt
    channel.py     the PUSH / PULL endpoints, back-pressure (high-water marks), reject counters

Importing this package has no side effects (modules are imported by whoever needs them).
"""
