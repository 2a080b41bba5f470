"""Research on top of qurl: experiments over many runs (studies/) and benchmarks (bench/).

Outside the product: nothing under qurl/ but the `qurl` command line reaches in here, and that
only through a lazily imported subcommand (`qurl study`, `qurl compare`, `qurl bench`). Research
imports product modules directly, as any user's script would; those internals are not a stable
interface (the stable one is qurl/api.py).
"""
