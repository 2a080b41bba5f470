"""One node's facts, read by every room that starts or connects processes (a low room: it imports
only qurl.config).

placement.py divides CPU threads and assigns GPUs on a node (learner ranks, rollout workers,
SGLang servers); netif.py finds the network interface a node reaches a peer through, so every
process group (the learner's, the weight group) advertises an address its peers can reach.
"""
