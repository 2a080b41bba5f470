"""Rollout: prompts in, scored trajectories out, and those trajectories as the learner's batch.

requests.py (prompt codec, seeded requests) -> generate.py (engine, rewards, groups) ->
dynamic_sampling.py (DAPO: keep groups whose answers disagree) -> batch.py (padded training batch).
"""
