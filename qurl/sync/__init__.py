"""Weight sync, the learner side's policy of it: which bytes each engine gets after a step.

publish.py   `WeightSync`: UAQ -> quantize (arena.py) -> delta or full (plan.py) -> each engine,
             then verification of what each engine holds
arena.py     the quantizer's reusable output buffers
plan.py      delta vs full per engine, from what each last verified
receiver.py  the engine side in an async worker: receive buckets from the group, install, verify

Below it: qurl/wire/ (encoding, digests, buckets, the group) and the engines it drives
(qurl/engines/base.py: `Engine` and the optional `VerifiableEngine`).
"""
