"""Training: the one loop of every mode and what it needs around it.

loop.py (the step: batch, train, publish, log, evaluate, checkpoint) is fed by a batch source:
inline.py (rollouts generated in this process: the synchronous loop) or the async controller
(qurl/pipeline/controller.py). run_setup.py opens a run on every learner rank (its directory and
checkpoints are qurl/checkpoint/); metrics_log.py writes metrics.jsonl, which plots.py draws.

Rollout, the path from prompts to the learner's batch, shared by both sources and the evaluation:
requests.py (prompt codec, seeded requests) -> generate.py (engine, rewards, groups) ->
dynamic_sampling.py (DAPO: keep groups whose answers disagree) -> batch.py (padded training batch).

Evaluation, run by the loop every run.eval_every steps and by `qurl eval`: eval_suite.py (greedy,
Avg@k and pass@k over several sets), eval_metrics.py (the estimators), eval_placement.py (which
engine scores which policy).
"""
