"""Studies: experiments that run many `qurl train` arms and summarise them (not part of training).

`ablation` — the paper's ablation at CPU scale (`qurl study ablation`).
"""
