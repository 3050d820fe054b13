"""SMELT's analyses of a fitted `smelt` law L = E + A (1-S)^b / F^a + K / D^c.

Paper: SMELT (arXiv 2609.01343), its scaling-law section, as quoted in the article "SMELT:
looping wins even after you pay for the FLOPs" (heading "Does it survive at scale"; the
section number is not given there). docs/formulas.md, "SMELT", states the law and the efficiency in this project's symbols.

F is forward FLOPs per token (the sweep's `F` column), D training tokens, and training
compute C = m F D with m = 3 (forward + backward; the sweep's `C` column). At a fixed
sparsity S the compute-optimal split minimises L(S, F, C / (m F)) over F, in closed form:

  A_S = A (1-S)^b,   u = C / m,   g = (a A_S / (c K))^(1/(a+c))
  F* = g u^(c/(a+c)),   D* = u^(a/(a+c)) / g,
  L*(C) = E + kappa u^-gamma,   kappa = A_S g^-a + K g^c,   gamma = a c / (a + c).

gamma is the frontier exponent the paper compares between the baseline and SMELT (0.237 and
0.250 there). The compute reaching a loss L on the frontier is C(L) = m ((L-E)/kappa)^(-1/gamma).
Tokens per parameter at the optimum: D* / N*, with N* = F* / flops_per_param the active
parameters the FLOPs imply (2 forward FLOPs per parameter per token).

Compute efficiency (the paper, after Hernandez & Brown): "the fraction of training compute
SMELT saves at matched loss", 1 - C_SMELT(L) / C_baseline(L). The paper states it as a range
over its fitted compute window (6.8% at 1.3e19 to 18.0% at 2.2e21 FLOPs, growing with compute)
with "95% cell-bootstrap intervals (2,000 resamples of the twelve sparse grid cells)".
`paired_efficiency` follows that:
- a cell is one (sparsity, size) model of the grid with all of its training lengths (the
  paper's twelve = 4 sizes x 3 sparse levels); `unit='point'` makes each (cell, training
  length) its own cell instead. Cells are paired across the two grids by a `cell` column when
  both have one, else by their rank in (S, F) order (right when both grids are the same
  design, as the paper's matched pairs are);
- dense cells (S <= dense_tol) are dropped before anything is fitted or drawn;
- each resample draws the paired cells with replacement and takes BOTH architectures' rows
  of the drawn cells, refits both laws (from the full fits' optima) and reads the saving;
- the saving at a compute C is 1 - C_new(L_base*(C)) / C: the matched loss is the baseline
  frontier's loss at C, re-read in every resample (the paper's figures are per compute);
- it is read at the grid's minimum and maximum baseline compute and, per training length, at
  the geometric mean of the baseline's compute at that length (our choice: the paper's table
  rows are computes, and it does not say which);
- at a sparsity pair (s_base, s_new), by default the median S of each grid's paired sparse
  rows (the paper does not say at which sparsity its range is read).
Intervals are the 2.5th and 97.5th percentiles of the resamples (2,000 by default).

`cell_bootstrap` resamples one grid's cells for a statistic of its own law (gamma, the
optimum); `report` gathers both for a baseline and a SMELT grid.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from loopmoe_jax.scaling.fitting import Fit, as_columns, fit, subset

TRAIN_FLOPS_FACTOR = 3.0  # C = 3 F D for forward FLOPs F per token
FLOPS_PER_PARAM = 2.0     # forward FLOPs per active parameter per token
DENSE_S = 1e-6            # S at or below this is a dense cell, left out of the analyses
UNITS = ('model', 'point')


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


def saving_at_compute(base: Mapping[str, float], new: Mapping[str, float], compute: float,
                      s_base: float, s_new: float) -> float:
  """1 - C_new(L) / C at L = the baseline frontier's loss at training compute C."""
  loss = optimum(base, s_base, compute)['loss']
  return 1.0 - compute_for_loss(new, s_new, loss) / compute


def _checked(data, name: str) -> dict:
  cols = as_columns(data)
  for k in ('S', 'F', 'D', 'loss'):
    if k not in cols:
      raise ValueError(f'{name} grid needs a {k!r} column (have {sorted(cols)})')
  bad = cols['S'][~((cols['S'] >= 0) & (cols['S'] < 1))]
  if bad.size:
    raise ValueError(f'{name} grid: S must lie in [0, 1); got {bad[:3].tolist()}')
  return cols


def sparse(cols: Mapping[str, np.ndarray], dense_tol: float = DENSE_S) -> dict:
  """The rows of sparse cells (S > dense_tol); the paper's analyses use its sparse cells."""
  return subset(cols, np.asarray(cols['S']) > dense_tol)


