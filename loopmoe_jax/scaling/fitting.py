"""Fitting a law: Huber loss on log-loss residuals, L-BFGS from a grid of starts.

    res = fit('chinchilla', data)          # data: mapping of arrays or a DataFrame
    res.params, res.rmse, res.predict(other)

Objective (Hoffmann et al.; Besiroglu et al. 2024): sum_i Huber_delta(log L_hat_i - log L_i)
with delta = 1e-3, divided by delta so that the optimiser's tolerances see O(1) values
(the argmin is unchanged). Starts: the objective is evaluated on the form's whole grid of
starts (the product of per-parameter values) and L-BFGS-B (scipy) runs from the `top` best
grid points; the lowest final objective is kept. Gradients are exact, by the complex step
(each form's prediction is analytic in its parameters).

`bootstrap` resamples points with replacement and refits from the full fit; `heldout_rmse`
fits without the rows where an axis takes a value and scores those rows; `compare` tabulates
forms by in-sample and held-out RMSE (in loss units); `rank` adds paired bootstrap intervals
of the held-out RMSE differences and says when the data cannot tell the best form from
another. Both first refuse a grid with no more points than a fit's free parameters or a
holdout that selects no point (`check_identified`), and log a warning for each fitted
parameter the points leave unidentified (identify.py, `design_warnings`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import optimize

from loopmoe_jax.scaling.forms import Form, get_form
# check_fixed .. free_parameters are this module's API too (fitting.free_parameters, ...)
from loopmoe_jax.scaling.identify import (  # pylint: disable=unused-import
    check_fixed, check_holdouts, check_identified, design_warnings, free_indices, free_names,
    free_parameters)

log = logging.getLogger('loopmoe_jax')

_STEP = 1e-30  # complex step


def _one_blas_thread():
  """L-BFGS-B's small dense updates are ~40x slower with a multi-threaded BLAS on a busy
  machine; limit BLAS to one thread while fitting (threadpoolctl, when installed)."""
  try:
    from threadpoolctl import threadpool_limits
  except ImportError:
    return contextlib.nullcontext()
  return threadpool_limits(1)


def as_columns(data) -> dict[str, np.ndarray]:
  """A mapping of arrays or a DataFrame -> dict of float64 numpy arrays."""
  keys = list(data.keys())
  out = {}
  for k in keys:
    v = data[k]
    v = v.to_numpy() if hasattr(v, 'to_numpy') else v
    try:
      out[str(k)] = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
      continue  # text columns (names, paths) are carried by the caller, not the fit
  return out


def subset(cols: Mapping[str, np.ndarray], mask) -> dict[str, np.ndarray]:
  return {k: v[mask] for k, v in cols.items()}


@dataclasses.dataclass
class Fit:
  form: Form
  theta: np.ndarray            # raw parameters (see form.raw)
  params: dict[str, float]     # named parameters
  rmse: float                  # in-sample RMSE of the loss (not log-loss)
  objective: float             # Huber objective / delta at the optimum
  n: int
  converged: bool
  n_free: int = -1             # parameters fitted (not held fixed)

  def predict(self, data) -> np.ndarray:
    cols = as_columns(data)
    self.form.check(cols)
    return self.form.loss(self.theta, cols)

  def __repr__(self):
    ps = ', '.join(f'{k}={v:.4g}' for k, v in self.params.items())
    return f'Fit({self.form.name}: {ps}; rmse={self.rmse:.4g}, n={self.n})'


class _Objective:
  """Huber(delta)/delta summed over points, with the complex-step gradient; some raw entries
  may be held fixed."""

  def __init__(self, form: Form, cols, delta: float, fixed: Mapping[str, float]):
    self.form, self.cols, self.delta = form, cols, delta
    self.target = np.log(cols['loss'])
    self.free = [i for i, n in enumerate(form.raw) if n not in fixed]
    self.base = np.array([fixed.get(n, 0.0) for n in form.raw], dtype=np.float64)

  def full(self, x):
    """Raw vector(s) from free entries; x: (P_free,) or (P_free, G)."""
    x = np.asarray(x)
    t = np.broadcast_to(self.base.reshape((-1,) + (1,) * (x.ndim - 1)),
                        (len(self.base),) + x.shape[1:]).astype(x.dtype, copy=True)
    t[self.free] = x
    return t

  def _huber(self, r):
    a = np.abs(r)
    return np.where(a <= self.delta, 0.5 * r * r, self.delta * (a - 0.5 * self.delta))

  def batch(self, xs):
    """Objective at many free vectors xs: (G, P_free) -> (G,)."""
    t = self.full(xs.T)[:, :, None]  # (P, G, 1)
    with np.errstate(all='ignore'):
      r = self.form.log_loss(t, self.cols) - self.target
      v = self._huber(r).sum(-1) / self.delta
    return np.where(np.isfinite(v), v, np.inf)

  def __call__(self, x):
    p = len(x)
    xc = x[:, None] + 1j * _STEP * np.eye(p)             # (P_free, P_free): column j perturbs j
    t = self.full(xc)[:, :, None]                         # (P, P_free, 1)
    with np.errstate(all='ignore'):
      pred = self.form.log_loss(t, self.cols)             # (P_free, n)
    r = pred[0].real - self.target
    jac = pred.imag / _STEP                               # d pred / d x_j, (P_free, n)
    value = self._huber(r).sum() / self.delta
    grad = jac @ (np.clip(r, -self.delta, self.delta) / self.delta)
    if not np.isfinite(value) or not np.all(np.isfinite(grad)):
      return 1e30, np.zeros(p)
    return float(value), grad


def grid_starts(form: Form, fixed=()) -> np.ndarray:
  names = [n for n in form.raw if n not in fixed]
  return np.array(list(itertools.product(*(form.grid[n] for n in names))), dtype=np.float64)


def fit(form, data, *, delta: float = 1e-3, top: int = 16, starts=None,
        fixed: Mapping[str, float] | None = None, maxiter: int = 3000) -> Fit:
  """Fits `form` (a name in FORMS or a Form) to `data` (columns `loss` + the form's).

  starts: raw vectors (S, P_free) to evaluate instead of the form's grid; `top` of them, the
  lowest objective first, seed L-BFGS. fixed: named parameters held at a value (e.g.
  {'alpha': 0.34}; `B`=0 drops the data term).
  """
  form = get_form(form)
  cols = as_columns(data)
  form.check(cols)
  if 'loss' not in cols:
    raise ValueError('data needs a `loss` column')
  fixed_raw = check_fixed(form, fixed or {})
  obj = _Objective(form, cols, delta, fixed_raw)
  xs = grid_starts(form, fixed_raw) if starts is None else np.atleast_2d(starts)
  vals = obj.batch(xs)
  order = np.argsort(vals, kind='stable')[:max(1, top)]
  best = None
  with _one_blas_thread():
    for i in order:
      r = optimize.minimize(obj, xs[i], jac=True, method='L-BFGS-B',
                            options=dict(maxiter=maxiter, ftol=1e-14, gtol=1e-10))
      if best is None or r.fun < best.fun:
        best = r
  theta = obj.full(best.x)
  pred = form.loss(theta, cols)
  rmse = float(np.sqrt(np.mean((pred - cols['loss']) ** 2)))
  params = {k: float(v) for k, v in form.named(theta).items()}
  return Fit(form, theta, params, rmse, float(best.fun), len(cols['loss']), bool(best.success),
             len(obj.free))


def bootstrap(form, data, n: int = 100, seed: int = 0, base: Fit | None = None,
              **fit_kw) -> dict[str, Any]:
  """Resamples points with replacement n times, refitting from the full fit's optimum.

  Returns {'samples': {name: (n,)}, 'se': {name: std}, 'ci': {name: (2.5%, 97.5%)}}.
  """
  form = get_form(form)
  cols = as_columns(data)
  base = base or fit(form, cols, **fit_kw)
  fixed = fit_kw.pop('fixed', None)
  free = free_indices(form, fixed)
  rng = np.random.default_rng(seed)
  m = len(cols['loss'])
  samples = {k: [] for k in base.params}
  for _ in range(n):
    idx = rng.integers(0, m, m)
    f = fit(form, subset(cols, idx), starts=base.theta[free][None], top=1, fixed=fixed,
            **{k: v for k, v in fit_kw.items() if k not in ('starts', 'top')})
    for k, v in f.params.items():
      samples[k].append(v)
  samples = {k: np.array(v) for k, v in samples.items()}
  return {'samples': samples, 'se': {k: float(np.std(v, ddof=1)) for k, v in samples.items()},
          'ci': {k: (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5)))
                 for k, v in samples.items()}}


def heldout_predictions(form, data, axis: str, value: float,
                        **fit_kw) -> tuple[np.ndarray, np.ndarray]:
  """(predicted, observed) loss on the rows where `axis` == value, from a fit without them."""
  cols = as_columns(data)
  held = np.isclose(cols[axis], value)
  if not held.any() or held.all():
    raise ValueError(f'holding out {axis}={value} leaves no train or no test rows')
  f = fit(form, subset(cols, ~held), **fit_kw)
  test = subset(cols, held)
  return f.predict(test), test['loss']


def heldout_rmse(form, data, axis: str, value: float, **fit_kw) -> float:
  """Fits without the rows where `axis` == value; RMSE of the loss on those rows."""
  pred, obs = heldout_predictions(form, data, axis, value, **fit_kw)
  return float(np.sqrt(np.mean((pred - obs) ** 2)))


def check_design(forms: Sequence[str], data, holdouts: Sequence[tuple[str, float]],
                 fixed: Mapping[str, float] | None = None):
  """check_identified, then one warning (the 'loopmoe_jax' logger) per fitted parameter the
  points leave unidentified."""
  cols = as_columns(data)
  check_identified(forms, cols, holdouts, fixed)
  for line in design_warnings(forms, cols, holdouts, fixed):
    log.warning(line)


def rank(forms: Sequence[str], data, holdouts: Sequence[tuple[str, float]],
         resamples: int = 1000, level: float = 0.95, seed: int = 0, **fit_kw) -> dict:
  """Forms by held-out RMSE, with paired bootstrap intervals of the differences.

  Every form is fitted once per holdout (`heldout_predictions`). Score = mean over the holdouts
  of the held-out RMSE. Each resample draws the held-out points with replacement within each
  holdout, the same draw for every form (paired), and recomputes every form's score; the
  interval of score(form) - score(best) is its (1-level)/2 .. (1+level)/2 percentiles. The
  intervals cover the spread of the held-out points, not the refits' own variability.

  Returns {'table': rows (form, n_params, rmse, heldout {axis: rmse}, score, diff_lo, diff_hi)
  by score, 'heldout': {form: {axis: rmse}}, 'fits': {form: Fit on every point}, 'best',
  'indistinguishable': forms whose interval covers 0, 'distinguishable': whether no other form's interval covers 0}.
  """
  if resamples < 1:
    raise ValueError(f'resamples={resamples}: need >= 1')
  if not 0.0 < level < 1.0:
    raise ValueError(f'level={level}: must lie in (0, 1)')
  check_design(forms, data, holdouts, fit_kw.get('fixed'))
  cols = as_columns(data)
  # keyed by the axis (by axis=value when an axis is held out at more than one value)
  axes = [axis for axis, _ in holdouts]
  labels = [axis if axes.count(axis) == 1 else f'{axis}={value:g}' for axis, value in holdouts]
  errs, rows, fits = {}, [], {}
  for name in forms:
    f = fits[get_form(name).name] = fit(name, cols, **fit_kw)
    errs[name] = [np.subtract(*heldout_predictions(name, cols, axis, value, **fit_kw))
                  for axis, value in holdouts]
    held = {lab: float(np.sqrt(np.mean(e ** 2))) for lab, e in zip(labels, errs[name])}
    rows.append({'form': get_form(name).name, 'key': name, 'n_params': f.n_free,
                 'rmse': f.rmse, 'heldout': held, 'score': float(np.mean(list(held.values()))),
                 'params': f.params})
  rows.sort(key=lambda r: r['score'])
  best = rows[0]['key']
  rng = np.random.default_rng(seed)
  draws = [rng.integers(0, len(e), (resamples, len(e))) for e in errs[best]]
  boot = {name: np.mean([np.sqrt(np.mean(e[d] ** 2, axis=1)) for e, d in zip(errs[name], draws)],
                        axis=0) for name in errs}
  lo_q, hi_q = 50 * (1 - level), 50 * (1 + level)
  for r in rows:
    diff = boot[r['key']] - boot[best]
    r['diff_lo'], r['diff_hi'] = float(np.percentile(diff, lo_q)), float(np.percentile(diff, hi_q))
  tied = [r['form'] for r in rows[1:] if r['diff_lo'] <= 0.0]
  return {'table': rows, 'heldout': {r['form']: r['heldout'] for r in rows}, 'fits': fits,
          'best': rows[0]['form'], 'indistinguishable': tied, 'distinguishable': not tied,
          'level': level, 'resamples': resamples}


def compare(forms: Sequence[str], data, holdouts: Sequence[tuple[str, float]] = (),
            parsimony: float = 0.05, fits: Mapping[str, Fit] | None = None,
            check: bool = True, **fit_kw) -> list[dict]:
  """One row per form: parameters, in-sample RMSE, held-out RMSE per (axis, value) and their
  mean (in-sample RMSE when there are no holdouts). fits: the forms' fits on every point,
  when already made (by form name; the others are fitted here). check: `check_design` first
  (False: the caller has).

  Ranking: by the mean held-out RMSE, except that forms within a factor (1 + parsimony) of the
  best are tied and ranked by fewer parameters first (a form nested in a larger one, e.g.
  linear in power with phi = 1, otherwise loses to it by noise alone)."""
  if check:
    check_design(forms, data, holdouts, fit_kw.get('fixed'))
  rows = []
  for name in forms:
    f = (fits or {}).get(name) or fit(name, data, **fit_kw)
    row = {'form': get_form(name).name, 'n_params': f.n_free, 'rmse': f.rmse,
           'params': f.params}
    for axis, value in holdouts:
      row[f'heldout[{axis}={value:g}]'] = heldout_rmse(name, data, axis, value, **fit_kw)
    held = [v for k, v in row.items() if k.startswith('heldout[')]
    row['heldout_mean'] = float(np.mean(held)) if held else f.rmse
    rows.append(row)
  best = min(r['heldout_mean'] for r in rows)
  tied = lambda r: r['heldout_mean'] <= (1.0 + parsimony) * best
  return sorted(rows, key=lambda r: (not tied(r), r['n_params'] if tied(r) else 0,
                                     r['heldout_mean']))


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
  """A plain-text table of `compare` rows (parameters on the right)."""
  if not rows:
    return ''
  keys = [k for k in rows[0] if k not in ('params',)]
  lines = ['  '.join(f'{k:>18}' for k in keys) + '  params']
  for r in rows:
    cells = [f'{r[k]:>18.5g}' if isinstance(r[k], float) else f'{str(r[k]):>18}' for k in keys]
    ps = ', '.join(f'{k}={v:.4g}' for k, v in r.get('params', {}).items())
    lines.append('  '.join(cells) + '  ' + ps)
  return '\n'.join(lines)


def from_params(form, params: Mapping[str, float]) -> Fit:
  """A Fit holding given named parameters (a known law, e.g. to design with or to test)."""
  form = get_form(form)
  raw = form.raw_of({**form.defaults, **dict(params)})
  missing = [n for n in form.raw if n not in raw]
  if missing:
    raise ValueError(f'law {form.name!r}: parameters for raw {missing} are missing')
  theta = np.array([raw[n] for n in form.raw], dtype=np.float64)
  return Fit(form, theta, {k: float(v) for k, v in form.named(theta).items()}, 0.0, 0.0, 0,
             True)
