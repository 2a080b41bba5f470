"""Deployment: how qurl's processes are started.

ranks.py starts the learner's ranks for a command (torchrun, spawned, or in-process); launch.py is
`qurl launch`, the per-node commands of a multi-node run. What a node has and where each process
goes on it (GPUs, threads, the interface toward node 0) is the lower room qurl/node/.
"""
