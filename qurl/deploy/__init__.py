"""Deployment: how qurl's processes are started.

ranks.py starts the learner's ranks for a command (torchrun, spawned, or in-process); launch.py
plans the per-node commands of a multi-node run and runs one node's (the command, `qurl launch`, is
qurl/commands/launch.py). What a node has and where each process goes on it (GPUs, threads, the
interface toward node 0) is the lower room qurl/node/.
"""
