"""The ablation's figure: training reward, held-out accuracy and KL(π_behav‖π_prox) against step,
one line per arm, mean over the seeds that arm has (a thin band: min..max over them). An arm run on
fewer seeds than the study's names its seeds in the legend, so a one-seed line is not read as a mean.

Training reward is noisy step to step (16 prompts × G samples), so it is drawn as a trailing mean
over `qurl.research.studies.tables.WINDOW` steps, the same window the collapse detection uses.
"""
from __future__ import annotations

from pathlib import Path

from qurl.research.studies.tables import WINDOW

PANELS = (("training reward (trailing mean)", "train", "reward"),
          ("greedy accuracy (held-out)", "eval", "accuracy"),
          ("KL(behav ‖ prox)", "train", "kl_behav_prox"))


def _curve(records: list[dict], kind: str, key: str, smooth: int) -> dict[int, float]:
    pts = [(r["step"], float(r[key])) for r in records
           if r.get("kind") == kind and isinstance(r.get(key), (int, float))]
    out = {}
    for i, (step, _) in enumerate(pts):
        win = [v for _, v in pts[max(0, i - smooth + 1): i + 1]]
        out[step] = sum(win) / len(win)
    return out


def arm_label(arm: str, arm_seeds: list[int], all_seeds: list[int]) -> str:
    """Legend entry: the arm's name, with its seeds when it lacks some of the study's."""
    if sorted(arm_seeds) == sorted(all_seeds):
        return arm
    return f"{arm} (seed{'s' if len(arm_seeds) > 1 else ''} {', '.join(map(str, sorted(arm_seeds)))})"


def plot_study(records: dict[int, dict[str, list[dict]]], out: Path) -> Path:
    """{seed: {arm: metrics records}} -> a 1x3 PNG at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(a for by_arm in records.values() for a in by_arm))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for ax, (title, kind, key) in zip(axes, PANELS):
        for arm in arms:
            seeds = [seed for seed, by_arm in records.items() if arm in by_arm]
            curves = [_curve(records[seed][arm], kind, key,
                             WINDOW if kind == "train" and key == "reward" else 1) for seed in seeds]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            vals = [[c[s] for c in curves] for s in steps]
            mean = [sum(v) / len(v) for v in vals]
            style = "--" if arm.startswith("fp8") else "-"
            line, = ax.plot(steps, mean, style, label=arm_label(arm, seeds, list(records)),
                            marker="." if kind == "eval" else None)
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals],
                                color=line.get_color(), alpha=0.12)
        ax.set_title(title)
        ax.set_xlabel("step")
        if key == "kl_behav_prox":
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.legend(fontsize=7)
    fig.suptitle(f"qurl study ablation, mean over seeds {', '.join(map(str, records))} unless the "
                 "legend names fewer (band: min..max)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
