"""Ranking law forms with paired bootstrap intervals (`scaling.fitting.rank`)."""
import numpy as np
import pytest

from loopmoe_jax.scaling import fitting, synthetic
from loopmoe_jax.scaling.synthetic import LOOP_TRUTH, MAPPING_TRUTH

# the expert terms other than delta_e stay at 0, as the loop-laws replication holds them
FIXED = {'gamma_e': 0.0, 'omega_e': 0.0, 'zeta_e': 0.0}


def _grid(form, params, seed, noise=0.003):
  cols = synthetic.loop_grid(sizes=(2e7, 8e7, 3e8), tokens_per_param=(10, 40),
                             passes=(1, 2, 4, 8), experts=(4, 8, 16), top_k=2)
  return synthetic.generate(form, {**LOOP_TRUTH, 'delta_e': 0.1, **params}, cols, noise, seed)


def test_nested_forms_that_fit_equally_are_not_distinguishable():
  # data from the bounded mapping: sparse_bounded holds it at delta = 0, so the two fit
  # (nearly) equally and no interval of their difference may exclude 0
  data = _grid('loop_bounded', MAPPING_TRUTH['loop_bounded'], seed=1)
  res = fitting.rank(['loop_bounded', 'loop_sparse_bounded'], data, [('r', 8.0)],
                     resamples=400, fixed=FIXED)
  assert not res['distinguishable']
  other = [r for r in res['table'] if r['form'] != res['best']][0]
  assert other['diff_lo'] <= 0.0 <= other['diff_hi']
  assert res['indistinguishable'] == [other['form']]


def test_the_true_form_is_picked_when_the_grid_separates_the_forms():
  data = _grid('loop_sparse_bounded', MAPPING_TRUTH['loop_sparse_bounded'], seed=2)
  res = fitting.rank(['loop_linear', 'loop_bounded', 'loop_sparse_bounded'], data,
                     [('r', 8.0), ('E', 16.0)], resamples=400, fixed=FIXED)
  assert res['best'] == 'loop_sparse_bounded'
  assert res['distinguishable'], res['table']
  assert all(r['diff_lo'] > 0 for r in res['table'][1:])
  # the score is the mean of the per-holdout RMSEs, each the slow reference
  for row in res['table']:
    ref = [fitting.heldout_rmse(row['key'], data, a, v, fixed=FIXED) for a, v in
           [('r', 8.0), ('E', 16.0)]]
    assert row['score'] == pytest.approx(np.mean(ref), rel=1e-6)


def test_paired_intervals_resample_the_same_points_for_every_form():
  # bounded and sparse_bounded err alike point by point: drawing the same held-out points for
  # both (paired) must give a narrower interval of their difference than independent draws
  data = _grid('loop_bounded', MAPPING_TRUTH['loop_bounded'], seed=3)
  forms, hold = ['loop_bounded', 'loop_sparse_bounded'], [('r', 8.0)]
  res = fitting.rank(forms, data, hold, resamples=400, fixed=FIXED)
  other = res['table'][1]
  errs = {f: np.subtract(*fitting.heldout_predictions(f, data, 'r', 8.0, fixed=FIXED))
          for f in forms}
  rng = np.random.default_rng(0)
  rmse = lambda e: np.sqrt(np.mean(e[rng.integers(0, len(e), (400, len(e)))] ** 2, axis=1))
  indep = rmse(errs[other['key']]) - rmse(errs[res['best']])
  width = other['diff_hi'] - other['diff_lo']
  assert 0 < width < 0.5 * (np.percentile(indep, 97.5) - np.percentile(indep, 2.5))
  with pytest.raises(ValueError, match='resamples=0'):
    fitting.rank(forms, data, hold, resamples=0, fixed=FIXED)
  with pytest.raises(ValueError, match='level=1.5'):
    fitting.rank(forms, data, hold, level=1.5, fixed=FIXED)


def test_a_grid_too_small_for_the_free_parameters_is_refused():
  data = _grid('loop_bounded', MAPPING_TRUTH['loop_bounded'], seed=4)
  small = {k: v[(data['r'] <= 2) & (data['E'] == 4)] for k, v in data.items()}  # 12 points
  n_free = fitting.free_parameters('loop_sparse_bounded', FIXED)
  with pytest.raises(ValueError, match=rf'holding out r=2 leaves 6 points .*'
                                       rf"'loop_sparse_bounded'.* {n_free} free parameters"):
    fitting.rank(['loop_sparse_bounded'], small, [('r', 2.0)], fixed=FIXED)
  with pytest.raises(ValueError, match='free parameters'):
    fitting.compare(['loop_sparse_bounded'], small, [('r', 2.0)], fixed=FIXED)


