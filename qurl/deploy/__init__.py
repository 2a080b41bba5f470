"""Deployment: where qurl's processes run and how they are started.

ranks.py starts the learner's ranks for a command (torchrun, spawned, or in-process);
placement.py divides CPU threads and assigns GPUs (learner ranks, rollout workers, SGLang servers);
launch.py is `qurl launch`, the per-node commands of a multi-node run; netif.py finds the network
interface a node reaches node 0 through.
"""
