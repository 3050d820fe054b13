"""Whether a design identifies a law's fitted parameters.

`check_fixed` refuses a fixed name a form lacks, naming those it has (and near names);
`check_holdouts` a holdout that selects no point, or every point; `check_identified` a
comparison where some fit has no more points than free parameters, naming the parameters it
could hold fixed. `design_warnings` names the fitted parameters the points cannot determine:
those tied to an axis that is constant where they are fitted (`Form.axes`: chinchilla's A and
alpha need N to vary), else those in the null space of the predictions' Jacobian at generic
parameter values (the points leave a combination of them free, e.g. the bounded mapping's
gamma and beta_r from a single looped pass count).
"""
from __future__ import annotations

import difflib
from typing import Mapping, Sequence

import numpy as np

from loopmoe_jax.scaling.forms import Form, get_form

_STEP = 1e-30  # complex step
_RANK_TOL = 1e-8  # singular values below this fraction of the largest count as zero


def check_fixed(form, fixed: Mapping[str, float]) -> dict:
  """The raw entries of `fixed` (named parameters); a ValueError naming the parameters of the
  form when a name is not one of them."""
  form = get_form(form)
  names = form.param_names()
  unknown = [k for k in fixed if k not in names]
  if unknown:
    near = sorted({m for k in unknown for m in difflib.get_close_matches(k, names, 3, 0.6)})
    hint = f' (did you mean {", ".join(near)}?)' if near else ''
    raise ValueError(f'cannot fix {sorted(unknown)} of law {form.name!r}{hint}; its '
                     f'parameters: {", ".join(names)}')
  return form.raw_of(dict(fixed))


def free_indices(form, fixed: Mapping[str, float] | None = None) -> list[int]:
  """The raw parameters of `form` a fit with `fixed` named values adjusts (their indices)."""
  form = get_form(form)
  held = form.raw_of(dict(fixed or {}))
  return [i for i, n in enumerate(form.raw) if n not in held]


def free_parameters(form, fixed: Mapping[str, float] | None = None) -> int:
  """How many raw parameters of `form` a fit with `fixed` named values adjusts."""
  return len(free_indices(form, fixed))


def free_names(form, fixed: Mapping[str, float] | None = None) -> list[str]:
  """The named parameters of `form` a fit with `fixed` adjusts."""
  form = get_form(form)
  names = form.param_names()
  return [names[i] for i in free_indices(form, fixed)]


def check_holdouts(cols: Mapping[str, np.ndarray], holdouts: Sequence[tuple[str, float]]):
  """Refuses a holdout whose axis is no column, that selects no point, or every point."""
  for axis, value in holdouts:
    if axis not in cols:
      raise ValueError(f'holdout {axis}={value:g}: the data have no column {axis!r} '
                       f'(columns: {", ".join(sorted(cols))})')
    values = np.asarray(cols[axis], dtype=np.float64)
    held = np.isclose(values, value)
    if not held.any():
      present = ', '.join(f'{v:g}' for v in np.unique(values))
      raise ValueError(f'holdout {axis}={value:g} selects no point: {axis} takes {present}')
    if held.all():
      raise ValueError(f'holdout {axis}={value:g} holds out every point ({axis} is {value:g} '
                       'at each): none is left to fit')


def check_identified(forms: Sequence[str], data, holdouts: Sequence[tuple[str, float]],
                     fixed: Mapping[str, float] | None = None):
  """Refuses (ValueError naming the counts and the parameters that could be held fixed) a
  comparison where some fit has no more points than free parameters: the full fit, or the fit
  left after any holdout."""
  check_holdouts(data, holdouts)
  n = len(data['loss'])
  for name in forms:
    p = free_parameters(name, fixed)
    for label, n_fit in [('the full grid', n)] + [
        (f'holding out {axis}={value:g}',
         int((~np.isclose(np.asarray(data[axis], float), value)).sum()))
        for axis, value in holdouts]:
      if n_fit <= p:
        grid = f', {p + 1 + n - n_fit} in the grid with {n - n_fit} held out' if n_fit < n else ''
        raise ValueError(f'cannot rank the forms: {label} leaves {n_fit} points to fit '
                         f'{get_form(name).name!r}, which has {p} free parameters (need at '
                         f'least {p + 1} points to fit{grid}); add points or fix terms '
                         f'(fixable: {", ".join(free_names(name, fixed))})')


