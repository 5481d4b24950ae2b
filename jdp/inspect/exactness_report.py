"""What `assert_data_parallel_exact` reports: a row per leaf of each run (`LeafDiff`), the table of
them (`ExactnessReport`), and the error it raises (`NotExactError`)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LeafDiff:
    """One leaf of one run compared with the one-device reference."""

    run: str  # "shard_map", "pmap", or with accumulation "pmap, accum_sync='last'"
    name: str  # "params.l0.w", "model_state.bn.mean", "loss", "aux.accuracy"
    diff: float  # max |jdp - reference| over the leaf (loss and aux: over the steps)
    tol: float  # atol + rtol * max |reference|
    moved: float  # max |reference after the steps - before| (NaN for loss and aux)
    dtype: str

    @property
    def ok(self) -> bool:
        return self.diff <= self.tol

    @property
    def ratio(self) -> float:
        """diff / tol: above 1 fails."""
        return self.diff / self.tol if self.tol > 0 else (0.0 if self.diff == 0 else math.inf)


@dataclass(frozen=True)
class ExactnessReport:
    """Every leaf of every run, worst first (by diff / tol). `str(report)` is a table."""

    rows: tuple[LeafDiff, ...]
    devices: int
    steps: int
    runs: tuple[str, ...]

    @property
    def failures(self) -> tuple[LeafDiff, ...]:
        return tuple(r for r in self.rows if not r.ok)

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self, limit: int | None = None) -> str:
        rows = self.rows if limit is None else self.rows[:limit]
        run_w = max([3] + [len(r.run) for r in rows])
        name_w = max([4] + [len(r.name) for r in rows])
        lines = [f"     {'run':<{run_w}}  {'leaf':<{name_w}}  {'max|Δ|':>9}  {'tolerance':>9}  {'moved':>9}  dtype"]
        for r in rows:
            lines.append(f"{'ok ' if r.ok else 'FAIL'} {r.run:<{run_w}}  {r.name:<{name_w}}  {r.diff:9.2e}  "
                         f"{r.tol:9.2e}  {r.moved:9.2e}  {r.dtype}")
        if len(rows) < len(self.rows):
            lines.append(f"     ... {len(self.rows) - len(rows)} more, all within tolerance"
                         if all(r.ok for r in self.rows[len(rows):]) else f"     ... {len(self.rows) - len(rows)} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (f"jdp on {self.devices} device(s) vs one device, {self.steps} step(s), runs: {', '.join(self.runs)}; "
                f"{len(self.failures)} of {len(self.rows)} leaves beyond tolerance; worst first:")
        return head + "\n" + self.table()


class NotExactError(AssertionError):
    """Raised by `assert_data_parallel_exact`; `.report` is the `ExactnessReport` (every leaf), or None
    when the failure is not a leaf's (the reference went non-finite, replicas, step count)."""

    def __init__(self, message: str, report: ExactnessReport | None):
        super().__init__(message)
        self.report = report


__all__ = ["ExactnessReport", "LeafDiff", "NotExactError"]
