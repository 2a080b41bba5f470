"""What to do after a weight version was loaded into one holder: accept it, resend it whole, or halt.

A rollout engine must never sample from weights that differ from the learner's: the bits it holds
are the policy the learner's importance weights and KL terms assume. So every load is checked, and
one rule decides what follows. A *holder* is one copy of the rollout weights — the engine of the
synchronous loop (publish.py `WeightSync.push`) or one worker slot of the async
pipeline (qurl/pipeline/fleet.py `Fleet`, told by the workers' `synced` / `resync` messages,
qurl/pipeline/worker_sync.py). Each load of a version into a holder ends in one outcome:

- `ok`: the holder proved it holds the sender's bits (its digests match, digest.py);
- `refused`: the version came as a delta against a base the holder does not hold verified
  (qurl/types.py `StaleBase`), so it wrote nothing;
- `mismatch`: the load finished but the holder's digests differ from the learner's in some
  tensors (a transport bug, a broken loader, memory corrupted behind the sync's back);
- `other`: the holder asked for a full sync for a reason this rule does not know.

and the rule answers:

    ok                                -> accept (and forgive any earlier mismatch)
    refused | other                   -> resync: send the version again, in full
    mismatch, the first in a row      -> resync: send the version again, in full
    mismatch, the second in a row     -> halt: a full resync did not fix it

A halt is a `RunHalted` (`unverified`): one line naming the holder, the version and the tensors
that differ; `qurl train` prints it and exits 2, nothing is trained on the unverified weights, and
the run resumes from its last checkpoint. The rule keeps each holder's mismatch streak (only a
verified load resets it); each caller records the resync under its own key, with the decision's
reason (`sync/resync/<reason>` in a sync record, `resync/<reason>` in the fleet's counts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Iterable

from qurl.errors import RunHalted

if TYPE_CHECKING:
    from qurl.types import Engine

OK, REFUSED, MISMATCH, OTHER = "ok", "refused", "mismatch", "other"
RESYNC_REASONS = (REFUSED, MISMATCH)  # why a holder gets a version again in full
OUTCOMES = (OK, *RESYNC_REASONS, OTHER)
ACCEPT, RESYNC, HALT = "accept", "resync", "halt"
HALT_AFTER = 2  # mismatches in a row: the second means a full resync failed too


@dataclass(frozen=True)
class Decision:
    """The rule's answer. action: accept | resync | halt. reason: why the version is sent again
    in full (refused | mismatch | other; a halt's is mismatch: it counts as a resync too), None
    for accept. error: the RunHalted to raise, for a halt only."""

    action: str
    reason: str | None = None
    error: RunHalted | None = None


class ResyncRule:
    """Delta -> (refused or mismatch) -> full resync -> (mismatch again) -> halt, per holder
    (module docstring). A holder is any hashable key: an engine's id, a worker slot."""

    def __init__(self) -> None:
        self._streaks: dict[Hashable, int] = {}  # holders with mismatches in a row (> 0 only)

    def streak(self, holder: Hashable) -> int:
        """The holder's failed verifications in a row."""
        return self._streaks.get(holder, 0)

    def forget(self, holder: Hashable) -> None:
        """The holder is gone (a replaced worker): a new one starts with no streak."""
        self._streaks.pop(holder, None)

    def decide(self, holder: Hashable, outcome: str, *, version: Any = -1,
               bad: Iterable[Any] | None = None, who: str = "engine") -> Decision:
        """The outcome of one load of `version` into `holder` -> what to do next. For a
        mismatch, `bad` names the tensors that differ and `who` names the holder in the halt's
        error (both used only when it halts; a name that is not a string is dropped)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r}: must be one of {', '.join(OUTCOMES)}")
        if outcome == OK:
            self._streaks.pop(holder, None)
            return Decision(ACCEPT)
        if outcome != MISMATCH:
            return Decision(RESYNC, outcome)
        streak = self._streaks[holder] = self.streak(holder) + 1
        if streak < HALT_AFTER:
            return Decision(RESYNC, MISMATCH)
        names = [b for b in bad or [] if isinstance(b, str)] or ["?"]
        return Decision(HALT, MISMATCH, unverified(who, int(version), names))


def engine_label(engine: Engine) -> str:
    """How an error names an engine: its class and, where it has one, its precision."""
    precision = engine.__dict__.get("precision")
    return type(engine).__name__ + (f" ({precision})" if isinstance(precision, str) else "")


def unverified(who: str, version: int, bad: list[str], shown: int = 3) -> RunHalted:
    """The one-line error of an engine `who` that failed verification twice in a row: the
    version, how many tensors differ and the first `shown` of their names."""
    names = ", ".join(bad[:shown]) + (f" and {len(bad) - shown} more" if len(bad) > shown else "")
    return RunHalted(f"weight sync v{version}: {who} still differs from the learner's weights "
                     f"after a full resync, in {len(bad)} tensor{'s' * (len(bad) != 1)}: {names}; "
                     "the run stops (nothing is trained on unverified weights): fix the engine, "
                     "then resume from the last checkpoint with `qurl train --resume <run dir>`")
