"""Accuracy metrics of a reasoning benchmark, from how many of n samples per problem were right.

- greedy: share of problems the temperature-0 answer gets right (one deterministic sample each).
- Avg@k (the paper's metric): k samples per problem at temperature T; the mean over problems of the
  share of right samples, c/k. It estimates the expected accuracy of ONE sample, with less noise
  than a single draw.
- pass@k: the probability that at least one of k samples is right. With n ≥ k samples of which c
  are right, the unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
  Code") is 1 − C(n−c, k) / C(n, k): one minus the chance that a k-subset drawn without replacement
  from the n samples holds no right one. It is computed as a product, 1 − Π_{i=n−c+1}^{n} (1 − k/i),
  so no large binomial is ever formed. pass@1 = c/n = Avg@n.

All functions are pure; a set's metrics are means over its problems, and a run's mean over sets is
the unweighted mean of the per-set values (each benchmark counts once, as the paper averages).
"""
from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with c right answers among n samples (requires k ≤ n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every k-subset holds a right sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def set_metrics(correct: Sequence[int], n: int, pass_ks: Sequence[int] = ()) -> dict[str, float]:
    """{avg@n, pass@k for each k} over problems; correct[i]: right samples of problem i out of n."""
    if not correct:
        raise ValueError("set_metrics: no problems")
    out = {f"avg@{n}": sum(c / n for c in correct) / len(correct)}
    for k in pass_ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
    return out


def mean_over_sets(per_set: dict[str, dict[str, float]]) -> dict[str, float]:
    """The unweighted mean over sets of every metric all sets report."""
    names = set.intersection(*(set(m) for m in per_set.values())) if per_set else set()
    return {k: sum(m[k] for m in per_set.values()) / len(per_set) for k in sorted(names)}
