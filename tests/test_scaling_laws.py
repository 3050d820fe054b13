"""Scaling-law fits against published estimates and against known synthetic truths."""
import os

import numpy as np
import pytest

from loopmoe_jax.scaling import (bootstrap, chinchilla_epoch, chinchilla_optimal, compare,
                                 expansion, fit, from_params)
from loopmoe_jax.scaling.synthetic import LOOP_TRUTH, MAPPING_TRUTH, generate, loop_grid

# Hoffmann et al.'s Figure 4 as digitised by Epoch AI (tests/data/chinchilla_fig4_epoch.csv).
EPOCH_CSV = os.path.join(os.path.dirname(__file__), 'data', 'chinchilla_fig4_epoch.csv')
# Besiroglu et al. 2024 ("Chinchilla Scaling: A replication attempt"): estimate, standard error.
EPOCH = {'E': (1.82, 0.03), 'A': (482.01, 124.58), 'B': (2085.43, 1293.23),
         'alpha': (0.3478, 0.02), 'beta': (0.3658, 0.02)}


@pytest.fixture(scope='module')
def epoch_data():
  if not os.path.exists(EPOCH_CSV):
    pytest.skip(f'{EPOCH_CSV} not present')
  return chinchilla_epoch(EPOCH_CSV)


def test_chinchilla_reproduces_epoch_replication(epoch_data):
  assert len(epoch_data['N']) == 240  # 245 digitised points, the five highest losses dropped
  f = fit('chinchilla', epoch_data)
  for name, (est, se) in EPOCH.items():
    assert abs(f.params[name] - est) <= se, (name, f.params[name], est, se)
  n_opt, d_opt = chinchilla_optimal(f.params, 5.76e23)
  assert 6 * n_opt * d_opt == pytest.approx(5.76e23, rel=1e-9)
  # Epoch's estimates put Chinchilla's budget at ~40B params and ~20-30 tokens per param.
  assert 2e10 < n_opt < 8e10 and 10 < d_opt / n_opt < 40
  boot = bootstrap('chinchilla', epoch_data, n=20, seed=0, base=f)
  for name in ('alpha', 'beta', 'E'):
    assert 0.2 * EPOCH[name][1] < boot['se'][name] < 5 * EPOCH[name][1], (name, boot['se'])


def test_fit_accepts_a_dataframe_like_mapping(epoch_data):
  class Frame:  # the two methods fit uses from a pandas DataFrame
    def __init__(self, d): self.d = d
    def keys(self): return list(self.d)
    def __getitem__(self, k): return self.d[k]
  a, b = fit('chinchilla', epoch_data, top=2), fit('chinchilla', Frame(epoch_data), top=2)
  assert a.params == b.params


@pytest.mark.parametrize('form', list(MAPPING_TRUTH))
def test_loop_form_recovers_truth_and_ranks_first(form):
  sparse = form == 'loop_sparse_bounded'
  cols = loop_grid(experts=(4, 16, 64) if sparse else (1,), top_k=2)
  truth = {**LOOP_TRUTH, **MAPPING_TRUTH[form]}
  data = generate(form, truth, cols, noise=0.003, seed=1)
  # The data have no expert terms: the saturation constants would be near-flat directions
  # (1.5x the fitting time for nothing), so the expansion is held at its unsaturated limit.
  held = {'E_start': 1.0, 'E_max': np.inf} if sparse else {}
  f = fit(form, data, top=4, fixed=held)
  assert f.rmse < 0.012  # the noise is 0.3% of a loss of ~2.3..4
  for name, true in truth.items():
    tol = 0.25 * abs(true) if name in ('A', 'B', 'gamma', 'gamma0') else 0.1 * abs(true)
    assert abs(f.params[name] - true) <= tol, (name, f.params[name], true)
  # Held-out RMSE at the largest pass count (extrapolation) ranks the generating form first.
  forms = list(MAPPING_TRUTH) if sparse else [m for m in MAPPING_TRUTH if 'sparse' not in m]
  rows = compare(forms, data, holdouts=[('r', 8)], top=4, fixed=held)
  assert rows[0]['form'] == form, [(r['form'], r['heldout_mean']) for r in rows]


