"""The validation number a run watches (trainer.monitor): which evaluation was the best so far, for
checkpoint.save_best, and how many evaluations have passed without beating it, for early stopping
(trainer.early_stopping_patience). Its state travels in the checkpoint, so a resumed run goes on counting."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

from megalm.errors import ConfigError

LOWER_IS_BETTER = ("val_loss", "val_ppl")
"""What trainer.monitor_mode=auto minimises; every other validation number (accuracies, F1, ...) is maximised."""


class Monitor:
    def __init__(self, metric: str, mode: str = "auto", patience: int = 0, min_delta: float = 0.0):
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.mode = mode if mode != "auto" else ("min" if metric in LOWER_IS_BETTER else "max")
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.stale = 0
        """Evaluations in a row since the best that did not improve on it by more than min_delta."""

    def check_names(self, names: Sequence[str], why: str) -> None:
        """Raise before training when the evaluations will not report trainer.monitor."""
        if self.metric not in names:
            raise ConfigError(f"trainer.monitor={self.metric} ({why}) is not a number this run's evaluations report; "
                              f"they report {', '.join(names)}")

    def update(self, record: Dict[str, float], step: int) -> bool:
        """Take an evaluation's record; True when it is the best so far (the first one is). A NaN never is."""
        value = float(record[self.metric])
        if math.isnan(value):
            self.stale += 1
            return False
        sign = 1.0 if self.mode == "max" else -1.0
        if self.best is None or sign * (value - self.best) > self.min_delta:
            self.best, self.best_step, self.stale = value, step, 0
            return True
        self.stale += 1
        return False

    @property
    def exhausted(self) -> bool:
        """Early stopping's verdict: patience evaluations in a row without an improvement (never with patience 0)."""
        return self.patience > 0 and self.stale >= self.patience

    def state_dict(self) -> Dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "best": self.best, "best_step": self.best_step,
                "stale": self.stale}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """A resumed run's: kept when it watched the same number the same way, else started afresh."""
        if state and state.get("metric") == self.metric and state.get("mode") == self.mode:
            self.best, self.best_step = state.get("best"), state.get("best_step")
            self.stale = int(state.get("stale", 0))
