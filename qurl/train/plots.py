"""`qurl report`'s plots: a run's metrics.jsonl as PNG panels (reward, accuracy, mismatch KL, flips).

Panels: training reward and held-out accuracy (8-bit engine and full-precision policy);
KL(behav‖prox) — the quantization/staleness mismatch — overall and split by staleness; the
policy's entropy at the sampled tokens, the learner's π_prox beside the engine's own where it
reported one (a rollout format that changes training shows there); clip
fractions and the share of tokens whose upper bound ACR widened (and whose IS weight was
truncated or masked by the correction); flip fraction
of the 8-bit codes per sync (UAQ-scaled vs other layers); for a mixture-of-experts model, the
share of (token, layer) routes where the learner's own top-k differs from the engine's, of tokens
with such a flip in any layer, and of the worst layer (qurl/algo/routes.py). A panel whose metric the run did not
record is drawn empty with a note, not skipped; the routes panel's note names the usual reason (a
dense model has no routes; a mixture of experts records them on every train record its engine
returned routes for).
"""
from __future__ import annotations

from pathlib import Path

from qurl.train.metrics_log import read_metrics

PANELS: list[tuple[str, list[str]]] = [
    ("reward (train)", ["reward"]),
    ("accuracy (eval): 8-bit engine, fp policy", ["eval:accuracy", "eval:eval_fp/mean/greedy"]),
    ("KL(behav || prox)", ["kl_behav_prox", "kl_behav_prox/s0", "kl_behav_prox/s1",
                           "kl_behav_prox/s2plus"]),
    ("entropy at the sampled tokens: pi_prox, engine", ["entropy", "behav_entropy"]),
    ("clipping / ACR", ["clip_frac_low", "clip_frac_high", "tis_trunc_frac", "acr_widened_frac",
                        "mask_frac_low", "mask_frac_high"]),
    ("flip fraction of 8-bit codes", ["flip_frac", "flip_frac/uaq_scaled", "flip_frac/unscaled"]),
    ("max pi_prox / pi_behav", ["is_ratio_max"]),
    ("MoE routes: learner vs engine", ["moe/route_flip_frac", "moe/tokens_any_flip",
                                       "moe/worst_layer_flip"]),
]


def series(records: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    kind = "train"
    if key.startswith("eval:"):
        kind, key = "eval", key.removeprefix("eval:")
    pts = [(r[x], r[key]) for r in records
           if r.get("kind") == kind and isinstance(r.get(key), (int, float)) and x in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: dict[str, list[dict]], out: Path, *, x: str = "step") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    for ax in axes.flat[len(PANELS):]:
        ax.axis("off")
    for ax, (title, keys) in zip(axes.flat, PANELS):
        drawn = False
        for run_name, records in runs.items():
            for key in keys:
                xs, ys = series(records, key, x)
                if xs:
                    label = key if len(runs) == 1 else f"{run_name}: {key}"
                    ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None)
                    drawn = True
        ax.set_title(title)
        ax.set_xlabel("wall time (s)" if x == "wall" else x)
        if "ratio" in title or "KL" in title:
            ax.set_yscale("symlog", linthresh=1e-4)
        if drawn:
            ax.legend(fontsize=7)
        else:
            note = "no routes recorded (a dense model?)" if keys[0].startswith("moe/") else "not recorded"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: missing or empty")
    return plot_runs({run_dir.name: records}, Path(out) if out else run_dir / "report.png")