MOE_TRUTH = {**LOOP_TRUTH, 'delta_e': 0.12, 'gamma_e': 0.01, 'omega_e': 0.05, 'zeta_e': -0.005,
             'E_start': 1.9, 'E_max': 300.0}
BOUNDED = {'gamma0': 1.0, 'beta0': 0.8, 'delta': 0.3}


def _reduced_cols(passes, experts, top_k):
  rng = np.random.default_rng(0)
  n = np.exp(rng.uniform(np.log(1e7), np.log(1e9), 64))
  return {'N_active_pass': n, 'N_block_active': 0.4 * n, 'N': n,
          'D': n * rng.uniform(5, 100, 64), 'r': np.full(64, float(passes)),
          'E': np.full(64, float(experts)), 'k': np.full(64, float(top_k))}


def _chinchilla(p, n, d):
  return p['E'] + p['A'] / n ** p['alpha'] + p['B'] / d ** p['beta']


def _clark_x(x, e_start, e_max):
  """Clark et al.'s Ê written out, normalised by Ê(1) = E_start (the reference)."""
  return 1.0 / (1.0 / (x - 1.0 + 1.0 / (1.0 / e_start - 1.0 / e_max)) + 1.0 / e_max) / e_start


@pytest.mark.parametrize('suffix', ['', '_raw'])
@pytest.mark.parametrize('form', list(MAPPING_TRUTH))
def test_loop_laws_reduce_to_the_moe_dense_loop_and_dense_laws(form, suffix):
  """The seed's three reduced forms of its Eq. 9, numerically, with the saturating expansion
  (the default) and the raw E/k: r = 1 gives the MoE law on the per-pass active params; one
  expert gives the dense loop law (Chinchilla on N_eff); both give Chinchilla's law."""
  law = from_params(form + suffix, {**MOE_TRUTH, **MAPPING_TRUTH[form]})
  moe = from_params('moe' + suffix, MOE_TRUTH)
  one_pass = _reduced_cols(1, 32, 4)                         # r = 1, E/k = 8
  np.testing.assert_allclose(law.predict(one_pass), moe.predict(one_pass), rtol=1e-12)
  assert np.all(np.abs(moe.predict(one_pass) - _chinchilla(MOE_TRUTH, one_pass['N'],
                                                           one_pass['D'])) > 1e-4)
  dense_loop = _reduced_cols(4, 1, 1)                        # one expert, four passes
  n, nb = dense_loop['N_active_pass'], dense_loop['N_block_active']
  gain = {'loop_linear': 3 * nb, 'loop_power': (4 ** 0.5 - 1) * nb,
          'loop_bounded': 2.0 * nb * (1 - np.exp(-0.6 * 3)),
          'loop_sparse_bounded': 1.0 * nb * (1 - np.exp(-0.8 * 3))}[form]
  np.testing.assert_allclose(law.predict(dense_loop),
                             _chinchilla(MOE_TRUTH, n + gain, dense_loop['D']), rtol=1e-12)
  dense = _reduced_cols(1, 1, 1)                             # both
  np.testing.assert_allclose(law.predict(dense), _chinchilla(MOE_TRUTH, dense['N'], dense['D']),
                             rtol=1e-12)
  every_expert = _reduced_cols(4, 8, 8)                      # k = E: X(1) = 1, rho = 1
  np.testing.assert_allclose(law.predict(every_expert), law.predict(_reduced_cols(4, 1, 1)),
                             rtol=1e-12)
  assert np.all(law.predict(_reduced_cols(4, 32, 4)) < law.predict(_reduced_cols(1, 32, 4)))


