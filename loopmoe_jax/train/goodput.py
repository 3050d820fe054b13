"""Where a run's wall time goes: training steps against compiling, waiting for data, saving,
restoring and evaluating (the trainer times each), and step-time percentiles.

    clock = Goodput()
    with clock.spent('data'):
      batch = next(it)
    clock.step(seconds)          # one train step's dispatch-to-dispatch time
    row = clock.row()            # goodput, time_<kind>_s, step_time_p50/p90_s

`goodput` is the fraction of the wall time since the process started the run (restore and
compile included) spent in train steps. A restart's lost time is what it spends again on
restoring and compiling (a compile cache hit makes that small: train/compile_cache.py).
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

KINDS = ('compile', 'data', 'save', 'restore', 'eval')


class Goodput:

  def __init__(self, clock=time.perf_counter):
    self.clock, self.t0 = clock, clock()
    self.spent_s = dict.fromkeys(KINDS, 0.0)
    self.step_s: list[float] = []

  @contextlib.contextmanager
  def spent(self, kind: str):
    t = self.clock()
    try:
      yield
    finally:
      self.spent_s[kind] += self.clock() - t

  def step(self, seconds: float):
    self.step_s.append(seconds)

  def row(self) -> dict:
    """The run's figures so far; step percentiles over the steps since the last row."""
    wall = max(self.clock() - self.t0, 1e-9)
    train = max(wall - sum(self.spent_s.values()), 0.0)
    out = {'goodput': train / wall, **{f'time_{k}_s': v for k, v in self.spent_s.items()}}
    if self.step_s:
      p50, p90 = np.percentile(self.step_s, [50, 90])
      out.update(step_time_p50_s=float(p50), step_time_p90_s=float(p90))
    self.step_s = []
    return out
