"""`qurl bench engine|learner|stream|sync`: which benchmark a command line runs, with its flags.

Each benchmark prints its arms measured side by side in one process (ratios, never a timing
compared across runs); the modules beside this one hold them. The flags are parsed in
qurl/cli.py, which hands them here.
"""
from __future__ import annotations

import argparse

from qurl.errors import InputError


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark `args.what` names with the flags `qurl bench` parsed (qurl/cli.py)."""
    if args.what == "engine":
        from qurl.research.bench.engines import bench_local_engine

        bench_local_engine(preset=args.preset_model, batch=args.batch, new_tokens=args.new_tokens,
                           arms=tuple(a for a in args.arms.split(",") if a), rounds=args.rounds,
                           num_threads=args.threads, profile=args.profile, gemms=args.gemms)
    elif args.what == "learner" and args.memory:
        from qurl.research.bench.learner_long import ARMS, bench_memory

        arms = tuple(a for a in (args.learner_arms or ",".join(ARMS)).split(",") if a)
        bench_memory(lengths=tuple(int(x) for x in args.lengths.split(",")), arms=arms,
                     layers=args.layers or 2, threads=args.threads, max_gb=args.max_gb)
    elif args.what == "learner" and args.mix:
        from qurl.research.bench.learner_mix import bench_mix

        bench_mix(rounds=args.rounds, threads=args.threads)
    elif args.what == "learner" and args.attention:
        from qurl.research.bench.learner_mix import bench_attention_step

        bench_attention_step(rounds=args.rounds, threads=args.threads)
    elif args.what == "learner":
        from qurl.research.bench.learner import bench_learner

        bench_learner(model=args.preset_model, rows=args.batch, prompt=args.prompt_tokens,
                      response=args.answer_tokens, rounds=args.rounds, threads=args.threads)
    elif args.what == "stream":
        from qurl.research.bench.stream import bench_stream

        bench_stream()
    elif args.moe:
        from qurl.research.bench.sync_moe import bench_moe_sync

        bench_moe_sync(args.sets)
    elif args.delta:
        from qurl.research.bench.sync_delta import DELTA_SHAPES, bench_delta

        shapes = tuple(s for s in args.delta_shapes.split(",") if s)
        bad = [s for s in shapes if s not in DELTA_SHAPES]
        if bad:
            raise InputError(f"--delta-shapes: unknown {bad[0]!r} (known: "
                             f"{', '.join(DELTA_SHAPES)})")
        bucket_mb, layers = args.bucket_mb or 64.0, args.layers or None
        if args.encode_only:  # the sender's encode alone, old vs new code
            from qurl.research.bench.sync_encode import bench_encode

            bench_encode(shapes, repeats=args.repeats, layers=layers, bucket_mb=bucket_mb)
        elif args.link:  # between two network namespaces over tc-shaped links
            from qurl.research.bench.sync_link import bench_link_spec

            bench_link_spec(args.link, shapes, bucket_mb=bucket_mb, layers=layers)
        else:
            bench_delta(shapes=shapes, flips_from=tuple(args.flips_from), bucket_mb=bucket_mb,
                        repeats=args.repeats, layers=layers)
    else:
        from qurl.research.bench.sync import bench_sync

        bench_sync(bucket_mb=args.bucket_mb, shapes=args.shapes)
    return 0
