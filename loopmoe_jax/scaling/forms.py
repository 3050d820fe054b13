"""Scaling-law forms: log-loss predictions over an unconstrained parameter vector.

Every form predicts log L from data columns (numpy arrays) and a raw vector `theta`. The
positive constants are optimised in log space (A = exp(a), B = exp(b), E = exp(e)), so the
Chinchilla-like forms are log L = LSE(a - alpha log N_eff, b - beta log D, e) (Hoffmann et al.;
Besiroglu et al. 2024). Predictions are written with numpy operations that are analytic in
`theta`, so fitting can take exact gradients by the complex step (see fitting.py).

Forms (`FORMS[name]`):
  chinchilla           L = E + A/N^alpha + B/D^beta                               (N, D)
  clark                log L = a log N + b log Ê + c log N log Ê + d,             (N, E)
                       1/Ê = 1/(E - 1 + (1/E_start - 1/E_max)^-1) + 1/E_max
  smelt                L = E + A (1-S)^b / F^a + K / D^c                          (S, F, D)
  moe                  L = E + A Ê^-delta_e N^-(alpha + gamma_e ln Ê)
                             + B Ê^-omega_e D^-(beta + zeta_e ln Ê),  Ê = E/k        (N, D, E, k)
  loop_<mapping>       the moe law with N -> N_eff from MAPPINGS
                       (N_active_pass, N_block_active, D, r, E, k)

Reduced forms (tests/test_scaling_laws.py): r = 1 gives the moe law on the per-pass active
params; one expert (Ê = 1, rho = 1) gives the dense loop law L = E + A/N_eff^alpha + B/D^beta;
both give Chinchilla's law.

Loop mappings (N = active params of one pass, N_b = active params of one pass of the looped
block, r = passes, rho = k/E):
  linear          N + (r-1) N_b                                   (unrolled; no parameters)
  power           (N - N_b) + r^phi N_b                           (Iso-Depth)
  bounded         N + gamma N_b (1 - exp(-beta_r (r-1)))          (finite asymptote, = N at r=1)
  sparse_bounded  bounded with gamma = gamma0 rho^-delta, beta_r = beta0 rho^delta
A mapping is pluggable: `register_mapping(name, raw_names, fn, to_named, grid)` adds
`loop_<name>` (e.g. to swap in a published form).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

Columns = Mapping[str, np.ndarray]


def lse(*terms):
  """log(sum(exp(terms))), stable, analytic in complex inputs (shift by the real max)."""
  stack = np.stack(np.broadcast_arrays(*terms))
  real = stack.real
  m = np.max(np.where(np.isfinite(real), real, -np.inf), axis=0)
  m = np.where(np.isfinite(m), m, 0.0)
  return m + np.log(np.sum(np.exp(stack - m), axis=0))


@dataclasses.dataclass(frozen=True)
class Form:
  """A law: raw parameter names, required columns, log-loss prediction, named params."""
  name: str
  columns: tuple[str, ...]
  raw: tuple[str, ...]
  log_loss: Callable[[np.ndarray, Columns], np.ndarray]   # (theta, cols) -> log L
  named: Callable[[np.ndarray], dict]                       # theta -> named params
  raw_of: Callable[[Mapping[str, float]], dict]             # named -> raw (for fixing)
  grid: Mapping[str, Sequence[float]]                       # starting values per raw name
  defaults: Mapping[str, float] = dataclasses.field(default_factory=dict)  # for from_params

  def loss(self, theta, cols: Columns) -> np.ndarray:
    return np.exp(self.log_loss(np.asarray(theta), cols))

  def check(self, cols: Columns):
    missing = [c for c in self.columns if c not in cols]
    if missing:
      raise ValueError(f'law {self.name!r} needs columns {list(self.columns)}; missing '
                       f'{missing} (have {sorted(cols)})')


# Chinchilla ------------------------------------------------------------------------------

_BASE_RAW = ('a', 'b', 'e', 'alpha', 'beta')
_BASE_GRID = {'a': (0, 5, 10, 15, 20, 25), 'b': (0, 5, 10, 15, 20, 25),
              'e': (-1, -0.5, 0, 0.5, 1), 'alpha': (0, 0.5, 1, 1.5, 2),
              'beta': (0, 0.5, 1, 1.5, 2)}


def _base_named(t):
  return {'A': np.exp(t[0]), 'B': np.exp(t[1]), 'E': np.exp(t[2]), 'alpha': t[3],
          'beta': t[4]}


def _base_raw(p):
  out = {}
  for big, small in (('A', 'a'), ('B', 'b'), ('E', 'e')):
    if big in p:
      out[small] = np.log(p[big]) if p[big] > 0 else -np.inf
  out.update({k: p[k] for k in ('alpha', 'beta') if k in p})
  return out


def _chinchilla_log_loss(t, c, n=None):
  n = c['N'] if n is None else n
  return lse(t[0] - t[3] * np.log(n), t[1] - t[4] * np.log(c['D']), t[2])


CHINCHILLA = Form('chinchilla', ('N', 'D'), _BASE_RAW, _chinchilla_log_loss, _base_named,
                  _base_raw, _BASE_GRID)


# Clark et al. (routed) -----------------------------------------------------------------------

def _e_hat(e, e_start, e_max):
  return 1.0 / (1.0 / (e - 1.0 + 1.0 / (1.0 / e_start - 1.0 / e_max)) + 1.0 / e_max)


def _clark_log_loss(t, c):
  e_start = 1.0 + np.exp(t[4])
  e_max = e_start + np.exp(t[5])
  log_n, log_e = np.log(c['N']), np.log(_e_hat(c['E'], e_start, e_max))
  return t[0] * log_n + t[1] * log_e + t[2] * log_n * log_e + t[3]


def _clark_named(t):
  e_start = 1.0 + np.exp(t[4])
  return {'a': t[0], 'b': t[1], 'c': t[2], 'd': t[3], 'E_start': e_start,
          'E_max': e_start + np.exp(t[5])}


def _clark_raw(p):
  out = {k: p[k] for k in 'abcd' if k in p}
  if 'E_start' in p:
    out['log_es'] = np.log(p['E_start'] - 1.0)
    if 'E_max' in p:
      out['log_em'] = np.log(p['E_max'] - p['E_start'])
  return out


CLARK = Form('clark', ('N', 'E'), ('a', 'b', 'c', 'd', 'log_es', 'log_em'), _clark_log_loss,
             _clark_named, _clark_raw,
             {'a': (-0.1, -0.03), 'b': (-0.1, -0.01), 'c': (0.0, 0.005), 'd': (1.0, 2.0, 3.0),
              'log_es': (-1.0, 0.5), 'log_em': (3.0, 6.0)})


# SMELT ----------------------------------------------------------------------------------

def _smelt_log_loss(t, c):
  return lse(t[0], t[1] + t[2] * np.log1p(-c['S']) - t[3] * np.log(c['F']),
             t[4] - t[5] * np.log(c['D']))


def _smelt_named(t):
  return {'E': np.exp(t[0]), 'A': np.exp(t[1]), 'b': t[2], 'a': t[3], 'K': np.exp(t[4]),
          'c': t[5]}


def _smelt_raw(p):
  out = {k: p[k] for k in ('b', 'a', 'c') if k in p}
  for big, small in (('E', 'e'), ('A', 'log_A'), ('K', 'log_K')):
    if big in p:
      out[small] = np.log(p[big]) if p[big] > 0 else -np.inf
  return out


SMELT = Form('smelt', ('S', 'F', 'D'), ('e', 'log_A', 'b', 'a', 'log_K', 'c'), _smelt_log_loss,
             _smelt_named, _smelt_raw,
             {'e': (-0.5, 0.5), 'log_A': (0, 5, 10, 15), 'b': (0.0, 0.5, 1.0),
              'a': (0.1, 0.3, 0.6), 'log_K': (0, 5, 10, 15), 'c': (0.1, 0.3, 0.6)})


# Loop laws ------------------------------------------------------------------------------

# The MoE base law ------------------------------------------------------------------------
#
# The loop laws replace the active-parameter term of an MoE scaling law with N_eff (the seed's
# Eq. 9). Its equations were lost in the text copy; this base is the joint MoE law of
# Ludziejewski et al. (2025) in this file's positive-exponent convention, over the active
# parameters N (per pass) and the effective expert expansion Ê:
#   L = E + A Ê^-delta_e N^-(alpha + gamma_e ln Ê) + B Ê^-omega_e D^-(beta + zeta_e ln Ê)
# with Ê = E/k for top-k routing over E experts (the seed: "the number of experts under top-1
# routing"), 1 for dense points (E <= 1) and when every expert is active. At Ê = 1 every
# expert term vanishes and the law is Chinchilla's on N. Clark et al.'s saturating transform of
# Ê is the `clark` form's; here Ê enters directly (a documented choice where the seed is
# silent; swap it through `expansion`).

def expansion(c):
  """Ê: E/k for top-k routing over E experts; 1 for dense points (E <= 1 or k = 0)."""
  k, e = np.asarray(c['k'], float), np.asarray(c['E'], float)
  return np.where((e > 1) & (k > 0), e / np.maximum(k, 1.0), 1.0)


_MOE_RAW = _BASE_RAW + ('delta_e', 'gamma_e', 'omega_e', 'zeta_e')
_MOE_GRID = {'delta_e': (0.0,), 'gamma_e': (0.0,), 'omega_e': (0.0,), 'zeta_e': (0.0,)}


def _moe_log_loss(t, c, n=None):
  n = c['N'] if n is None else n
  log_e = np.log(expansion(c))
  return lse(t[0] - t[5] * log_e - (t[3] + t[6] * log_e) * np.log(n),
             t[1] - t[7] * log_e - (t[4] + t[8] * log_e) * np.log(c['D']), t[2])


def _moe_named(t):
  return {**_base_named(t[:5]), 'delta_e': t[5], 'gamma_e': t[6], 'omega_e': t[7],
          'zeta_e': t[8]}


def _moe_raw(p):
  return {**_base_raw(p), **{k: p[k] for k in _MOE_RAW[5:] if k in p}}


# A known law given without its expert terms has none (from_params fills these in).
_MOE_DEFAULTS = {'delta_e': 0.0, 'gamma_e': 0.0, 'omega_e': 0.0, 'zeta_e': 0.0}
MOE = Form('moe', ('N', 'D', 'E', 'k'), _MOE_RAW, _moe_log_loss, _moe_named, _moe_raw,
           {**_BASE_GRID, **_MOE_GRID}, _MOE_DEFAULTS)


@dataclasses.dataclass(frozen=True)
class LoopMapping:
  """N_eff(theta_map, cols): extra raw names, the function, named view and starts. N_eff is
  built from the active parameters of one pass (`N_active_pass`) and of one pass of the looped
  block (`N_block_active`), never from stored counts."""
  raw: tuple[str, ...]
  n_eff: Callable[[np.ndarray, Columns], np.ndarray]
  named: Callable[[np.ndarray], dict]
  raw_of: Callable[[Mapping[str, float]], dict]
  grid: Mapping[str, Sequence[float]]
  columns: tuple[str, ...] = ('N_active_pass', 'N_block_active', 'D', 'r', 'E', 'k')


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


MAPPINGS: dict[str, LoopMapping] = {
    'linear': LoopMapping((), lambda t, c: _n(c) + (c['r'] - 1.0) * _nb(c),
                       lambda t: {}, lambda p: {}, {}),
    'power': LoopMapping(('phi',),
                      lambda t, c: _n(c) - _nb(c) + np.power(c['r'], t[0]) * _nb(c),
                      lambda t: {'phi': t[0]}, lambda p: {k: p[k] for k in ('phi',) if k in p},
                      {'phi': (0.3, 0.7, 1.0)}),
    'bounded': LoopMapping(('log_gamma', 'log_beta_r'),
                        lambda t, c: _bounded(_n(c), _nb(c), c['r'], np.exp(t[0]),
                                              np.exp(t[1])),
                        _bn, _br, {'log_gamma': (0.0, 1.5), 'log_beta_r': (-1.5, 0.0)}),
    'sparse_bounded': LoopMapping(
        ('log_gamma0', 'log_beta0', 'delta'),
        lambda t, c: _bounded(_n(c), _nb(c), c['r'], np.exp(t[0]) * _rho(c) ** -t[2],
                              np.exp(t[1]) * _rho(c) ** t[2]),
        _sparse_named, _sparse_raw,
        {'log_gamma0': (0.0, 1.5), 'log_beta0': (-1.5, 0.0), 'delta': (0.0, 0.5)}),
}

_LOOP_GRID = {'a': (5, 10, 20), 'b': (5, 10, 20), 'e': (-0.5, 0.5), 'alpha': (0.25, 0.5, 1.0),
              'beta': (0.25, 0.5, 1.0)}


def loop_form(name: str, mapping: LoopMapping) -> Form:
  """The MoE base law with its active-parameter term N replaced by N_eff (Eq. 9)."""
  k = len(_MOE_RAW)

  def log_loss(t, c):
    return _moe_log_loss(t[:k], c, n=mapping.n_eff(t[k:], c))

  def named(t):
    return {**_moe_named(t[:k]), **mapping.named(t[k:])}

  def raw_of(p):
    return {**_moe_raw(p), **mapping.raw_of(p)}

  return Form(f'loop_{name}', mapping.columns, _MOE_RAW + mapping.raw, log_loss, named,
              raw_of, {**_LOOP_GRID, **_MOE_GRID, **mapping.grid}, _MOE_DEFAULTS)


FORMS: dict[str, Form] = {'chinchilla': CHINCHILLA, 'clark': CLARK, 'smelt': SMELT, 'moe': MOE}
FORMS.update({f'loop_{n}': loop_form(n, m) for n, m in MAPPINGS.items()})


def register_mapping(name: str, raw: Sequence[str], n_eff, named, raw_of, grid,
                     columns=LoopMapping.columns) -> Form:
  """Adds an N_eff mapping and its law `loop_<name>` (e.g. the published form)."""
  MAPPINGS[name] = LoopMapping(tuple(raw), n_eff, named, raw_of, grid, tuple(columns))
  FORMS[f'loop_{name}'] = loop_form(name, MAPPINGS[name])
  return FORMS[f'loop_{name}']


def get_form(form) -> Form:
  if isinstance(form, Form):
    return form
  if form not in FORMS:
    raise ValueError(f'unknown law form {form!r}; known: {sorted(FORMS)}')
  return FORMS[form]