def _labels(cols, unit: str) -> np.ndarray:
  if unit not in UNITS:
    raise ValueError(f'unit={unit!r}: expected one of {UNITS}')
  keys = ['cell'] if 'cell' in cols else ['S', 'F']
  if unit == 'point':
    keys.append('D')
  return np.stack([np.asarray(cols[k], float) for k in keys], axis=1)


def cells(cols, unit: str = 'model') -> np.ndarray:
  """The cell index of each row: one cell per distinct `cell` label, or (S, F) model without
  one (unit='point': per (cell, D) point)."""
  _, index = np.unique(_labels(cols, unit), axis=0, return_inverse=True)
  return index.reshape(-1)


def paired_cells(base, new, unit: str = 'model') -> tuple[np.ndarray, np.ndarray, int]:
  """(cell of each baseline row, cell of each new row, cell count): equal indices are one
  grid point of both architectures; -1 marks a row whose cell the other grid lacks (only with
  `cell` columns; without them both grids must have the same number of cells)."""
  if ('cell' in base) != ('cell' in new):
    raise ValueError('pairing cells: give both grids a `cell` column or neither '
                     f'(baseline has one: {"cell" in base}, looped: {"cell" in new})')
  lb, ln = _labels(base, unit), _labels(new, unit)
  if 'cell' in base:
    common = sorted(set(map(tuple, lb)) & set(map(tuple, ln)))
    index = {k: i for i, k in enumerate(common)}
    of = lambda lab: np.array([index.get(tuple(r), -1) for r in lab], int)
    return of(lb), of(ln), len(common)
  ub, ib = np.unique(lb, axis=0, return_inverse=True)
  un, inn = np.unique(ln, axis=0, return_inverse=True)
  if len(ub) != len(un):
    raise ValueError(f'cannot pair cells by (S, F) rank: the baseline grid has {len(ub)} '
                     f'sparse cells and the looped grid {len(un)}; give both a `cell` column')
  return ib.reshape(-1), inn.reshape(-1), len(ub)


def _interval(samples) -> tuple[float, float]:
  """The 2.5th and 97.5th percentiles; nearest order statistics when some samples are
  infinite (a resample whose looped frontier never reaches the matched loss saves -inf)."""
  samples = np.asarray(samples, float)
  method = 'linear' if np.all(np.isfinite(samples)) else 'nearest'
  return tuple(float(np.percentile(samples, q, method=method)) for q in (2.5, 97.5))


def _check_resamples(resamples: int):
  if int(resamples) < 1:
    raise ValueError(f'resamples={resamples}: need at least 1')


def cell_bootstrap(data, statistic: Callable[[Mapping[str, float]], float | dict],
                   resamples: int = 2000, seed: int = 0, base: Fit | None = None) -> dict:
  """{'value', 'ci': (lo, hi), 'samples'} (a dict of those per key when `statistic` returns
  a dict) of a statistic of one grid's fitted smelt law, over resamples of its cells."""
  _check_resamples(resamples)
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
    return {'value': float(v), 'ci': _interval(samples), 'samples': np.asarray(samples, float)}
  if isinstance(value, dict):
    return {k: summary(value[k], [d[k] for d in draws]) for k in value}
  return summary(value, draws)


def grid_computes(cols: Mapping[str, np.ndarray]) -> list[tuple[str, float]]:
  """[(label, C)]: the grid's minimum compute, the geometric mean of its compute at each
  training length D (ascending), and its maximum compute."""
  c = _train_compute(cols)
  d = np.asarray(cols['D'], float)
  per_length = [(f'D={x:.3g}', float(np.exp(np.mean(np.log(c[d == x]))))) for x in np.unique(d)]
  return [('min compute', float(c.min()))] + per_length + [('max compute', float(c.max()))]


def _train_compute(cols) -> np.ndarray:
  if 'C' in cols:
    return np.asarray(cols['C'], float)
  return TRAIN_FLOPS_FACTOR * np.asarray(cols['F'], float) * np.asarray(cols['D'], float)


