"""N_eff mappings of the loop laws (the seed's Eq. 3-7; docs/formulas.md, "Loop laws"): how
many effective parameters r passes of the looped block give, from the active parameters of one
pass (N_active_pass) and of one pass of the looped block (N_block_active). `forms.moe_form`
builds the law `loop_<name>` of each; `forms.register_mapping` adds one.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

Columns = Mapping[str, np.ndarray]


# Loop mappings ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LoopMapping:
  """N_eff(theta_map, cols): extra raw names, the function, named view and starts, and N_eff
  as r -> inf (`limit`, None when not given). N_eff is built from the active parameters of one
  pass (`N_active_pass`) and of one pass of the looped block (`N_block_active`), never from
  stored counts."""
  raw: tuple[str, ...]
  n_eff: Callable[[np.ndarray, Columns], np.ndarray]
  named: Callable[[np.ndarray], dict]
  raw_of: Callable[[Mapping[str, float]], dict]
  grid: Mapping[str, Sequence[float]]
  columns: tuple[str, ...] = ('N_active_pass', 'N_block_active', 'D', 'r', 'E', 'k')
  limit: Callable[[np.ndarray, Columns], np.ndarray] | None = None


def _rho(c):
  """Active ratio k/E; dense points (E = 0 or 1) have rho = 1."""
  k, e = np.asarray(c['k'], float), np.asarray(c['E'], float)
  return np.where(e > 1, k / np.maximum(e, 1.0), 1.0)


def _bounded(n, nb, r, gamma, beta_r):
  return n + gamma * nb * (1.0 - np.exp(-beta_r * (r - 1.0)))


def _log_pair(names):
  def named(t):
    return {n: np.exp(v) for n, v in zip(names, t)}
  def raw_of(p):
    return {f'log_{n}': np.log(p[n]) for n in names if n in p}
  return named, raw_of


_bn, _br = _log_pair(('gamma', 'beta_r'))


def _sparse_named(t):
  return {'gamma0': np.exp(t[0]), 'beta0': np.exp(t[1]), 'delta': t[2]}


def _sparse_raw(p):
  out = {f'log_{n}': np.log(p[n]) for n in ('gamma0', 'beta0') if n in p}
  if 'delta' in p:
    out['delta'] = p['delta']
  return out


def _n(c):
  return c['N_active_pass']


def _nb(c):
  return c['N_block_active']


def _linear_limit(t, c):
  return np.where(_nb(c) > 0, np.inf, _n(c))


def _power_limit(t, c):
  """r^phi -> inf (phi > 0), 1 (phi = 0), 0 (phi < 0)."""
  n, nb, phi = _n(c), _nb(c), t[0]
  return np.where(nb == 0, n, np.where(phi > 0, np.inf, np.where(phi == 0, n, n - nb)))


def _sparse_gamma(t, c):
  return np.exp(t[0]) * _rho(c) ** -t[2]


MAPPINGS: dict[str, LoopMapping] = {
    'linear': LoopMapping((), lambda t, c: _n(c) + (c['r'] - 1.0) * _nb(c),
                          lambda t: {}, lambda p: {}, {}, limit=_linear_limit),
    'power': LoopMapping(('phi',),
                         lambda t, c: _n(c) - _nb(c) + np.power(c['r'], t[0]) * _nb(c),
                         lambda t: {'phi': t[0]},
                         lambda p: {k: p[k] for k in ('phi',) if k in p},
                         {'phi': (0.3, 0.7, 1.0)}, limit=_power_limit),
    'bounded': LoopMapping(('log_gamma', 'log_beta_r'),
                           lambda t, c: _bounded(_n(c), _nb(c), c['r'], np.exp(t[0]),
                                                 np.exp(t[1])),
                           _bn, _br, {'log_gamma': (0.0, 1.5), 'log_beta_r': (-1.5, 0.0)},
                           limit=lambda t, c: _n(c) + np.exp(t[0]) * _nb(c)),
    'sparse_bounded': LoopMapping(
        ('log_gamma0', 'log_beta0', 'delta'),
        lambda t, c: _bounded(_n(c), _nb(c), c['r'], _sparse_gamma(t, c),
                              np.exp(t[1]) * _rho(c) ** t[2]),
        _sparse_named, _sparse_raw,
        {'log_gamma0': (0.0, 1.5), 'log_beta0': (-1.5, 0.0), 'delta': (0.0, 0.5)},
        limit=lambda t, c: _n(c) + _sparse_gamma(t, c) * _nb(c)),
}
