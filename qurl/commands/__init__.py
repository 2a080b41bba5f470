"""The `qurl` subcommands, one module each: the top floor of the product.

qurl/cli.py builds the parser and hands the parsed arguments to one of these (imported only then):
train.py (`qurl train`: checks, memory plan, the learner's ranks), eval.py (`qurl eval`: a run's
checkpoint or an HF checkpoint), export.py (`qurl export`), report.py (`qurl report`), fetch.py
(`qurl fetch`), launch.py (`qurl launch`, which parses its own options; launch_plan.py plans the
per-node commands of a multi-node run and runs one node's). ranks.py starts the learner's ranks of
a command (torchrun, spawned, or in-process). Each entry function takes the parsed arguments and returns the exit code; what it orchestrates lives in the rooms below
(train/, pipeline/, learner/, ...), which import nothing from here. The research commands
(`qurl bench`, `qurl compare`, `qurl study`) stay behind the research wall, in
qurl/research/bench/command.py and qurl/research/studies/command.py.
"""
