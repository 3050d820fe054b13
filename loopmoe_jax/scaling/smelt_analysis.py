"""SMELT's analyses of a fitted `smelt` law L = E + A (1-S)^b / F^a + K / D^c.

F is forward FLOPs per token (the sweep's `F` column), D training tokens, and training
compute C = m F D with m = 3 (forward + backward; the sweep's `C` column). At a fixed
sparsity S the compute-optimal split minimises L(S, F, C / (m F)) over F, in closed form:

  A_S = A (1-S)^b,   u = C / m,   g = (a A_S / (c K))^(1/(a+c))
  F* = g u^(c/(a+c)),   D* = u^(a/(a+c)) / g,
  L*(C) = E + kappa u^-gamma,   kappa = A_S g^-a + K g^c,   gamma = a c / (a + c).

gamma is the frontier exponent the paper compares between the baseline and SMELT (0.237 and
0.250 there). The compute reaching a loss L on the frontier is C(L) = m ((L-E)/kappa)^(-1/gamma);
the compute-efficiency figure (Hernandez & Brown) is 1 - C_new(L) / C_baseline(L) at a matched
loss. Tokens per parameter at the optimum: D* / N*, with N* = F* / flops_per_param the
active parameters the FLOPs imply (2 forward FLOPs per parameter per token).

Intervals: a cell bootstrap resamples the grid's cells (the distinct (S, F) models, each with
all of its D points) with replacement, refits from the full fit's optimum, and reports the
2.5th and 97.5th percentiles (2,000 resamples by default).
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from loopmoe_jax.scaling.fitting import Fit, as_columns, fit, subset

TRAIN_FLOPS_FACTOR = 3.0  # C = 3 F D for forward FLOPs F per token
FLOPS_PER_PARAM = 2.0     # forward FLOPs per active parameter per token


def frontier_exponent(p: Mapping[str, float]) -> float:
  return p['a'] * p['c'] / (p['a'] + p['c'])


def _split(p: Mapping[str, float], sparsity: float):
  a_s = p['A'] * (1.0 - sparsity) ** p['b']
  g = (p['a'] * a_s / (p['c'] * p['K'])) ** (1.0 / (p['a'] + p['c']))
  kappa = a_s * g ** -p['a'] + p['K'] * g ** p['c']
  return g, kappa


def optimum(p: Mapping[str, float], sparsity: float, compute: float,
            m: float = TRAIN_FLOPS_FACTOR) -> dict:
  """F*, D*, L* and tokens per (active) parameter at training compute C."""
  a, c = p['a'], p['c']
  g, kappa = _split(p, sparsity)
  u = compute / m
  f_opt = g * u ** (c / (a + c))
  d_opt = u ** (a / (a + c)) / g
  loss = p['E'] + kappa * u ** -frontier_exponent(p)
  return {'F': f_opt, 'D': d_opt, 'loss': loss,
          'tokens_per_param': d_opt / (f_opt / FLOPS_PER_PARAM)}


def compute_for_loss(p: Mapping[str, float], sparsity: float, loss: float,
                     m: float = TRAIN_FLOPS_FACTOR) -> float:
  """The training compute at which the frontier reaches `loss` (inf at or below E)."""
  if loss <= p['E']:
    return float('inf')
  _, kappa = _split(p, sparsity)
  return m * ((loss - p['E']) / kappa) ** (-1.0 / frontier_exponent(p))


def compute_efficiency(base: Mapping[str, float], new: Mapping[str, float], loss: float,
                       s_base: float, s_new: float) -> float:
  """1 - C_new / C_baseline at a matched loss: the share of training compute saved."""
  return 1.0 - compute_for_loss(new, s_new, loss) / compute_for_loss(base, s_base, loss)


def cells(cols) -> np.ndarray:
  """The cell index of each row: one cell per distinct (S, F) model."""
  keys = np.stack([np.asarray(cols['S'], float), np.asarray(cols['F'], float)], axis=1)
  _, index = np.unique(keys, axis=0, return_inverse=True)
  return index.reshape(-1)


def cell_bootstrap(data, statistic: Callable[[Mapping[str, float]], float | dict],
                   resamples: int = 2000, seed: int = 0, base: Fit | None = None) -> dict:
  """{'value', 'ci': (lo, hi), 'samples'} (a dict of those per key when `statistic` returns
  a dict) of a statistic of the fitted smelt law, over cell resamples."""
  cols = as_columns(data)
  base = base or fit('smelt', cols)
  cell_of = cells(cols)
  n_cells = cell_of.max() + 1
  rng = np.random.default_rng(seed)
  draws = []
  for _ in range(resamples):
    chosen = rng.integers(0, n_cells, n_cells)
    rows = np.concatenate([np.flatnonzero(cell_of == k) for k in chosen])
    f = fit('smelt', subset(cols, rows), starts=base.theta[None], top=1)
    draws.append(statistic(f.params))
  value = statistic(base.params)

  def summary(v, samples):
    samples = np.asarray(samples, float)
    return {'value': float(v), 'ci': (float(np.percentile(samples, 2.5)),
                                      float(np.percentile(samples, 97.5))),
            'samples': samples}
  if isinstance(value, dict):
    return {k: summary(value[k], [d[k] for d in draws]) for k in value}
  return summary(value, draws)


def report(base_data, new_data, compute: float, loss: float | None = None,
           resamples: int = 2000, seed: int = 0) -> dict:
  """The paper's figures for a baseline grid and a looped (SMELT) grid, each at its own
  sparsity (the median S of its rows): the fitted law ('params'), gamma, the optimum at `compute` (F*, D*, tokens per
  parameter) with intervals, and the compute efficiency at a matched `loss` (default: the
  baseline frontier's loss at `compute`) with an interval from paired resamples."""
  out = {}
  fits = {}
  for name, data in (('baseline', base_data), ('smelt', new_data)):
    cols = as_columns(data)
    s = float(np.median(cols['S']))
    fits[name] = (fit('smelt', cols), s, cols)
    stat = lambda p, s=s: {'gamma': frontier_exponent(p),
                           **{k: v for k, v in optimum(p, s, compute).items()}}
    out[name] = {'S': s, 'params': dict(fits[name][0].params),
                 **cell_bootstrap(cols, stat, resamples, seed, fits[name][0])}
  (fb, sb, cb), (fn, sn, cn) = fits['baseline'], fits['smelt']
  target = loss if loss is not None else optimum(fb.params, sb, compute)['loss']
  rng = np.random.default_rng(seed + 1)
  draws = []
  for _ in range(resamples):
    ps = []
    for f, cols in ((fb, cb), (fn, cn)):
      cell_of = cells(cols)
      chosen = rng.integers(0, cell_of.max() + 1, cell_of.max() + 1)
      rows = np.concatenate([np.flatnonzero(cell_of == k) for k in chosen])
      ps.append(fit('smelt', subset(cols, rows), starts=f.theta[None], top=1).params)
    draws.append(compute_efficiency(ps[0], ps[1], target, sb, sn))
  eff = compute_efficiency(fb.params, fn.params, target, sb, sn)
  out['compute_efficiency'] = {'loss': target, 'value': eff,
                               'ci': (float(np.percentile(draws, 2.5)),
                                      float(np.percentile(draws, 97.5))),
                               'samples': np.asarray(draws)}
  return out