def design_warnings(forms: Sequence[str], data, holdouts: Sequence[tuple[str, float]] = (),
                    fixed: Mapping[str, float] | None = None) -> list[str]:
  """One line per form and fit (all points, or the points a holdout leaves) whose points leave
  a fitted parameter unidentified (module docstring); [] when every fit is identified."""
  n = len(data['loss'])
  fits = [('', np.ones(n, bool))] + [
      (f' (holding out {axis}={value:g})', ~np.isclose(np.asarray(data[axis], float), value))
      for axis, value in holdouts]
  out = []
  for name in forms:
    form = get_form(name)
    for label, mask in fits:
      cols = {c: np.asarray(data[c], float)[mask] for c in form.columns + ('loss',)
              if c in data}
      lines = (_constant_axes(form, cols, free_names(form, fixed), label)
               or _null_space(form, cols, fixed, label))
      out += [line for line in lines if line not in out]
      if lines and not label:
        break  # every fit without some points shares the problem of the full one
  return out


def _constant_axes(form: Form, cols, free: list[str], label: str) -> list[str]:
  out, named = [], set()
  for columns, params in form.axes:
    hit = [p for p in params if p in free and p not in named]
    if not hit or any(c not in cols for c in columns):
      continue
    if all(len(np.unique(cols[c])) < 2 for c in columns):
      named.update(hit)
      what = ' and '.join(f'{c} ({cols[c][0]:g})' for c in columns)
      one = len(hit) == 1
      out.append(f'{form.name}: column{"s" if len(columns) > 1 else ""} {what} '
                 f'{"is" if len(columns) == 1 else "are"} constant over the '
                 f'{len(cols["loss"])} points fitted{label}, so {"/".join(hit)} '
                 f'{"is" if one else "are"} not identified: vary {" or ".join(columns)} or '
                 f'fix {"it" if one else "them"}')
  return out


def _null_space(form: Form, cols, fixed, label: str, draws: int = 3) -> list[str]:
  """The free parameters spanning the null space of d log L / d theta at `draws` generic
  parameter vectors (uniform around the form's grid of starts), when every draw has one."""
  free = free_indices(form, fixed)
  p, n = len(free), len(cols['loss'])
  if not p or n < p or any(c not in cols for c in form.columns):
    return []  # check_identified and the fit itself refuse these
  held = form.raw_of(dict(fixed or {}))
  base = np.array([held.get(r, 0.0) for r in form.raw], dtype=np.float64)
  rng = np.random.default_rng(0)
  best = None
  for _ in range(draws):
    theta = base.copy()
    for i in free:
      g = np.asarray(form.grid[form.raw[i]], dtype=np.float64)
      theta[i] = rng.uniform(g.min() - 0.25, g.max() + 0.25)
    jac = _jacobian(form, theta, free, cols)
    norm = np.linalg.norm(jac, axis=0)
    _, s, vt = np.linalg.svd(jac / np.where(norm > 0, norm, 1.0), full_matrices=True)
    rank = int((s > _RANK_TOL * max(s[0], 1e-300)).sum())  # a zero column: a zero value
    if best is None or rank > best[0]:
      best = (rank, vt[rank:], norm)
    if rank == p:
      return []
  rank, null, norm = best
  weight = np.max(np.abs(null), axis=0) if len(null) else np.zeros(p)
  names = form.param_names()
  hit = [names[free[j]] for j in range(p) if weight[j] > 0.2 or norm[j] == 0]
  return [f'{form.name}: the {n} points fitted{label} do not identify {"/".join(hit)} '
          f'(the fit\'s Jacobian has rank {rank} of {p}: a combination of them is free): '
          'vary the axes they depend on or fix some of them']


def _jacobian(form: Form, theta: np.ndarray, free: list[int], cols) -> np.ndarray:
  """d log L / d theta[free] at the points, (n, len(free)), by the complex step."""
  p = len(free)
  t = np.repeat(theta[:, None], p, axis=1).astype(np.complex128)
  t[free, np.arange(p)] += 1j * _STEP
  with np.errstate(all='ignore'):
    pred = form.log_loss(t[:, :, None], cols)  # (p, n)
  jac = np.asarray(pred.imag / _STEP).T
  return np.where(np.isfinite(jac), jac, 0.0)
