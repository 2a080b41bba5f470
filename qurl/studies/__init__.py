"""Studies: experiments that run many `qurl train` arms and summarise them (not part of training).

`ablation` — the paper's ablation at CPU scale (`qurl study ablation`).
`compare` — sync vs async and 8-bit vs bf16 rollout, side by side (`qurl compare`).
"""
