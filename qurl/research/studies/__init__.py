"""Studies: experiments that run many `qurl train` arms and summarise them (not part of training).

`ablation` — the paper's ablation at CPU scale, with the field's other corrections (`qurl study
ablation`); `store` — its committed results (each finished arm's config and metrics), so a study
spans sessions; `runner` — one arm to its end, resuming an interrupted one; `tables`, `plots`.
`compare` — sync vs async and 8-bit vs bf16 rollout, side by side (`qurl compare`).
"""