def test_expansion_is_clarks_normalised_and_one_at_dense_points():
  x = np.array([1.0, 2, 4, 8, 64, 1024, 1e6])
  got = expansion({'E': 2 * x, 'k': np.full(x.shape, 2.0)}, 1.9, 300.0)
  np.testing.assert_allclose(got, _clark_x(x, 1.9, 300.0), rtol=1e-13)
  assert got[0] == 1.0 and np.all(np.diff(got) > 0)          # monotone, X(1) = 1
  assert got[-1] == pytest.approx(300.0 / 1.9, rel=1e-3)     # saturates at E_max / E_start
  dense = {'E': np.array([0.0, 1.0, 1.0, 16.0]), 'k': np.array([0.0, 1.0, 0.0, 0.0])}
  for e_start, e_max in ((1.0, np.inf), (1.9, 300.0), (5.0, 6.0)):
    assert np.all(expansion(dense, e_start, e_max) == 1.0)
  # The defaults are the unsaturated limit: X = E/k.
  np.testing.assert_allclose(expansion({'E': 2 * x, 'k': np.full(x.shape, 2.0)}), x,
                             rtol=1e-15)
  with pytest.raises(ValueError, match='E_start must be >= 1'):
    expansion(dense, 0.5, 10.0)
  with pytest.raises(ValueError, match='E_max must exceed E_start'):
    expansion(dense, 3.0, 2.0)


@pytest.mark.parametrize('form', ['moe', 'loop_sparse_bounded'])
def test_saturating_expansion_reduces_to_raw_in_its_unsaturated_limit(form):
  """E_start -> 1, E_max -> inf: the default law approaches its `_raw` form (X = E/k); at the
  limit itself (E_start = 1, E_max = inf) it equals it."""
  cols = _reduced_cols(4, 64, 2)
  cols['E'] = np.tile([2.0, 8, 32, 64, 256, 1024, 1, 0], 8)   # E/k from 1 to 512, dense
  params = {**MOE_TRUTH, **BOUNDED}
  raw = from_params(form + '_raw', params).predict(cols)
  errors = []
  for j in range(1, 7):
    near = {**params, 'E_start': 1.0 + 10.0 ** -j, 'E_max': 10.0 ** (2 * j)}
    errors.append(np.max(np.abs(from_params(form, near).predict(cols) / raw - 1)))
  assert np.all(np.diff(errors) < 0) and errors[-1] < 1e-6 and errors[0] > 1e-3, errors
  exact = from_params(form, {**params, 'E_start': 1.0, 'E_max': np.inf})
  np.testing.assert_allclose(exact.predict(cols), raw, rtol=1e-14)
  # from_params's defaults (no E_start / E_max given) are that limit.
  no_sat = {k: v for k, v in params.items() if k not in ('E_start', 'E_max')}
  np.testing.assert_allclose(from_params(form, no_sat).predict(cols), raw, rtol=1e-14)


def _moe_cols(rows, seed):
  rng = np.random.default_rng(seed)
  n = np.exp(rng.uniform(np.log(2e7), np.log(6e8), rows))
  return {'N': n, 'D': n * rng.uniform(5, 80, rows),
          'E': rng.choice([1.0, 8, 16, 32, 64, 256], rows), 'k': np.full(rows, 2.0)}


