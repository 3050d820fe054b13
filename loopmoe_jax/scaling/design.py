"""Design from fitted laws: compute-optimal N and D, passes, experts, and compute efficiency.

- `chinchilla_optimal(params, C)`: with C = 6 N D, G = (alpha A / (beta B))^(1/(alpha+beta)),
  N* = G (C/6)^(beta/(alpha+beta)), D* = (C/6)^(alpha/(alpha+beta)) / G.
- `optimal_passes(fit, C, ...)`: at fixed experts, predicted loss for each pass count at the
  same training compute (tokens D = C / (6 (active + (r-1) active_block))); walking the passes
  in order, a pass is accepted only when it lowers the predicted loss by more than `tol`
  (default the fit's RMSE); the last accepted pass is r*.
- `memory_optimal_experts(fit, candidates, memory_bytes)`: among expert counts whose weights
  fit in memory (params_total * bytes_per_param), walking E upwards, more experts are accepted
  only when they lower the predicted loss by more than `tol`.
- `frontier_loss` / `compute_for_loss` / `compute_efficiency`: a fitted law's compute-optimal
  frontier L*(C) = min_N L(N, C / (c N)), the compute reaching a loss on it, and Hernandez &
  Brown's efficiency 1 - C_new / C_baseline at a matched loss.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from scipy import optimize

from loopmoe_jax.scaling.fitting import Fit


def chinchilla_optimal(params: Mapping[str, float], compute: float) -> tuple[float, float]:
  """Compute-optimal (N, D) for a Chinchilla law's params at `compute` FLOPs (C = 6 N D)."""
  a, b = params['alpha'], params['beta']
  g = (a * params['A'] / (b * params['B'])) ** (1.0 / (a + b))
  c6 = compute / 6.0
  return g * c6 ** (b / (a + b)), c6 ** (a / (a + b)) / g


def _predict(fit: Fit, cols: Mapping[str, float]) -> float:
  return float(fit.predict({k: np.atleast_1d(np.asarray(v, float)) for k, v in cols.items()})[0])


def optimal_passes(fit: Fit, compute: float, passes: Sequence[int], cols: Mapping[str, float],
                   active: float, active_block: float, tol: float | None = None) -> dict:
  """Compute-optimal passes at fixed experts.

  cols: the law's columns other than r and D (N_active_pass, N_block_active, k, E).
  active / active_block: active params per token outside/of one pass of the looped block
  (training FLOPs per token are 6 (active + (r-1) active_block)).
  """
  tol = fit.rmse if tol is None else tol
  table = []
  for r in passes:
    d = compute / (6.0 * (active + (r - 1) * active_block))
    table.append({'r': r, 'D': d, 'loss': _predict(fit, {**cols, 'r': r, 'D': d})})
  best = table[0]
  for row in table[1:]:
    if best['loss'] - row['loss'] <= tol:
      break
    best = row
  return {'r': best['r'], 'loss': best['loss'], 'tol': tol, 'table': table}


def memory_optimal_experts(fit: Fit, candidates: Mapping[int, Mapping[str, float]],
                           memory_bytes: float, bytes_per_param: float = 2.0,
                           tol: float | None = None) -> dict:
  """Memory-optimal experts at fixed passes under a weight-memory limit.

  candidates: E -> the law's columns at that E plus `params_total` (stored params).
  """
  tol = fit.rmse if tol is None else tol
  table = []
  for e in sorted(candidates):
    cols = dict(candidates[e])
    mem = cols.pop('params_total') * bytes_per_param
    table.append({'E': e, 'memory_bytes': mem, 'fits': mem <= memory_bytes,
                  'loss': _predict(fit, cols)})
  feasible = [row for row in table if row['fits']]
  if not feasible:
    raise ValueError(f'no candidate fits in {memory_bytes:.3g} bytes')
  best = feasible[0]
  for row in feasible[1:]:
    if best['loss'] - row['loss'] > tol:
      best = row
  return {'E': best['E'], 'loss': best['loss'], 'tol': tol, 'table': table}


def frontier_loss(fit: Fit, compute: float, cols: Mapping[str, float] | None = None,
                  flops_per_param_token: float = 6.0, block_fraction: float = 0.0) -> tuple:
  """L*(C) = min over N of the law at D = C / (c N); returns (loss, N*).

  cols: fixed extra columns (r, k, E); block_fraction: N_block_active = fraction * N for loop
  laws (N the active params of one pass)
  (then c should include the passes' cost, e.g. 6 (1 + (r-1) fraction)).
  """
  if fit.form.name == 'smelt':
    raise ValueError('the smelt law has no N column: its frontier is over F at a fixed S, '
                     'in closed form in loopmoe_jax.scaling.smelt_analysis')
  cols = dict(cols or {})

  def loss(log_n):
    n = np.exp(log_n)
    return _predict(fit, {**cols, 'N': n, 'N_active_pass': n,
                          'N_block_active': block_fraction * n,
                          'D': compute / (flops_per_param_token * n)})

  hi = np.log(compute / flops_per_param_token)  # D >= 1 token
  grid = np.linspace(np.log(1e3), hi, 200)
  i = int(np.argmin([loss(x) for x in grid]))
  lo_b, hi_b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
  res = optimize.minimize_scalar(loss, bounds=(lo_b, hi_b), method='bounded',
                                 options=dict(xatol=1e-10))
  return float(res.fun), float(np.exp(res.x))


def compute_for_loss(fit: Fit, loss: float, lo: float = 1e12, hi: float = 1e32,
                     **frontier_kw) -> float:
  """The compute at which the fitted frontier reaches `loss` (inf when it never does)."""
  f = lambda log_c: frontier_loss(fit, np.exp(log_c), **frontier_kw)[0] - loss
  if f(np.log(hi)) > 0:
    return float('inf')
  if f(np.log(lo)) < 0:
    raise ValueError(f'loss {loss} is already reached at C={lo:.3g}')
  return float(np.exp(optimize.brentq(f, np.log(lo), np.log(hi), xtol=1e-12)))


def compute_efficiency(baseline: Fit, new: Fit, loss: float, baseline_kw=None,
                       new_kw=None) -> float:
  """Hernandez & Brown: 1 - C_new / C_baseline at a matched loss on the two frontiers."""
  c_base = compute_for_loss(baseline, loss, **(baseline_kw or {}))
  c_new = compute_for_loss(new, loss, **(new_kw or {}))
  return 1.0 - c_new / c_base