def test_a_refusal_names_the_points_needed_and_the_terms_that_can_be_fixed():
  data = _grid('loop_bounded', MAPPING_TRUTH['loop_bounded'], seed=4)
  small = {k: v[(data['r'] <= 2) & (data['E'] == 4)] for k, v in data.items()}  # 12 points
  held = {**FIXED, 'E_start': 1.0, 'E_max': float('inf')}
  p = fitting.free_parameters('loop_bounded', held)
  assert p == len(fitting.free_names('loop_bounded', held)) == 8
  with pytest.raises(ValueError) as e:
    fitting.compare(['loop_bounded'], small, [('r', 2.0)], fixed=held)
  assert str(e.value) == (
      "cannot rank the forms: holding out r=2 leaves 6 points to fit 'loop_bounded', which "
      f'has {p} free parameters (need at least {p + 1} points to fit, {p + 7} in the grid with '
      '6 held out); add points or fix terms (fixable: A, B, E, alpha, beta, delta_e, gamma, '
      'beta_r)')


def test_fixed_names_a_form_lacks_and_holdouts_of_no_point_are_refused():
  data = _grid('loop_linear', {}, seed=5)
  with pytest.raises(ValueError, match=r"cannot fix \['phi'\] of law 'loop_linear'; its "
                                       r'parameters: A, B, E, alpha, beta, delta_e, gamma_e, '
                                       r'omega_e, zeta_e, E_start, E_max$'):
    fitting.fit('loop_linear', data, fixed={'phi': 0.5})
  with pytest.raises(ValueError, match=r"cannot fix \['bta', 'gama'\] of law 'loop_bounded' "
                                       r'\(did you mean beta, beta_r, gamma, gamma_e\?\)'):
    fitting.check_fixed('loop_bounded', {'bta': 0.3, 'gama': 1.0})
  with pytest.raises(ValueError, match=r'^holdout r=16 selects no point: r takes 1, 2, 4, 8$'):
    fitting.compare(['loop_linear'], data, [('r', 16.0)], fixed=FIXED)
  with pytest.raises(ValueError, match=r"^holdout R=4: the data have no column 'R' \(columns: "):
    fitting.rank(['loop_linear'], data, [('R', 4.0)], fixed=FIXED)
  one_r = {k: v[data['r'] == 2] for k, v in data.items()}
  with pytest.raises(ValueError, match='holdout r=2 holds out every point'):
    fitting.compare(['loop_linear'], one_r, [('r', 2.0)], fixed=FIXED)


def test_parameters_the_points_leave_unidentified_are_warned(caplog):
  from helpers import logged  # pylint: disable=import-outside-toplevel
  flat = {'N': np.full(3, 1e8), 'D': np.full(3, 2e9), 'loss': np.array([3.0, 3.1, 2.9])}
  rows = fitting.compare(['chinchilla'], flat, fixed={'alpha': 0.3, 'beta': 0.3, 'B': 0.0},
                         top=2)
  assert rows[0]['n_params'] == 2
  assert logged(caplog) == ('chinchilla: column N (1e+08) is constant over the 3 points '
                            'fitted, so A is not identified: vary N or fix it')
  # varying N identifies A: no warning
  caplog.clear()
  fitting.compare(['chinchilla'], {**flat, 'N': np.array([1e8, 2e8, 4e8])},
                  fixed={'alpha': 0.3, 'beta': 0.3, 'B': 0.0}, top=2)
  assert logged(caplog) == ''
  # one looped count left to fit: the bounded mapping's gamma and beta_r only as a product
  data = _grid('loop_bounded', MAPPING_TRUTH['loop_bounded'], seed=6)
  three = {k: v[data['r'] <= 4] for k, v in data.items()}
  held = {**FIXED, 'E_start': 1.0, 'E_max': float('inf')}
  warned = fitting.design_warnings(['loop_power', 'loop_bounded'], three, [('r', 4.0)], held)
  assert len(warned) == 1 and warned[0].startswith(
      'loop_bounded: the 36 points fitted (holding out r=4) do not identify gamma/beta_r')
  assert fitting.design_warnings(['loop_power', 'loop_bounded'], data, [('r', 8.0)],
                                 held) == []
