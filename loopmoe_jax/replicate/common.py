"""What the replications share: the scales, the sweep runner, table and JSON helpers."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from loopmoe_jax.scaling.sweep import run_sweep
from loopmoe_jax.train.run import SUMMARY, RunDir

SCALES = ('cpu', 'gpu')
SMELT_RESAMPLES = {'cpu': 200, 'gpu': 2000}  # cell-bootstrap resamples of the SMELT analyses


def _sweep(cfg, grid, out, log):
  return run_sweep(cfg, grid, os.path.join(out, 'runs'), log=log)


def _columns(rows) -> dict[str, np.ndarray]:
  """The numeric fields of sweep rows as columns."""
  keys = [k for k, v in rows[0].items() if isinstance(v, (int, float, np.number))]
  return {k: np.array([r[k] for r in rows], float) for k in keys}


def _table(rows, keys) -> str:
  head = '| ' + ' | '.join(keys) + ' |\n|' + '---|' * len(keys) + '\n'
  fmt = lambda v: f'{v:.4g}' if isinstance(v, float) else str(v)
  return head + '\n'.join('| ' + ' | '.join(fmt(r[k]) for k in keys) + ' |' for r in rows)


def _training_seconds(out: str) -> float:
  """Sum of the wall time of every run under `out` (their summary.json)."""
  total = 0.0
  for root, _, files in os.walk(out):
    if SUMMARY in files:
      total += float(RunDir(root).summary().get('wall_s', 0.0))
  return total


def _mean(x) -> float:
  return float(np.mean(x)) if x is not None else float('nan')


def json_default(x: Any):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)
