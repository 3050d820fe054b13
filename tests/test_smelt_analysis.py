"""SMELT's analyses on a synthetic grid from known coefficients: the frontier exponent, the
optimum and the compute efficiency are recovered within their cell-bootstrap intervals, and
the closed-form optimum is the numerical minimum."""
import itertools

import numpy as np
import pytest
from scipy import optimize

from loopmoe_jax.scaling import smelt_analysis as sa
from loopmoe_jax.scaling.synthetic import generate

BASE = {'E': 1.8, 'A': 1100.0, 'b': 0.5, 'a': 0.30, 'K': 700.0, 'c': 0.30}
LOOPED = {'E': 1.8, 'A': 1300.0, 'b': 0.5, 'a': 0.33, 'K': 700.0, 'c': 0.30}


def grid(seed):
  rows = list(itertools.product((0.85, 0.95, 0.97), (1e8, 2.5e8, 6e8, 1.5e9),
                                (1e9, 3e9, 1e10, 3e10)))
  cols = {k: np.array([r[i] for r in rows], float) for i, k in enumerate(('S', 'F', 'D'))}
  return cols, seed


def test_closed_form_optimum_is_the_numerical_minimum():
  s, compute = 0.95, 1e20
  got = sa.optimum(BASE, s, compute)
  loss = lambda log_f: (BASE['E'] + BASE['A'] * (1 - s) ** BASE['b'] / np.exp(log_f) ** BASE['a']
                        + BASE['K'] / (compute / (3 * np.exp(log_f))) ** BASE['c'])
  res = optimize.minimize_scalar(loss, bounds=(10, 40), method='bounded',
                                 options=dict(xatol=1e-12))
  assert got['F'] == pytest.approx(np.exp(res.x), rel=1e-4)
  assert got['loss'] == pytest.approx(res.fun, rel=1e-9)
  assert got['D'] == pytest.approx(compute / (3 * got['F']), rel=1e-9)
  assert sa.compute_for_loss(BASE, s, got['loss']) == pytest.approx(compute, rel=1e-9)
  assert sa.frontier_exponent(BASE) == pytest.approx(0.15)
  # the frontier's slope in log-log is -gamma
  l2 = sa.optimum(BASE, s, 2 * compute)['loss']
  assert np.log((l2 - BASE['E']) / (got['loss'] - BASE['E'])) / np.log(2) == pytest.approx(-0.15)


def test_report_recovers_known_coefficients_within_bootstrap_intervals():
  cols, _ = grid(0)
  base = generate('smelt', BASE, cols, noise=0.002, seed=1)
  looped = generate('smelt', LOOPED, cols, noise=0.002, seed=2)
  compute = 1e20
  rep = sa.report(base, looped, compute, resamples=60, seed=0)
  for name, truth in (('baseline', BASE), ('smelt', LOOPED)):
    s = rep[name]['S']
    assert s == 0.95
    g = rep[name]['gamma']
    assert g['ci'][0] <= sa.frontier_exponent(truth) <= g['ci'][1], (name, g['value'], g['ci'])
    opt = sa.optimum(truth, s, compute)
    tpp = rep[name]['tokens_per_param']
    assert tpp['ci'][0] <= opt['tokens_per_param'] <= tpp['ci'][1], (name, tpp, opt)
  eff = rep['compute_efficiency']
  want = sa.compute_efficiency(BASE, LOOPED, eff['loss'], 0.95, 0.95)
  assert eff['ci'][0] <= want <= eff['ci'][1], (eff['value'], eff['ci'], want)
  assert 0 < want < 1 and eff['ci'][1] - eff['ci'][0] < 0.5


def test_the_n_frontier_refuses_the_smelt_form():
  from loopmoe_jax.scaling import design, from_params
  with pytest.raises(ValueError, match='smelt_analysis'):
    design.frontier_loss(from_params('smelt', BASE), 1e20)
