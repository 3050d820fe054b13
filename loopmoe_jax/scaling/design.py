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
- `joint_optimum(fit, C, passes, candidates, memory_bytes)`: the (r, E) of lowest predicted
  loss among the expert counts whose weights fit, every pair at the same training compute C
  (the seed's joint optimum; weights, hence memory, do not depend on r).
- `multiplier(fit, cols)` / `multiplier_asymptote(fit, cols)`: the seed's effective-parameter
  multiplier M(r) = N_eff(r) / N (N = N_active_pass; M(1) = 1) and its limit as r -> inf,
  M_inf = 1 + gamma N_b / N for the bounded mapping and 1 + gamma0 rho^-delta N_b / N for the
  sparsity-conditional one (inf for linear and power with phi > 0).
- `isoflop(fit, C, passes, cols)`: the seed's IsoFLOP curves, predicted loss against the
  per-pass active size N at fixed training compute C for each r, with
  D = C / (6 (N + (r-1) N_b)), N_b = block_fraction N, and each curve's minimum.
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


def _check_budget(compute: float, passes: Sequence[int]) -> list[int]:
  if not compute > 0:
    raise ValueError(f'compute must be > 0 FLOPs; got {compute!r}')
  passes = list(passes)
  if not passes or any(r < 1 for r in passes):
    raise ValueError(f'passes must be a non-empty sequence of counts >= 1; got {passes}')
  return passes


def _pass_rows(fit: Fit, compute: float, passes: Sequence[int], cols: Mapping[str, float],
               active: float, active_block: float) -> list[dict]:
  """Predicted loss per pass count at training compute C: D = C / (6 (active + (r-1)
  active_block))."""
  passes = _check_budget(compute, passes)
  if not active > 0 or not active_block >= 0:
    raise ValueError(f'active must be > 0 and active_block >= 0; got active={active!r}, '
                     f'active_block={active_block!r}')
  rows = []
  for r in passes:
    d = compute / (6.0 * (active + (r - 1) * active_block))
    rows.append({'r': r, 'D': d, 'loss': _predict(fit, {**cols, 'r': r, 'D': d})})
  return rows


def optimal_passes(fit: Fit, compute: float, passes: Sequence[int], cols: Mapping[str, float],
                   active: float, active_block: float, tol: float | None = None) -> dict:
  """Compute-optimal passes at fixed experts.

  cols: the law's columns other than r and D (N_active_pass, N_block_active, k, E).
  active / active_block: active params per token outside/of one pass of the looped block
  (training FLOPs per token are 6 (active + (r-1) active_block)).
  """
  tol = fit.rmse if tol is None else tol
  table = _pass_rows(fit, compute, passes, cols, active, active_block)
  best = table[0]
  for row in table[1:]:
    if best['loss'] - row['loss'] <= tol:
      break
    best = row
  return {'r': best['r'], 'loss': best['loss'], 'tol': tol, 'table': table}


def _by_memory(candidates: Mapping[int, Mapping[str, float]], memory_bytes: float,
               bytes_per_param: float) -> list[tuple[int, dict, float, bool]]:
  """(E, the law's columns, weight bytes, fits) per candidate, E ascending; raises when no
  candidate's params_total * bytes_per_param fits in memory_bytes."""
  if not bytes_per_param > 0:
    raise ValueError(f'bytes_per_param must be > 0; got {bytes_per_param!r}')
  if not candidates:
    raise ValueError('candidates is empty: give E -> columns with params_total')
  out = []
  for e in sorted(candidates):
    cols = dict(candidates[e])
    if 'params_total' not in cols:
      raise ValueError(f'candidate E={e} has no params_total (stored params, for its memory)')
    mem = cols.pop('params_total') * bytes_per_param
    out.append((e, cols, mem, mem <= memory_bytes))
  if not any(fits for *_, fits in out):
    e, _, mem, _ = min(out, key=lambda row: row[2])
    raise ValueError(f'no candidate fits in memory_bytes={memory_bytes:.6g}: the smallest, '
                     f'E={e}, needs {mem:.6g} bytes at {bytes_per_param:g} bytes/param')
  return out


def memory_optimal_experts(fit: Fit, candidates: Mapping[int, Mapping[str, float]],
                           memory_bytes: float, bytes_per_param: float = 2.0,
                           tol: float | None = None) -> dict:
  """Memory-optimal experts at fixed passes under a weight-memory limit.

  candidates: E -> the law's columns at that E plus `params_total` (stored params).
  """
  tol = fit.rmse if tol is None else tol
  table = [{'E': e, 'memory_bytes': mem, 'fits': fits, 'loss': _predict(fit, cols)}
           for e, cols, mem, fits in _by_memory(candidates, memory_bytes, bytes_per_param)]
  feasible = [row for row in table if row['fits']]
  best = feasible[0]
  for row in feasible[1:]:
    if best['loss'] - row['loss'] > tol:
      best = row
  return {'E': best['E'], 'loss': best['loss'], 'tol': tol, 'table': table}


def joint_optimum(fit: Fit, compute: float, passes: Sequence[int],
                  candidates: Mapping[int, Mapping[str, float]], memory_bytes: float,
                  bytes_per_param: float = 2.0) -> dict:
  """The (r, E) of lowest predicted loss whose weights fit, at training compute C.

  candidates: E -> N_active_pass, N_block_active, k, params_total (stored params) and any other
  law columns but r and D; optionally `active` / `active_block`, the active params per token
  for the FLOPs (default N_active_pass / N_block_active). For each pass count r,
  D = C / (6 (active + (r-1) active_block)) as in `optimal_passes`; weight memory
  params_total * bytes_per_param does not depend on r. Returns r, E, loss, D and the table of
  every (r, E) with its memory and whether it fits.
  """
  table = []
  for e, cols, mem, fits in _by_memory(candidates, memory_bytes, bytes_per_param):
    if 'r' in cols or 'D' in cols:
      raise ValueError(f'candidate E={e} gives r or D: joint_optimum sets them from `passes` '
                       'and `compute`')
    active = cols.pop('active', cols.get('N_active_pass'))
    active_block = cols.pop('active_block', cols.get('N_block_active'))
    if active is None or active_block is None:
      raise ValueError(f'candidate E={e} needs N_active_pass and N_block_active (or active '
                       'and active_block)')
    cols.setdefault('E', float(e))
    for row in _pass_rows(fit, compute, passes, cols, active, active_block):
      table.append({'r': row['r'], 'E': e, 'D': row['D'], 'loss': row['loss'],
                    'memory_bytes': mem, 'fits': fits})
  best = min((row for row in table if row['fits']), key=lambda row: row['loss'])
  return {'r': best['r'], 'E': best['E'], 'loss': best['loss'], 'D': best['D'],
          'table': table}


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


# Effective-parameter multiplier and IsoFLOP curves ------------------------------------------

def _loop_columns(fit: Fit, cols: Mapping, need: Sequence[str]) -> dict:
  if fit.form.n_eff is None:
    raise ValueError(f'law {fit.form.name!r} has no N_eff: the multiplier is a loop law\'s '
                     '(loop_<mapping>)')
  missing = [k for k in need if k not in cols]
  if missing:
    raise ValueError(f'the multiplier needs columns {list(need)}; missing {missing}')
  out = {k: np.asarray(v, float) for k, v in cols.items()}
  if np.any(out['N_active_pass'] <= 0):
    raise ValueError('N_active_pass must be > 0')
  return out


def _shaped(x, c: Mapping, need: Sequence[str]) -> float | np.ndarray:
  """x broadcast to the shape of the columns it was asked over; a float for scalars."""
  x = np.broadcast_to(np.asarray(x, float), np.broadcast_shapes(*(c[k].shape for k in need)))
  return float(x) if x.ndim == 0 else np.array(x)


def multiplier(fit: Fit, cols: Mapping) -> float | np.ndarray:
  """The seed's effective-parameter multiplier M(r) = N_eff(r) / N, N = N_active_pass
  (M(1) = 1). cols: N_active_pass, N_block_active, r, E, k (scalars or arrays)."""
  need = ('N_active_pass', 'N_block_active', 'r', 'E', 'k')
  c = _loop_columns(fit, cols, need)
  return _shaped(fit.form.n_eff(fit.theta, c) / c['N_active_pass'], c, need)


def multiplier_asymptote(fit: Fit, cols: Mapping) -> float | np.ndarray:
  """M_inf = lim_{r -> inf} N_eff(r) / N: 1 + gamma N_b / N (bounded), 1 + gamma0 rho^-delta
  N_b / N (sparse_bounded, rho = k/E: more experts raise it when delta > 0), inf for linear and
  power with phi > 0. cols: N_active_pass, N_block_active, E, k."""
  need = ('N_active_pass', 'N_block_active', 'E', 'k')
  c = _loop_columns(fit, cols, need)
  if fit.form.n_eff_limit is None:
    raise ValueError(f'law {fit.form.name!r}: its mapping gives no limit as r -> inf '
                     '(register_mapping(..., limit=...))')
  return _shaped(fit.form.n_eff_limit(fit.theta, c) / c['N_active_pass'], c, need)


def isoflop(fit: Fit, compute: float, passes: Sequence[int], cols: Mapping | None = None,
            sizes: Sequence[float] | None = None, block_fraction: float = 0.5) -> list[dict]:
  """IsoFLOP curves: predicted loss against the per-pass active size N at training compute C,
  one curve per pass count r, with D = C / (6 (N + (r-1) N_b)), N_b = block_fraction N.

  cols: the law's other columns (E, k). sizes: the N grid (default 101 sizes log-spaced over
  [min N* / 10, max N* * 10]). Returns per r: r, C, N (S,), D (S,), loss (S,), and the curve's
  minimum N_opt, D_opt, loss_opt (found by `frontier_loss`, off the grid).
  """
  passes = _check_budget(compute, passes)
  if not 0.0 <= block_fraction <= 1.0:
    raise ValueError(f'block_fraction must be in [0, 1]; got {block_fraction!r}')
  if fit.form.n_eff is None and any(r != 1 for r in passes):
    raise ValueError(f'law {fit.form.name!r} has no passes: only r = 1 (a loop_<mapping> law '
                     'for more)')
  cols = dict(cols or {})
  per_token = {r: 6.0 * (1.0 + (r - 1) * block_fraction) for r in passes}
  optima = {r: frontier_loss(fit, compute, {**cols, 'r': r}, per_token[r], block_fraction)
            for r in passes}
  if sizes is None:
    n_opt = [n for _, n in optima.values()]
    sizes = np.geomspace(min(n_opt) / 10.0, max(n_opt) * 10.0, 101)
  n = np.asarray(sizes, float)
  if n.ndim != 1 or not np.all(n > 0):
    raise ValueError('sizes must be a 1-D sequence of positive active sizes N')
  curves = []
  for r in passes:
    d = compute / (per_token[r] * n)
    loss = fit.predict({**{k: np.full(n.shape, v, float) for k, v in cols.items()},
                        'N': n, 'N_active_pass': n, 'N_block_active': block_fraction * n,
                        'D': d, 'r': np.full(n.shape, float(r))})
    loss_opt, n_star = optima[r]
    curves.append({'r': r, 'C': compute, 'N': n, 'D': d, 'loss': loss, 'N_opt': n_star,
                   'D_opt': compute / (per_token[r] * n_star), 'loss_opt': loss_opt})
  return curves
