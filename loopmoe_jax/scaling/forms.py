"""Scaling-law forms: log-loss predictions over an unconstrained parameter vector.

Every form predicts log L from data columns (numpy arrays) and a raw vector `theta`. The
positive constants are optimised in log space (A = exp(a), B = exp(b), E = exp(e)), so the
Chinchilla-like forms are log L = LSE(a - alpha log N_eff, b - beta log D, e) (Hoffmann et al.;
Besiroglu et al. 2024). Predictions are written with numpy operations that are analytic in
`theta`, so fitting can take exact gradients by the complex step (see fitting.py).

Forms (`FORMS[name]`):
  chinchilla           L = E + A/N^alpha + B/D^beta                               (N, D)
  clark                log L = a log N + b log Ê + c log N log Ê + d,             (N, E)
                       1/Ê(x) = 1/(x - 1 + (1/E_start - 1/E_max)^-1) + 1/E_max
  smelt                L = E + A (1-S)^b / F^a + K / D^c                          (S, F, D)
  moe                  L = E + A X^-delta_e N^-(alpha + gamma_e ln X)
                             + B X^-omega_e D^-(beta + zeta_e ln X)                (N, D, E, k)
                       X = Ê(E/k) / E_start, Clark's saturating expansion of E/k
  loop_<mapping>       the moe law with N -> N_eff from MAPPINGS (the seed's Eq. 9)
                       (N_active_pass, N_block_active, D, r, E, k)
  moe_raw, loop_<mapping>_raw
                       the same laws with X = E/k unsaturated (E_start = 1, E_max = inf
                       held; two fewer parameters)

Expert expansion (the seed, on Eq. 9: "Following Clark et al. (2022), Ê is a monotonic
transformation ... where E denotes the number of experts under top-1 routing. For top-k
routing, we define the effective expert expansion as [lost], consistent with Chen et al.
(2026)"): Clark's Ê applied to x = E/k. Choices where the seed is silent: (i) the expansion is
normalised, X = Ê(x)/Ê(1) = Ê(x)/E_start, so that one expert gives X = 1 and every expert
term vanishes, keeping the reduced forms exact; (ii) dense points (E <= 1 or k = 0) and
points with every expert active (k >= E) have X = 1 exactly. E_start = 1 + exp(log_es) and
E_max = E_start + exp(log_em) are fitted raw parameters. Holding the unsaturated limit:
fixed={'E_start': 1.0, 'E_max': np.inf} (raw log_es = -inf, log_em = +inf, computed exactly:
X = E/k) or the `_raw` forms. A law given to `from_params` without E_start/E_max gets that
limit (no saturation given, none assumed).

Reduced forms (tests/test_scaling_laws.py): r = 1 gives the moe law on the per-pass active
params; one expert (X = 1, rho = 1) gives the dense loop law L = E + A/N_eff^alpha + B/D^beta;
both give Chinchilla's law.

Loop mappings (N = active params of one pass, N_b = active params of one pass of the looped
block, r = passes, rho = k/E):
  linear          N + (r-1) N_b                                   (unrolled; no parameters)
  power           (N - N_b) + r^phi N_b                           (Iso-Depth)
  bounded         N + gamma N_b (1 - exp(-beta_r (r-1)))          (finite asymptote, = N at r=1)
  sparse_bounded  bounded with gamma = gamma0 rho^-delta, beta_r = beta0 rho^delta
Each mapping also gives N_eff as r -> inf (`limit`; the multiplier's asymptote in design.py):
inf for linear and power (phi > 0, N_b > 0), N + gamma N_b for bounded, N + gamma0 rho^-delta
N_b for sparse_bounded. A mapping is pluggable: `register_mapping(name, raw_names, fn,
to_named, grid, limit=...)` adds `loop_<name>` and `loop_<name>_raw` (e.g. to swap in a
published form).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from loopmoe_jax.scaling.mappings import MAPPINGS, LoopMapping  # MAPPINGS re-exported

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
  # Loop laws only: (theta, cols) -> N_eff at the columns' r, and N_eff as r -> inf (None
  # when the mapping gives no limit).
  n_eff: Callable[[np.ndarray, Columns], np.ndarray] | None = None
  n_eff_limit: Callable[[np.ndarray, Columns], np.ndarray] | None = None
  # (columns, named params): the params a design identifies only where some of the columns
  # vary (fitting.design_warnings names them when every column is constant)
  axes: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()

  def loss(self, theta, cols: Columns) -> np.ndarray:
    return np.exp(self.log_loss(np.asarray(theta), cols))

  def param_names(self) -> list[str]:
    """The named parameters (those `fixed=` and --fix take), in the order of `raw`."""
    return list(self.named(np.zeros(len(self.raw))))

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
                  _base_raw, _BASE_GRID,
                  axes=((('N',), ('A', 'alpha')), (('D',), ('B', 'beta'))))


# Clark et al. (routed) and the expert expansion ---------------------------------------------
#
# 1/Ê(x) = 1/(x - 1 + (1/E_start - 1/E_max)^-1) + 1/E_max, with raw log_es, log_em:
# E_start = 1 + exp(log_es), E_max = E_start + exp(log_em). Ê(1) = E_start, Ê -> E_max as
# x -> inf, and at (log_es, log_em) = (-inf, +inf) (E_start = 1, E_max = inf) Ê(x) = x. The
# arithmetic below stays finite there (1/E_max = u / (1 + E_start u), u = exp(-log_em)), also
# for complex-step arguments, so a fit can hold that limit exactly.

_CLARK_RAW = ('log_es', 'log_em')


def _e_hat(x, log_es, log_em):
  """(Ê(x), E_start) from the raw pair."""
  e_start = 1.0 + np.exp(log_es)
  u = np.exp(-log_em)                      # 1 / (E_max - E_start)
  inv_max = u / (1.0 + e_start * u)        # 1 / E_max
  return 1.0 / (1.0 / (x - 1.0 + 1.0 / (1.0 / e_start - inv_max)) + inv_max), e_start


def _clark_pair_named(log_es, log_em):
  e_start = 1.0 + np.exp(log_es)
  return {'E_start': e_start, 'E_max': e_start + np.exp(log_em)}


def _clark_pair_raw(p):
  """Named E_start / E_max -> raw log_es / log_em; E_start = 1 and E_max = inf give the
  unsaturated limit (-inf, +inf)."""
  out = {}
  e_start = p.get('E_start')
  if e_start is not None:
    if not e_start >= 1.0:
      raise ValueError(f'E_start must be >= 1 (Ê(1) = E_start, one expert); got {e_start!r}')
    with np.errstate(divide='ignore'):
      out['log_es'] = np.log(e_start - 1.0)
  e_max = p.get('E_max')
  if e_max is not None:
    if e_max == np.inf:
      out['log_em'] = np.inf
    elif e_start is None:
      raise ValueError(f'fixing E_max={e_max!r} needs E_start too (log_em = log(E_max - '
                       'E_start)); or give E_max=inf, the unsaturated limit')
    elif not e_max > e_start:
      raise ValueError(f'E_max must exceed E_start; got E_max={e_max!r}, E_start={e_start!r}')
    else:
      out['log_em'] = np.log(e_max - e_start)
  return out


def expansion(c: Columns, E_start: float = 1.0, E_max: float = np.inf) -> np.ndarray:
  """The moe law's expert expansion X = Ê(E/k) / E_start (Clark's Ê over top-k routing,
  normalised so that X(1) = 1); exactly 1 for dense points (E <= 1 or k = 0) and when every
  expert is active (k >= E). The defaults are the unsaturated limit, X = E/k."""
  raw = _clark_pair_raw({'E_start': E_start, 'E_max': E_max})
  return _expansion(c, raw['log_es'], raw['log_em'])


def _expansion(c, log_es, log_em):
  k, e = np.asarray(c['k'], float), np.asarray(c['E'], float)
  moe = (e > 1) & (k > 0) & (e > k)     # else dense or every expert active: X = 1 exactly
  x = np.where(moe, e / np.where(moe, k, 1.0), 1.0)
  e_hat, e_start = _e_hat(x, log_es, log_em)
  return np.where(moe, e_hat / e_start, 1.0)


def _clark_log_loss(t, c):
  log_n, log_e = np.log(c['N']), np.log(_e_hat(c['E'], t[4], t[5])[0])
  return t[0] * log_n + t[1] * log_e + t[2] * log_n * log_e + t[3]


def _clark_named(t):
  return {'a': t[0], 'b': t[1], 'c': t[2], 'd': t[3], **_clark_pair_named(t[4], t[5])}


def _clark_raw(p):
  return {**{k: p[k] for k in 'abcd' if k in p}, **_clark_pair_raw(p)}


CLARK = Form('clark', ('N', 'E'), ('a', 'b', 'c', 'd') + _CLARK_RAW, _clark_log_loss,
             _clark_named, _clark_raw,
             {'a': (-0.1, -0.03), 'b': (-0.1, -0.01), 'c': (0.0, 0.005), 'd': (1.0, 2.0, 3.0),
              'log_es': (-1.0, 0.5), 'log_em': (3.0, 6.0)},
             axes=((('N',), ('a', 'c')), (('E',), ('b', 'c', 'E_start', 'E_max'))))


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
              'a': (0.1, 0.3, 0.6), 'log_K': (0, 5, 10, 15), 'c': (0.1, 0.3, 0.6)},
             axes=((('S',), ('b',)), (('F',), ('A', 'a')), (('D',), ('K', 'c'))))


# The MoE base law ------------------------------------------------------------------------
#
# The loop laws replace the active-parameter term of an MoE scaling law with N_eff (the seed's
# Eq. 9). Its equations were lost in the text copy; this base is the joint MoE law of
# Ludziejewski et al. (2025) in this file's positive-exponent convention, over the active
# parameters N (per pass) and the expert expansion X (see the module docstring):
#   L = E + A X^-delta_e N^-(alpha + gamma_e ln X) + B X^-omega_e D^-(beta + zeta_e ln X)
# At X = 1 (one expert, k = E, or a dense point) every expert term vanishes and the law is
# Chinchilla's on N. Raw vector: the five Chinchilla entries, the four expert exponents, then
# (saturating forms) log_es, log_em, then (loop forms) the mapping's entries.

_MOE_RAW = _BASE_RAW + ('delta_e', 'gamma_e', 'omega_e', 'zeta_e')
_MOE_GRID = {'delta_e': (0.0,), 'gamma_e': (0.0,), 'omega_e': (0.0,), 'zeta_e': (0.0,)}
# One start near Clark et al.'s fits (E_start ~ 1.8, E_max ~ 200-500): with no expert terms in
# the data the pair is flat, and more values would only repeat the other starts.
_EXPANSION_GRID = {'log_es': (-0.2,), 'log_em': (5.5,)}
# A known law given without its expert terms has none, and without saturation constants is
# unsaturated (from_params fills these in).
_MOE_DEFAULTS = {'delta_e': 0.0, 'gamma_e': 0.0, 'omega_e': 0.0, 'zeta_e': 0.0}
_EXPANSION_DEFAULTS = {'E_start': 1.0, 'E_max': np.inf}


def _moe_log_loss(t, c, n, log_x):
  """t: the nine base entries; n: active params (or N_eff); log_x: log of the expansion."""
  return lse(t[0] - t[5] * log_x - (t[3] + t[6] * log_x) * np.log(n),
             t[1] - t[7] * log_x - (t[4] + t[8] * log_x) * np.log(c['D']), t[2])


def _moe_named(t):
  return {**_base_named(t[:5]), 'delta_e': t[5], 'gamma_e': t[6], 'omega_e': t[7],
          'zeta_e': t[8]}


def _moe_raw(p):
  return {**_base_raw(p), **{k: p[k] for k in _MOE_RAW[5:] if k in p}}


_LOOP_GRID = {'a': (5, 10, 20), 'b': (5, 10, 20), 'e': (-0.5, 0.5), 'alpha': (0.25, 0.5, 1.0),
              'beta': (0.25, 0.5, 1.0)}


def moe_form(name: str, mapping: LoopMapping | None = None, saturating: bool = True) -> Form:
  """The MoE base law (mapping None) or a loop law, the base with its active-parameter term N
  replaced by N_eff (Eq. 9). saturating: Clark's expansion with fitted E_start, E_max;
  otherwise X = E/k (the same law at E_start = 1, E_max = inf)."""
  n_base = len(_MOE_RAW)
  nx = n_base + (len(_CLARK_RAW) if saturating else 0)
  raw = _MOE_RAW + (_CLARK_RAW if saturating else ()) + (mapping.raw if mapping else ())
  columns = mapping.columns if mapping else ('N', 'D', 'E', 'k')

  def log_x(t, c):
    return np.log(_expansion(c, t[n_base], t[n_base + 1]) if saturating
                  else _expansion(c, -np.inf, np.inf))

  def n_eff(t, c):
    return mapping.n_eff(t[nx:], c) if mapping else c['N']

  def log_loss(t, c):
    return _moe_log_loss(t[:n_base], c, n_eff(t, c), log_x(t, c))

  def named(t):
    out = _moe_named(t[:n_base])
    if saturating:
      out.update(_clark_pair_named(t[n_base], t[n_base + 1]))
    return {**out, **(mapping.named(t[nx:]) if mapping else {})}

  def raw_of(p):
    return {**_moe_raw(p), **(_clark_pair_raw(p) if saturating else {}),
            **(mapping.raw_of(p) if mapping else {})}

  grid = {**(_LOOP_GRID if mapping else _BASE_GRID), **_MOE_GRID,
          **(_EXPANSION_GRID if saturating else {}), **(mapping.grid if mapping else {})}
  defaults = {**_MOE_DEFAULTS, **(_EXPANSION_DEFAULTS if saturating else {})}
  limit = None
  if mapping and mapping.limit:
    limit = lambda t, c: mapping.limit(t[nx:], c)
  form = Form(name, columns, raw, log_loss, named, raw_of, grid, defaults,
              n_eff if mapping else None, limit)
  return dataclasses.replace(form, axes=_moe_axes(form, mapping))


def _moe_axes(form: Form, mapping: LoopMapping | None):
  """The size term needs N (a loop law: N_active_pass or r) to vary, the data term D, the
  expert terms E/k, a mapping's own parameters r."""
  names = form.param_names()
  experts = tuple(n for n in ('delta_e', 'gamma_e', 'omega_e', 'zeta_e', 'E_start', 'E_max')
                  if n in names)
  axes = [(('N_active_pass', 'r') if mapping else ('N',), ('A', 'alpha', 'gamma_e')),
          (('D',), ('B', 'beta', 'zeta_e')), (('E', 'k'), experts)]
  if mapping and mapping.raw:
    axes.append((('r',), tuple(names[-len(mapping.raw):])))
  return tuple(axes)