def test_moe_base_recovers_its_expert_terms():
  truth = {**LOOP_TRUTH, 'delta_e': 0.12, 'gamma_e': 0.0, 'omega_e': 0.05, 'zeta_e': 0.0}
  no_slopes = {'gamma_e': 0.0, 'zeta_e': 0.0}
  # Unsaturated data (X = E/k): the raw form, and the default form held at its limit.
  data = generate('moe_raw', truth, _moe_cols(96, 3), noise=0.002, seed=4)
  raw = fit('moe_raw', data, top=4, fixed=no_slopes)
  assert abs(raw.params['delta_e'] - 0.12) < 0.03 and abs(raw.params['omega_e'] - 0.05) < 0.03
  assert raw.rmse < 0.01
  held = fit('moe', data, top=4, fixed={**no_slopes, 'E_start': 1.0, 'E_max': np.inf})
  assert held.params['E_start'] == 1.0 and held.params['E_max'] == np.inf
  assert held.n_free == raw.n_free and held.rmse == pytest.approx(raw.rmse, rel=1e-6)
  for name, value in raw.params.items():
    assert held.params[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
  # Saturating data: with E_start, E_max held at the truth the expert terms are recovered;
  # fitted too, the law still matches the data to the noise.
  sat = {**truth, 'E_start': 1.9, 'E_max': 300.0}
  data = generate('moe', sat, _moe_cols(96, 5), noise=0.002, seed=6)
  f = fit('moe', data, top=4, fixed={**no_slopes, 'E_start': 1.9, 'E_max': 300.0})
  assert abs(f.params['delta_e'] - 0.12) < 0.03 and abs(f.params['omega_e'] - 0.05) < 0.03
  free = fit('moe', data, top=4, fixed=no_slopes)
  assert free.n_free == f.n_free + 2 and free.rmse < 0.01


def test_clark_and_smelt_recover_truth():
  n, e = np.meshgrid([1e7, 3e7, 1e8, 3e8, 1e9], [1, 2, 4, 8, 16, 32, 64, 128, 256])
  truth = {'a': -0.08, 'b': -0.06, 'c': 0.003, 'd': 2.2, 'E_start': 1.9, 'E_max': 300.0}
  data = generate('clark', truth, {'N': n.ravel(), 'E': e.ravel()}, noise=0.001, seed=2)
  f = fit('clark', data)
  for name in ('a', 'b', 'c', 'd'):
    assert abs(f.params[name] - truth[name]) <= 0.15 * abs(truth[name]), (name, f.params)
  s, fl, d = np.meshgrid([0.0, 0.5, 0.8, 0.95], [1e8, 1e9, 1e10], [1e9, 1e10, 1e11])
  truth = {'E': 1.7, 'A': 300.0, 'b': 0.4, 'a': 0.3, 'K': 800.0, 'c': 0.3}
  data = generate('smelt', truth, {'S': s.ravel(), 'F': fl.ravel(), 'D': d.ravel()},
                  noise=0.002, seed=3)
  f = fit('smelt', data)
  for name in ('E', 'b', 'a', 'c'):
    assert abs(f.params[name] - truth[name]) <= 0.1 * truth[name], (name, f.params)


def test_fixed_parameters_and_from_params_roundtrip():
  truth = {'A': 400.0, 'B': 1500.0, 'E': 1.8, 'alpha': 0.34, 'beta': 0.36}
  cols = loop_grid(passes=(1,))
  data = generate('chinchilla', truth, cols, noise=0.0)
  assert np.allclose(from_params('chinchilla', truth).predict(data), data['loss'])
  f = fit('chinchilla', data, fixed={'alpha': 0.34}, top=4)
  assert f.params['alpha'] == 0.34 and f.rmse < 1e-4
  with pytest.raises(ValueError, match='missing'):
    fit('loop_bounded', {'N': [1.0], 'D': [1.0], 'loss': [1.0]})
  with pytest.raises(ValueError, match='needs E_start too'):  # log_em = log(E_max - E_start)
    fit('moe', {**cols, 'E': cols['N'] * 0 + 8, 'k': cols['N'] * 0 + 1, 'loss': data['loss']},
        fixed={'E_max': 300.0})
  with pytest.raises(ValueError, match=r"missing \['N_block_active'"):  # stored counts: no
    fit('loop_bounded', {'N_active_pass': [1.0], 'N_stored': [2.0], 'D': [1.0], 'r': [1.0],
                         'E': [1.0], 'k': [1.0], 'loss': [1.0]})


def test_fit_laws_cli_on_epoch_data(tmp_path):
  import json
  import subprocess
  import sys
  if not os.path.exists(EPOCH_CSV):
    pytest.skip(f'{EPOCH_CSV} not present')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out, png = tmp_path / 'fit.json', tmp_path / 'fit.png'
  res = subprocess.run([sys.executable, os.path.join(root, 'scripts', 'fit_laws.py'),
                        f'--data={EPOCH_CSV}', '--format=epoch', '--forms=chinchilla',
                        '--budget=5.76e23', f'--plot={png}', f'--json={out}', '--top=4'],
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-2000:]
  got = json.loads(out.read_text())['fits']['chinchilla']
  for name, (est, se) in EPOCH.items():
    assert abs(got['params'][name] - est) <= se
  n_opt, d_opt = chinchilla_optimal(got['params'], 5.76e23)
  assert got['compute_optimal']['N'] == pytest.approx(n_opt)
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
