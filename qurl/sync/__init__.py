"""Weight sync, the learner side's policy of it: which bytes each engine gets after a step.

publish.py   `WeightSync`: UAQ -> quantize (arena.py) -> delta or full (plan.py) -> each engine,
             then verification of what each engine holds
arena.py     the quantizer's reusable output buffers
plan.py      delta vs full per engine, from what each last verified
resync.py    after each load: accept, resend in full (refused / mismatch), or halt the run (a
             second mismatch in a row); the one rule for the in-process engine and each worker
receiver.py  the engine side in an async worker: receive buckets from the group, install, verify

Below it: qurl/wire/ (encoding, digests, buckets, the group) and the engines it drives
(qurl/engines/base.py: `Engine` and the optional `VerifiableEngine`).
"""