def _forms_of(name: str, mapping: LoopMapping) -> dict[str, Form]:
  return {f'loop_{name}': moe_form(f'loop_{name}', mapping),
          f'loop_{name}_raw': moe_form(f'loop_{name}_raw', mapping, saturating=False)}


MOE = moe_form('moe')
FORMS: dict[str, Form] = {'chinchilla': CHINCHILLA, 'clark': CLARK, 'smelt': SMELT, 'moe': MOE,
                          'moe_raw': moe_form('moe_raw', saturating=False)}
for _name, _mapping in MAPPINGS.items():
  FORMS.update(_forms_of(_name, _mapping))


def register_mapping(name: str, raw: Sequence[str], n_eff, named, raw_of, grid,
                     columns=LoopMapping.columns, limit=None) -> Form:
  """Adds an N_eff mapping and its laws `loop_<name>` (returned) and `loop_<name>_raw` (e.g.
  the published form). limit: (theta_map, cols) -> N_eff as r -> inf, for the multiplier's
  asymptote (design.multiplier_asymptote)."""
  MAPPINGS[name] = LoopMapping(tuple(raw), n_eff, named, raw_of, grid, tuple(columns), limit)
  FORMS.update(_forms_of(name, MAPPINGS[name]))
  return FORMS[f'loop_{name}']


def get_form(form) -> Form:
  if isinstance(form, Form):
    return form
  if form not in FORMS:
    raise ValueError(f'unknown law form {form!r}; known: {sorted(FORMS)}')
  return FORMS[form]
