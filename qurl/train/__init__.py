"""Training: the one loop of every mode and what it needs around it.

loop.py (the step: batch, train, publish, log, evaluate, checkpoint) is fed by a batch source:
inline.py (rollouts generated in this process: the synchronous loop) or the async controller
(qurl/pipeline/controller.py). run_setup.py opens a run on every learner rank (its directory and
checkpoints are qurl/checkpoint/); metrics_log.py writes metrics.jsonl, which report.py plots;
export.py turns a checkpoint into an HF or 8-bit checkpoint.
"""
