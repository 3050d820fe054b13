"""One-command mini-replications of the three papers: `run(name, out, scale)` (one module per
paper: loop_laws.py, smelt.py, foil.py; common.py what they share).

Each pipeline trains its grid with the sweep runner (same seed and data order for every
point; finished points are skipped, interrupted ones resume), analyses the results with the
scaling-law code, and writes OUT/report.md (our figures beside the paper's, marked as a
different scale), OUT/results.json, OUT/sweep.csv and plots.

- loop_laws: sizes x training lengths x passes x core experts on the loop-laws family; the
  loop forms (linear, power, bounded, sparsity-conditional bounded), each with its data term,
  ranked by held-out RMSE at the largest pass count, expert count and size, with paired
  bootstrap intervals of the differences (no winner named when they cover 0); r* at three
  budgets, N_eff/N, IsoFLOP curves and the joint (r, E) optimum of the best form.
- smelt: the baseline and its compute-matched looped twin, each on a grid of widths x expert
  pools x training lengths; SMELT's law fitted per architecture, its compute-optimal frontier
  (gamma, tokens per parameter) and the compute saved at a matched loss (Hernandez & Brown),
  with cell-bootstrap intervals (scaling/smelt_analysis.py).
- foil: the looped-block shapes (E, D, L) at equal parameters and a tied-attention control
  (Base-tied) on one data order: final losses, paired differences over every step of the
  final window against Base and Base-tied, and the routing diagnostics per shape.

`scale='cpu'` fits two CPU cores in under 30 minutes each; `scale='gpu'` widens the models
and runs longer (about an hour on one H200; not run in CI).
"""
from __future__ import annotations

import json
import os
import time

from loopmoe_jax.replicate.common import SCALES, SMELT_RESAMPLES, json_default, _training_seconds
from loopmoe_jax.replicate import foil, loop_laws, smelt

__all__ = ['PIPELINES', 'SCALES', 'SMELT_RESAMPLES', 'run']

PIPELINES = {'loop_laws': loop_laws.run, 'smelt': smelt.run, 'foil': foil.run}


def run(name: str, out: str, scale: str = 'cpu', log=print) -> dict:
  if name not in PIPELINES:
    raise ValueError(f'unknown replication {name!r}; known: {sorted(PIPELINES)}')
  if scale not in SCALES:
    raise ValueError(f'--scale={scale!r}: must be one of {SCALES}')
  os.makedirs(out, exist_ok=True)
  t0 = time.time()
  results, report = PIPELINES[name](out, scale, log)
  wall = time.time() - t0
  train_s = _training_seconds(out)
  results = {'name': name, 'scale': scale, 'wall_s': wall, 'training_s': train_s, **results}
  with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1, default=json_default)
  with open(os.path.join(out, 'report.md'), 'w') as f:
    f.write(report + f'\nTraining time (sum over the points\' runs): {train_s / 60:.1f} min; this '
            f'invocation: {wall / 60:.1f} min (finished points are skipped).\n')
  log(f'{name}: report {os.path.join(out, "report.md")} ({wall / 60:.1f} min)')
  return results
