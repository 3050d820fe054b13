"""SMELT's analyses on a synthetic grid from known coefficients: the frontier exponent, the
optimum and the compute efficiency are recovered within their cell-bootstrap intervals, the
closed-form optimum is the numerical minimum, and the efficiency's cell-paired bootstrap
draws both architectures' rows of a cell together, over the sparse cells only."""
import itertools

import numpy as np
import pytest
from scipy import optimize

from loopmoe_jax.scaling import smelt_analysis as sa
from loopmoe_jax.scaling.fitting import fit, subset
from loopmoe_jax.scaling.synthetic import generate

BASE = {'E': 1.8, 'A': 1100.0, 'b': 0.5, 'a': 0.30, 'K': 700.0, 'c': 0.30}
LOOPED = {'E': 1.8, 'A': 1300.0, 'b': 0.5, 'a': 0.33, 'K': 700.0, 'c': 0.30}
# the paper's exponents per architecture (baseline a 0.3703, c 0.6594; SMELT 0.3892, 0.7011)
PAPER_BASE = {'E': 1.8, 'A': 900.0, 'b': 0.5, 'a': 0.3703, 'K': 3e5, 'c': 0.6594}
PAPER_SMELT = {'E': 1.8, 'A': 1500.0, 'b': 0.5, 'a': 0.3892, 'K': 5e5, 'c': 0.7011}


def grid(seed):
  rows = list(itertools.product((0.85, 0.95, 0.97), (1e8, 2.5e8, 6e8, 1.5e9),
                                (1e9, 3e9, 1e10, 3e10)))
  cols = {k: np.array([r[i] for r in rows], float) for i, k in enumerate(('S', 'F', 'D'))}
  return cols, seed


def twelve_cells(sparsities=(0.85, 0.95, 0.97)):
  """The paper's sparse grid shape: 3 sparsities x 4 sizes = 12 cells, 3 lengths each."""
  rows = list(itertools.product(sparsities, (1e8, 3e8, 1e9, 3e9), (1e9, 4e9, 1.6e10)))
  cols = {k: np.array([r[i] for r in rows], float) for i, k in enumerate(('S', 'F', 'D'))}
  return {**cols, 'C': 3 * cols['F'] * cols['D']}


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
  want = sa.saving_at_compute(BASE, LOOPED, compute, 0.95, 0.95)
  assert eff['ci'][0] <= want <= eff['ci'][1], (eff['value'], eff['ci'], want)
  assert 0 < want < 1 and eff['ci'][1] - eff['ci'][0] < 0.5
  for p in rep['efficiency_range']['points']:
    want = sa.saving_at_compute(BASE, LOOPED, p['compute'], 0.95, 0.95)
    assert p['ci'][0] <= want <= p['ci'][1], (p['at'], p['value'], p['ci'], want)


def test_saving_across_the_compute_range_is_the_generating_laws():
  cols = twelve_cells()
  base = generate('smelt', PAPER_BASE, cols, noise=0.0)
  looped = generate('smelt', PAPER_SMELT, cols, noise=0.0)
  eff = sa.paired_efficiency(base, looped, resamples=3, seed=0)
  assert eff['cells'] == 12 and eff['sparsity'] == (0.95, 0.95)
  assert eff['window'] == (cols['C'].min(), cols['C'].max())
  pts = {p['at']: p for p in eff['points']}
  assert pts['min compute']['compute'] == cols['C'].min()
  assert pts['max compute']['compute'] == cols['C'].max()
  assert len(pts) == 2 + len(np.unique(cols['D']))
  computes = [p['compute'] for p in eff['points']]
  assert computes == sorted(computes)
  for p in eff['points']:
    c = p['compute']
    truth = sa.saving_at_compute(PAPER_BASE, PAPER_SMELT, c, 0.95, 0.95)
    assert p['value'] == pytest.approx(truth, abs=2e-3), p['at']
    # the definition: the looped frontier reaches the baseline's loss at C with 1 - saving of C
    c_new = optimize.brentq(lambda lc: sa.optimum(PAPER_SMELT, 0.95, np.exp(lc))['loss']
                            - sa.optimum(PAPER_BASE, 0.95, c)['loss'], 20, 70)
    assert truth == pytest.approx(1 - np.exp(c_new) / c, rel=1e-6)
  # the SMELT frontier is steeper (gamma 0.250 vs 0.237): the saving grows with compute
  values = [p['value'] for p in eff['points']]
  assert np.all(np.diff(values) > 0) and values[0] > 0


