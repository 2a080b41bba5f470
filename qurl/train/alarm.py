"""The mismatch alarm: a sudden, lasting rise of KL(π_behav ‖ π_prox) over its own running median.

Digests (qurl/weights/digest.py) prove that an engine holds the bits the learner sent; they cannot see
a fault in what was sent — a quantizer that writes a scale to the wrong row, a wrong UAQ factor, a
bad layout — because the digest is taken after it. Such a fault shows up in the policies instead:
the engine samples from weights that are not the learner's, so the per-step estimate of
KL(behav ‖ prox) (`kl_behav_prox`, qurl/algo/stats.py) jumps. On a healthy run that estimate moves
slowly (quantization noise plus staleness), so "k times its running median for n steps in a row"
separates the two without a threshold in absolute units.

`MismatchAlarm` is pure: feed it each step's value, it returns the record keys for that step.
- warm-up: the first `warmup` finite values only build the history (no verdict; ratio NaN);
- a value is a *breach* when it is above `factor` × max(median of the history, `floor`), or not
  finite (NaN / inf: a broken estimate is never read as "fine"); breaches do not enter the
  history, so a lasting fault cannot become the new normal (`floor`: a median of exactly 0, e.g.
  an engine bit-equal to the learner, does not make every later float-noise value a breach);
- the alarm *fires* at the `steps`-th breach in a row (`fired` True at that step only, for the one
  message); it stays raised (`alarm/kl` = 1) until a step is not a breach.
The history is the last `window` non-breach values; `state_dict` / `load_state_dict` carry it
across a resume, so a resumed run needs no second warm-up.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class AlarmVerdict:
    """One step's outcome: `fired` only at the step the alarm goes off; `record` the alarm/* keys."""

    fired: bool
    record: dict[str, float]
    message: str = ""


@dataclass
class MismatchAlarm:
    """See the module docstring. factor > 1 (k), steps ≥ 1 (n), warmup ≥ 1, window ≥ warmup."""

    factor: float
    steps: int
    warmup: int = 3
    window: int = 50
    floor: float = 1e-6
    history: list[float] = field(default_factory=list)
    streak: int = 0
    fired_total: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 1):
            raise ValueError(f"alarm factor must be a finite number > 1, got {self.factor!r}")
        if self.steps < 1 or self.warmup < 1 or self.window < self.warmup:
            raise ValueError(f"alarm: need steps >= 1 and 1 <= warmup <= window, got steps="
                             f"{self.steps} warmup={self.warmup} window={self.window}")

    def update(self, value: float, step: int | None = None) -> AlarmVerdict:
        """Judge one step's KL(behav ‖ prox) estimate (module docstring)."""
        finite = math.isfinite(value)
        if len(self.history) < self.warmup:
            if finite:
                self.history.append(float(value))
            return AlarmVerdict(False, self._record(value, float("nan")))
        median = statistics.median(self.history)
        breach = not finite or value > self.factor * max(median, self.floor)
        if breach:
            self.streak += 1
        else:
            self.streak = 0
            self.history = (self.history + [float(value)])[-self.window:]
        fired = self.streak == self.steps
        self.fired_total += fired
        msg = ""
        if fired:
            at = f"step {step}: " if step is not None else ""
            msg = (f"{at}mismatch alarm: KL(behav||prox) = {value:.3g} is above "
                   f"{self.factor:g} x its running median {median:.3g} for {self.steps} steps in a "
                   "row: the rollout engine samples from other weights than the learner's")
        return AlarmVerdict(fired, self._record(value, median), msg)

    def _record(self, value: float, median: float) -> dict[str, float]:
        ratio = value / median if math.isfinite(median) and median > 0 else float("nan")
        return {"alarm/kl_median": median, "alarm/kl_ratio": ratio,
                "alarm/kl_streak": float(self.streak),
                "alarm/kl": 1.0 if self.streak >= self.steps else 0.0,
                "alarm/kl_fired": float(self.fired_total)}

    def state_dict(self) -> dict:
        return {"history": list(self.history), "streak": self.streak,
                "fired_total": self.fired_total}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(x) for x in state["history"]][-self.window:]
        self.streak, self.fired_total = int(state["streak"]), int(state["fired_total"])
