"""The asynchronous QuRL pipeline: a controller (learner rank 0) and rollout worker processes.

    controller.py  train_async: the training loop's (qurl/train/loop.py) async batch source: dispatch
                   prompts under the staleness bound, buffer trajectories, pop complete batches,
                   broadcast 8-bit weights; its state makes checkpoints lossless
    worker.py      one rollout worker process: engine + stream + weight-group member
    dispatch.py    cursor + staleness + buffer + ledger: what is dispatched, filed, trained
    staleness.py   the staleness policy: AReaL's dispatch rule and the trajectory buffer (η)
    ledger.py      which dispatched prompt is where (in flight per worker, accepted, late)
    procs.py       start / monitor / restart worker processes
    compare.py     `qurl compare`: sync vs async x bf16 vs int8+ACR+UAQ, same seed and budget

Importing this package has no side effects (modules are imported by whoever needs them).
"""
