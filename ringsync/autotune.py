"""Autotune: pick the engine's settings by timing training steps with each candidate.

With RINGSYNC_AUTOTUNE=1 (``ringsync run --autotune``, Horovod's HOROVOD_AUTOTUNE), or
after ``start(comm)``, the framework adapters call ``step(comm)`` once per training step:
the tuner is an object above the Communicator that drives it through its collectives and
tune requests (nothing below calls back up). The
tuner discards a few warm-up samples, times one sample (``steps_per_sample`` steps) with
the settings in force, then tries the candidates of one setting at a time (fusion
threshold, cycle time, the one-round and the staged allreduce crossovers), keeping a
candidate only when its sample beat the best so far by more than NOISE. After the last
candidate (or ``max_samples``), where the best differs from the start settings, both are
timed once more one after the other (a short sample on a busy host can be lucky), and the
faster by more than NOISE is applied; then the tuner stops.

Every rank must choose the same settings at the same place (tensors fused differently on
two ranks would not line up): a sample's time is the slowest rank's (one allreduce per
sample), every rank runs the same search on those numbers, and the settings reach the
engine as a tune request, negotiated like a tensor: the engine applies it at the same
point of the agreed order on every rank, and fails it on every rank, naming both values,
if two ranks' settings differ.

Horovod searches with Bayesian optimisation over a Gaussian process; this search is one
setting at a time over a short list, which needs no model and ends in a few samples.
"""
import csv
import dataclasses
import time
from typing import Dict, List, Optional

import numpy as np

from ._context import JOB
from .engine_settings import NEVER, Settings
from .ops import ReduceOp

__all__ = ["Autotuner", "CANDIDATES", "NEVER", "NOISE", "Settings", "autotuner_for", "search_plan",
           "start", "step"]

NOISE = 0.03  # a candidate must beat the best by 3 %: a tie keeps the settings in force

# Candidates, in the order the search tries the settings. Overlap: whether gradients are
# reduced during backward or all at step (RINGSYNC_OVERLAP); the fusion threshold and the
# cycle time decide how many tensors go together; the crossovers, which algorithm runs.
CANDIDATES = {
    "overlap": [True, False],
    "fusion_threshold": [1 << 20, 4 << 20, 16 << 20, 64 << 20, 128 << 20],
    "cycle_time_ms": [0.0, 0.5, 1.0, 2.5, 5.0],
    "small_allreduce_bytes": [4 << 10, 16 << 10, 64 << 10, 256 << 10],
    "staged_bytes": [256 << 10, 1 << 20, 4 << 20, NEVER],
}


@dataclasses.dataclass
class Sample:
    settings: Settings
    step_seconds: float  # the slowest rank's mean step time over the sample
    phase: str  # "warmup", "baseline", or the setting being tried


def search_plan(start: Settings, settings_to_tune) -> List[tuple]:
    """(setting, candidate) pairs in the order they are tried after the baseline."""
    return [(name, value) for name in settings_to_tune for value in CANDIDATES[name]
            if value != getattr(start, name)]


def start(comm, warmup_samples: Optional[int] = None, steps_per_sample: Optional[int] = None,
          max_samples: Optional[int] = None, log_path: Optional[str] = None) -> "Autotuner":
    """Tune comm from its next step() on, as RINGSYNC_AUTOTUNE=1 does from its first
    (unset arguments: the RINGSYNC_AUTOTUNE_* settings). Every rank calls it at the same
    step."""
    c = comm.config
    tuner = JOB.autotuners[comm] = Autotuner(
        comm, c.autotune_warmup_samples if warmup_samples is None else warmup_samples,
        steps_per_sample or c.autotune_steps_per_sample, max_samples or c.autotune_max_samples,
        log_path or c.autotune_log)
    return tuner


def autotuner_for(comm) -> Optional["Autotuner"]:
    """comm's tuner: the one start() made, or, where RINGSYNC_AUTOTUNE=1, one made now;
    None where nothing tunes comm."""
    tuner = JOB.autotuners.get(comm)
    if tuner is None and comm.config.autotune:
        tuner = start(comm)
    return tuner


def step(comm, overlap_matters: bool = False) -> None:
    """Called by the framework adapters once per training step (every rank alike): drives
    comm's tuner where there is one, else does nothing. overlap_matters: the caller reduces
    during backward where comm's overlap setting says so."""
    tuner = autotuner_for(comm)
    if tuner is not None:
        tuner.step(overlap_matters)