def paired_efficiency(base_data, new_data, computes=(), losses=(), grid: bool = True,
                      sparsity: tuple[float, float] | None = None, resamples: int = 2000,
                      seed: int = 0, unit: str = 'model', dense_tol: float = DENSE_S) -> dict:
  """The compute saving of `new` against `base` with a cell-paired bootstrap (module doc).

  Read at `grid_computes` of the baseline's paired sparse rows (when `grid`), then at
  `computes` [(label, C)], then at the matched `losses` [(label, L)] (`compute_efficiency`).
  Returns {'cells', 'sparsity', 'window': (C_min, C_max) of the baseline's paired rows,
  'params': {'baseline', 'smelt'}, 'points': [{'at', 'compute', 'loss', 'value', 'ci',
  'samples'}]}, a point's 'compute' and 'loss' being the point fit's (C, matched loss) pair.
  """
  _check_resamples(resamples)
  cb = sparse(_checked(base_data, 'baseline'), dense_tol)
  cn = sparse(_checked(new_data, 'looped'), dense_tol)
  ib, inn, n_cells = paired_cells(cb, cn, unit)
  cb, cn = subset(cb, ib >= 0), subset(cn, inn >= 0)
  ib, inn = ib[ib >= 0], inn[inn >= 0]
  if n_cells < 2 or min(len(ib), len(inn)) < 7:
    raise ValueError(f'paired sparse grid too small: {n_cells} cells, {len(ib)} baseline and '
                     f'{len(inn)} looped rows (the law has 6 coefficients)')
  computes = (grid_computes(cb) if grid else []) + list(computes)
  losses = list(losses)
  if not computes + losses:
    raise ValueError('paired_efficiency: nothing to read (grid=False, no computes or losses)')
  for label, c in computes:
    if not c > 0:
      raise ValueError(f'compute {label!r}={c}: must be positive')
  if sparsity is None:
    sparsity = (float(np.median(cb['S'])), float(np.median(cn['S'])))
  sb, sn = sparsity
  fb, fn = fit('smelt', cb), fit('smelt', cn)

  def savings(pb, pn):
    return ([saving_at_compute(pb, pn, c, sb, sn) for _, c in computes]
            + [compute_efficiency(pb, pn, x, sb, sn) for _, x in losses])

  rows_b = [np.flatnonzero(ib == k) for k in range(n_cells)]
  rows_n = [np.flatnonzero(inn == k) for k in range(n_cells)]
  rng = np.random.default_rng(seed)
  draws = []
  for _ in range(resamples):
    chosen = rng.integers(0, n_cells, n_cells)
    pb = fit('smelt', subset(cb, np.concatenate([rows_b[k] for k in chosen])),
             starts=fb.theta[None], top=1).params
    pn = fit('smelt', subset(cn, np.concatenate([rows_n[k] for k in chosen])),
             starts=fn.theta[None], top=1).params
    draws.append(savings(pb, pn))
  draws = np.asarray(draws, float)
  value = savings(fb.params, fn.params)
  at = ([(label, c, optimum(fb.params, sb, c)['loss']) for label, c in computes]
        + [(label, compute_for_loss(fb.params, sb, x), x) for label, x in losses])
  points = [{'at': label, 'compute': float(c), 'loss': float(x), 'value': float(value[j]),
             'ci': _interval(draws[:, j]), 'samples': draws[:, j]}
            for j, (label, c, x) in enumerate(at)]
  c = _train_compute(cb)
  return {'cells': n_cells, 'unit': unit, 'sparsity': (float(sb), float(sn)),
          'window': (float(c.min()), float(c.max())), 'resamples': int(resamples),
          'params': {'baseline': dict(fb.params), 'smelt': dict(fn.params)}, 'points': points}


def report(base_data, new_data, compute: float, loss: float | None = None,
           resamples: int = 2000, seed: int = 0, unit: str = 'model',
           dense_tol: float = DENSE_S) -> dict:
  """The paper's figures for a baseline grid and a looped (SMELT) grid, on their sparse rows
  (dense cells dropped), each at its own sparsity (the median S of its sparse rows): the
  fitted law ('params'), gamma and the optimum at `compute` (F*, D*, tokens per parameter)
  with cell-bootstrap intervals; 'compute_efficiency', the saving at `compute` (at a matched
  `loss` when given), and 'efficiency_range', the saving across the grid's compute range,
  both from one cell-paired bootstrap (`paired_efficiency`)."""
  out, grids = {}, {}
  for name, data in (('baseline', base_data), ('smelt', new_data)):
    cols = grids[name] = sparse(_checked(data, name), dense_tol)
    s = float(np.median(cols['S']))
    f = fit('smelt', cols)
    stat = lambda p, s=s: {'gamma': frontier_exponent(p), **optimum(p, s, compute)}
    out[name] = {'S': s, 'params': dict(f.params),
                 **cell_bootstrap(cols, stat, resamples, seed, f)}
  asked = {'losses': [('requested loss', loss)]} if loss is not None else {
      'computes': [('requested compute', compute)]}
  eff = paired_efficiency(grids['baseline'], grids['smelt'], **asked, resamples=resamples,
                          seed=seed + 1, unit=unit, dense_tol=dense_tol)
  *grid_points, out['compute_efficiency'] = eff['points']
  out['efficiency_range'] = {**eff, 'points': grid_points}
  return out