def test_dense_cells_are_left_out():
  sparse = twelve_cells()
  dense = twelve_cells(sparsities=(0.0,))
  both = {k: np.concatenate([sparse[k], dense[k]]) for k in sparse}
  rng = np.random.default_rng(3)
  base = generate('smelt', PAPER_BASE, sparse, noise=0.003, seed=1)
  looped = generate('smelt', PAPER_SMELT, sparse, noise=0.003, seed=2)
  # the dense cells' losses are arbitrary: any effect on the result would show
  with_dense = [{**both, 'loss': np.concatenate([g['loss'], rng.uniform(3, 9, len(dense['S']))])}
                for g in (base, looped)]
  got = sa.paired_efficiency(*with_dense, resamples=6, seed=4)
  want = sa.paired_efficiency(base, looped, resamples=6, seed=4)
  assert got['cells'] == want['cells'] == 12
  for g, w in zip(got['points'], want['points']):
    assert g['value'] == w['value'] and g['ci'] == w['ci'] and g['compute'] == w['compute']


def test_paired_bootstrap_is_narrower_than_independent_resampling():
  """Both architectures' losses share a per-cell perturbation (as runs of one grid point
  share its data order and budget): drawing a cell for both cancels it in the saving,
  drawing the grids' cells independently does not."""
  cols = twelve_cells()
  cell = sa.cells(cols)
  shared = 0.01 * np.random.default_rng(0).standard_normal(cell.max() + 1)[cell]
  grids = [generate('smelt', p, cols, noise=5e-4, seed=s) for p, s in
           ((PAPER_BASE, 1), (PAPER_SMELT, 2))]
  for g in grids:
    g['loss'] = g['loss'] * np.exp(shared)
  resamples, top = 40, cols['C'].max()
  paired = sa.paired_efficiency(*grids, resamples=resamples, seed=0)
  at_top = next(p for p in paired['points'] if p['at'] == 'max compute')
  # the reference: each grid's cells drawn on their own (the analysis before pairing)
  fits = [fit('smelt', g) for g in grids]
  rng, draws = np.random.default_rng(0), []
  for _ in range(resamples):
    ps = [fit('smelt', subset(g, np.concatenate([np.flatnonzero(cell == k) for k in
                                                 rng.integers(0, 12, 12)])),
              starts=f.theta[None], top=1).params for g, f in zip(grids, fits)]
    draws.append(sa.saving_at_compute(*ps, top, 0.95, 0.95))
  independent = np.percentile(draws, [2.5, 97.5])
  assert at_top['value'] == pytest.approx(
      sa.saving_at_compute(fits[0].params, fits[1].params, top, 0.95, 0.95))
  width = at_top['ci'][1] - at_top['ci'][0]
  assert width < 0.6 * (independent[1] - independent[0]), (at_top['ci'], independent)


def test_cells_pair_by_label_or_rank_and_bad_input_is_refused():
  cols = twelve_cells()
  # a matched twin's grid: its F and S sit near, not at, the baseline's
  twin = {**cols, 'F': cols['F'] * 1.029, 'S': cols['S'] + 0.004}
  ib, inn, n = sa.paired_cells(cols, twin)
  assert n == 12 and np.array_equal(ib, inn)
  point = sa.paired_cells(cols, twin, unit='point')
  assert point[2] == len(cols['S']) and np.array_equal(point[0], point[1])
  labelled = {**cols, 'cell': sa.cells(cols).astype(float)}
  short = subset({**twin, 'cell': labelled['cell']}, labelled['cell'] != 0)
  ib, inn, n = sa.paired_cells(labelled, short)
  assert n == 11 and np.all(ib[labelled['cell'] == 0] == -1) and np.all(inn >= 0)
  with pytest.raises(ValueError, match='sparse cells'):
    sa.paired_cells(cols, subset(twin, cols['S'] != 0.85))
  with pytest.raises(ValueError, match='`cell` column'):
    sa.paired_cells(labelled, twin)
  with pytest.raises(ValueError, match="unit='cell'"):
    sa.cells(cols, unit='cell')
  data = generate('smelt', PAPER_BASE, cols, noise=0.0)
  with pytest.raises(ValueError, match=r'baseline grid: S must lie in \[0, 1\); got \[1.0'):
    sa.paired_efficiency({**data, 'S': np.where(cols['S'] == 0.97, 1.0, cols['S'])}, data)
  with pytest.raises(ValueError, match='resamples=0'):
    sa.paired_efficiency(data, data, resamples=0)
  with pytest.raises(ValueError, match="needs a 'loss' column"):
    sa.paired_efficiency(cols, data)
  with pytest.raises(ValueError, match="compute 'x'=-1"):
    sa.paired_efficiency(data, data, computes=[('x', -1.0)], resamples=1)


def test_the_n_frontier_refuses_the_smelt_form():
  from loopmoe_jax.scaling import design
  from loopmoe_jax.scaling import from_params
  with pytest.raises(ValueError, match='smelt_analysis'):
    design.frontier_loss(from_params('smelt', BASE), 1e20)