class Autotuner:
    """One communicator's tuner; every rank of it must call step() once per step."""

    def __init__(self, comm, warmup_samples: int = 3, steps_per_sample: int = 10,
                 max_samples: int = 20, log_path: Optional[str] = None):
        self.comm = comm
        self.overlap_matters = False  # whether some adapter reduces during backward
        self.warmup_left = max(0, warmup_samples)
        self.steps_per_sample = steps_per_sample
        self.max_samples = max_samples
        self.log_path = log_path if comm.rank() == 0 else None
        self.samples: List[Sample] = []
        self.done = False
        self.best: Optional[Sample] = None
        self.trying: Optional[Settings] = None  # the settings the current sample runs with
        self._plan: List[tuple] = []
        self.baseline: Optional[Sample] = None
        self._confirmed: List[Sample] = []
        # what the current sample is: warmup, baseline, the setting it tries, or confirm
        self._phase = "warmup" if warmup_samples > 0 else "baseline"
        self._steps = 0
        self._started = None
        self._log_rows: List[Dict] = []

    # ---- driven by the training loop ----

    def step(self, overlap_matters: bool = False) -> None:
        self.overlap_matters = self.overlap_matters or overlap_matters
        if self.done:
            return
        now = time.perf_counter()
        if self._started is None:  # the first step: the clock starts after it
            self.trying = self.comm.engine_settings()
            self._started = now
            return
        self._steps += 1
        if self._steps < self.steps_per_sample:
            return
        mean = self._slowest_mean(now - self._started)
        self._record(mean)
        self._steps = 0
        self._started = time.perf_counter()

    def _slowest_mean(self, elapsed: float) -> float:
        """The sample's mean step time on the slowest rank: every rank gets the same number
        (so every rank's search goes the same way)."""
        index = len(self.samples)
        worst = self.comm.allreduce(np.array([elapsed], np.float64), op=ReduceOp.MAX,
                                    name=f"ringsync.autotune.sample.{index}")
        return float(worst[0]) / self.steps_per_sample

    # ---- the search ----

    def _record(self, mean: float) -> None:
        sample = self._note(Sample(self.trying, mean, self._phase))
        if self._phase == "warmup":
            self.warmup_left -= 1
            self._phase = "warmup" if self.warmup_left > 0 else "baseline"
            return
        if self._phase == "baseline":
            self.best = self.baseline = sample
            self._plan = search_plan(sample.settings,
                                     [n for n in CANDIDATES if self._applies(n)])
        elif self._phase == "confirm":
            self._confirm(sample)
            return
        elif sample.step_seconds < self.best.step_seconds * (1 - NOISE):
            self.best = sample  # later candidates of other settings start from it
        tried = sum(1 for s in self.samples if s.phase not in ("warmup", "baseline"))
        self._plan = [(n, v) for n, v in self._plan if v != getattr(self.best.settings, n)]
        if self._plan and tried < self.max_samples - 1:
            self._phase, value = self._plan.pop(0)
            self._apply(self.best.settings.but(**{self._phase: value}))
        elif self.best is self.baseline:
            self._finish(self.baseline)
        else:  # time the start settings and the best again, one sample each
            self._phase, self._confirmed = "confirm", []
            self._apply(self.baseline.settings)

    def _confirm(self, sample: Sample) -> None:
        """One sample with the start settings, then one with the best: a choice that was
        only lucky once (the samples are short and the host may be busy) does not stay."""
        self._confirmed.append(sample)
        if len(self._confirmed) < 2:
            self._apply(self.best.settings)
            return
        start, best = self._confirmed
        self._finish(best if best.step_seconds < start.step_seconds * (1 - NOISE) else start)

    def _applies(self, name: str) -> bool:
        """The staged crossover matters only where every rank shares this host; overlap,
        only to an adapter that reduces during backward (torch's DistributedOptimizer)."""
        if name == "overlap":
            return self.overlap_matters
        return name != "staged_bytes" or self.comm.uses_lane

    def _apply(self, settings: Settings) -> None:
        self.trying = settings
        self.comm.tune(settings)

    def _finish(self, chosen: Sample) -> None:
        self.best = chosen
        self._apply(chosen.settings)
        self.done = True
        if chosen.settings == self.baseline.settings:
            why = ("no candidate beat the settings at the start by more than %d %% (twice)"
                   % (NOISE * 100))
        else:
            why = ("%.3f ms a step against %.3f ms with the settings at the start, timed "
                   "again one after the other" % (chosen.step_seconds * 1e3,
                                                  self._confirmed[0].step_seconds * 1e3))
        self._log_row(chosen, "chosen", why)

    # ---- the log (rank 0) ----

    def _note(self, sample: Sample) -> Sample:
        self.samples.append(sample)
        self._log_row(sample, sample.phase, "")
        return sample

    def _log_row(self, sample: Sample, phase: str, why: str) -> None:
        if self.log_path:
            self._log_rows.append({
                "sample": len(self.samples), "phase": phase,
                "fusion_threshold_bytes": sample.settings.fusion_threshold,
                "cycle_time_ms": sample.settings.cycle_time_ms,
                "small_allreduce_bytes": sample.settings.small_allreduce_bytes,
                "staged_bytes": sample.settings.staged_bytes,
                "step_ms": round(sample.step_seconds * 1e3, 4), "why": why})
            self._write_log()

    def _write_log(self) -> None:
        if not self.log_path:
            return
        with open(self.log_path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(self._log_rows[0]))
            writer.writeheader()
            writer.writerows(self._log_rows)
