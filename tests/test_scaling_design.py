"""Design from fitted laws against brute-force numeric references."""
import matplotlib.image
import numpy as np
import pytest
from scipy import optimize

from loopmoe_jax.scaling import (chinchilla_optimal, compute_efficiency, frontier_loss,
                                 from_params, isoflop, joint_optimum, memory_optimal_experts,
                                 multiplier, multiplier_asymptote, optimal_passes, plots)

LAW = {'A': 482.01, 'B': 2085.43, 'E': 1.82, 'alpha': 0.3478, 'beta': 0.3658}
# Expert terms and Clark's saturating expansion, in the range of MoE fits.
EXPERT = {'delta_e': 0.12, 'gamma_e': 0.01, 'omega_e': 0.05, 'zeta_e': -0.005,
          'E_start': 1.9, 'E_max': 300.0}
MAPS = {'loop_linear': {}, 'loop_power': {'phi': 0.5},
        'loop_bounded': {'gamma': 2.0, 'beta_r': 0.6},
        'loop_sparse_bounded': {'gamma0': 1.0, 'beta0': 0.8, 'delta': 0.3}}


@pytest.mark.parametrize('compute', [1e19, 5.76e23, 1e26])
def test_compute_optimal_matches_brute_force(compute):
  law = from_params('chinchilla', LAW)
  n = np.exp(np.linspace(np.log(1e5), np.log(compute / 60), 200_001))
  loss = law.predict({'N': n, 'D': compute / (6 * n)})
  n_brute = n[np.argmin(loss)]
  n_opt, d_opt = chinchilla_optimal(LAW, compute)
  assert n_opt == pytest.approx(n_brute, rel=2e-3)
  assert d_opt == pytest.approx(compute / (6 * n_opt), rel=1e-9)
  best, n_frontier = frontier_loss(law, compute)
  assert n_frontier == pytest.approx(n_opt, rel=1e-4)
  assert best == pytest.approx(loss.min(), rel=1e-9)


def test_compute_efficiency_of_a_uniformly_better_law():
  # L_new(N, D) = L(mN, mD): the same loss at N/m, D/m, so C_new = C / m^2.
  m = 2.0
  new = dict(LAW, A=LAW['A'] * m ** -LAW['alpha'], B=LAW['B'] * m ** -LAW['beta'])
  base, better = from_params('chinchilla', LAW), from_params('chinchilla', new)
  eff = compute_efficiency(base, better, loss=2.2)
  assert eff == pytest.approx(1 - 1 / m ** 2, abs=1e-6)
  assert compute_efficiency(base, base, loss=2.2) == pytest.approx(0.0, abs=1e-9)


def test_optimal_passes_follows_the_tolerance_rule():
  law = from_params('loop_bounded', {**LAW, 'gamma': 3.0, 'beta_r': 0.5})
  cols = {'N_active_pass': 1e8, 'N_block_active': 5e7, 'E': 1.0, 'k': 1.0}
  passes = range(1, 13)
  prev = None
  for tol in (0.0, 1e-3, 5e-3, 2e-2, 1.0):
    out = optimal_passes(law, 1e20, passes, cols, active=1e8, active_block=5e7, tol=tol)
    losses = {row['r']: row['loss'] for row in out['table']}
    # Every pass up to r* improved by more than tol; the next one does not.
    for r in range(2, out['r'] + 1):
      assert losses[r - 1] - losses[r] > tol
    if out['r'] < max(passes):
      assert losses[out['r']] - losses[out['r'] + 1] <= tol
    # Compute is held fixed: tokens shrink as passes grow.
    assert all(np.isclose(row['D'] * 6 * (1e8 + (row['r'] - 1) * 5e7), 1e20)
               for row in out['table'])
    assert prev is None or out['r'] <= prev
    prev = out['r']
  assert prev == 1


def test_memory_optimal_experts_respects_the_limit():
  law = from_params('loop_sparse_bounded', {**LAW, 'gamma0': 1.0, 'beta0': 0.8, 'delta': 0.3})
  per_expert = 2e6
  cands = {e: {'N_active_pass': 1e8 + e * per_expert, 'N_block_active': 5e7 + e * per_expert,
               'r': 4.0, 'k': 2.0,
               'E': float(e), 'D': 2e10, 'params_total': 1e8 + e * per_expert}
           for e in (4, 8, 16, 32, 64, 128)}
  limit = 2 * (1e8 + 40 * per_expert)  # bytes at 2 bytes/param: up to 40 experts fit
  out = memory_optimal_experts(law, cands, limit, tol=0.0)
  feasible = [r for r in out['table'] if r['fits']]
  assert [r['E'] for r in feasible] == [4, 8, 16, 32]
  assert out['E'] == min(feasible, key=lambda r: r['loss'])['E'] == 32
  assert memory_optimal_experts(law, cands, limit, tol=1.0)['E'] == 4
  with pytest.raises(ValueError, match='no candidate'):
    memory_optimal_experts(law, cands, 1.0)


def test_optimal_passes_grows_with_compute():
  """The seed's Fig. 5(a): with a data term, r* rises with the training-compute budget (more
  compute, more tokens per pass, so the extra passes' cut in tokens costs less)."""
  law = from_params('loop_bounded', {**LAW, 'gamma': 3.0, 'beta_r': 0.5})
  assert law.params['B'] > 0
  n, nb = 1e7, 5e6
  cols = {'N_active_pass': n, 'N_block_active': nb, 'E': 1.0, 'k': 1.0}
  r_opt = [optimal_passes(law, c, range(1, 17), cols, active=n, active_block=nb,
                          tol=1e-3)['r'] for c in (1e14, 1e16, 1e18)]
  assert all(a <= b for a, b in zip(r_opt, r_opt[1:])) and len(set(r_opt)) > 1, r_opt


def _n_eff_from_loss(law, cols):
  """The slow reference: N_eff at cols' r is the per-pass size N' whose loss at r = 1 (where
  N_eff = N') equals the law's loss at r; found by root finding on the predictions alone."""
  target = law.predict({k: np.atleast_1d(v) for k, v in cols.items()})[0]
  one = lambda log_n: law.predict({k: np.atleast_1d(v) for k, v in
                                   {**cols, 'r': 1.0, 'N_active_pass': np.exp(log_n)}.items()}
                                  )[0] - target
  lo = np.log(cols['N_active_pass'])
  return np.exp(optimize.brentq(one, lo - 1.0, lo + 30.0, xtol=1e-13, rtol=1e-14))


@pytest.mark.parametrize('form', list(MAPS))
def test_multiplier_against_n_eff_from_the_loss(form):
  law = from_params(form, {**LAW, **EXPERT, **MAPS[form]})
  n, nb = 1e8, 4e7
  base = {'N_active_pass': n, 'N_block_active': nb, 'D': 2e9, 'k': 2.0}
  for e in (1.0, 8.0, 64.0):
    for r in (1.0, 2.0, 3.0, 8.0):
      cols = {**base, 'E': e, 'r': r}
      m = multiplier(law, cols)
      assert m == pytest.approx(_n_eff_from_loss(law, cols) / n, rel=1e-9), (e, r)
      if r == 1.0:
        assert m == 1.0
    asym = multiplier_asymptote(law, {**base, 'E': e})
    far = _n_eff_from_loss(law, {**base, 'E': e, 'r': 1e6}) / n    # r -> inf, from the loss
    if form in ('loop_linear', 'loop_power'):
      assert asym == np.inf and far > 50
    else:
      assert asym == pytest.approx(far, rel=1e-9)
      gamma = MAPS[form].get('gamma', 1.0 * min(1.0, 2.0 / e) ** -0.3)
      assert asym == pytest.approx(1 + gamma * nb / n, rel=1e-12)
  # Arrays: rising in r towards the asymptote; the seed's Fig. 4(a,b): more experts raise it.
  r = np.array([1.0, 2, 4, 8, 16, 64])
  m = multiplier(law, {**base, 'E': 64.0, 'r': r})
  assert m.shape == r.shape and np.all(np.diff(m) > 0)
  asym = multiplier_asymptote(law, {**base, 'E': np.array([4.0, 16, 64])})
  assert np.all(m <= asym[-1]) and np.all(m[:4] < asym[-1])
  if form == 'loop_sparse_bounded':
    assert np.all(np.diff(asym) > 0)
  elif form == 'loop_bounded':
    assert np.all(asym == asym[0])


def test_multiplier_errors_name_the_problem():
  with pytest.raises(ValueError, match='no N_eff'):
    multiplier(from_params('moe', LAW), {'N_active_pass': 1.0})
  law = from_params('loop_bounded', {**LAW, **MAPS['loop_bounded']})
  with pytest.raises(ValueError, match=r"missing \['r'\]"):
    multiplier(law, {'N_active_pass': 1e8, 'N_block_active': 4e7, 'E': 1.0, 'k': 1.0})


def test_isoflop_curves_against_brute_force_and_the_moe_law(tmp_path):
  params = {**LAW, **EXPERT, **MAPS['loop_sparse_bounded']}
  law, moe = from_params('loop_sparse_bounded', params), from_params('moe', params)
  compute, frac, experts = 1e19, 0.4, {'E': 32.0, 'k': 2.0}
  curves = isoflop(law, compute, (1, 2, 4, 8), experts, block_fraction=frac)
  assert [c['r'] for c in curves] == [1, 2, 4, 8]
  n = np.geomspace(1e6, 1e10, 400_001)
  for c in curves:
    r = c['r']
    np.testing.assert_allclose(6 * c['D'] * (c['N'] + (r - 1) * frac * c['N']), compute,
                               rtol=1e-12)
    d = compute / (6 * (n + (r - 1) * frac * n))
    brute = law.predict({'N_active_pass': n, 'N_block_active': frac * n, 'D': d,
                         'r': np.full(n.shape, float(r)), 'E': np.full(n.shape, 32.0),
                         'k': np.full(n.shape, 2.0)})
    i = int(np.argmin(brute))
    assert c['loss_opt'] == pytest.approx(brute[i], rel=1e-9)
    assert c['N_opt'] == pytest.approx(n[i], rel=1e-3)
    assert c['loss_opt'] <= c['loss'].min() + 1e-12
  # r = 1: the moe law on the per-pass active params at D = C / (6 N).
  one = curves[0]
  np.testing.assert_allclose(
      one['loss'], moe.predict({'N': one['N'], 'D': compute / (6 * one['N']),
                                'E': np.full(one['N'].shape, 32.0),
                                'k': np.full(one['N'].shape, 2.0)}), rtol=1e-12)
  path = plots.plot_isoflop(curves, str(tmp_path / 'isoflop.png'))
  raw = open(path, 'rb').read()
  assert raw[:8] == b'\x89PNG\r\n\x1a\n'
  image = matplotlib.image.imread(path)                      # decodes: a valid PNG
  assert image.shape[0] > 100 and image.shape[1] > 100 and image[..., :3].std() > 0.01
  with pytest.raises(ValueError, match='has no passes'):
    isoflop(moe, compute, (1, 2), experts)


def _candidates(per_expert=2e6):
  return {e: {'N_active_pass': 1e8 + 2 * per_expert, 'N_block_active': 5e7 + 2 * per_expert,
              'k': 2.0, 'params_total': 1e8 + e * per_expert}
          for e in (4, 8, 16, 32, 64, 128)}


def test_joint_optimum_against_brute_force():
  law = from_params('loop_sparse_bounded', {**LAW, **EXPERT, **MAPS['loop_sparse_bounded']})
  cands, limit, compute, passes = _candidates(), 2 * (1e8 + 40 * 2e6), 1e21, range(1, 9)
  out = joint_optimum(law, compute, passes, cands, limit)
  brute = []
  for e, c in cands.items():
    if c['params_total'] * 2 > limit:
      continue
    for r in passes:
      d = compute / (6 * (c['N_active_pass'] + (r - 1) * c['N_block_active']))
      cols = {k: np.atleast_1d(float(v)) for k, v in
              {**c, 'E': e, 'r': r, 'D': d}.items() if k != 'params_total'}
      brute.append((law.predict(cols)[0], r, e))
  loss, r_best, e_best = min(brute)
  assert (out['r'], out['E']) == (r_best, e_best) and out['loss'] == pytest.approx(loss, rel=1e-12)
  assert out['r'] > 1 and out['E'] == 32        # both axes matter here: a non-trivial optimum
  assert len(out['table']) == len(cands) * len(passes)
  assert {row['E'] for row in out['table'] if row['fits']} == {4, 8, 16, 32}
  # The joint optimum is no worse than the per-E compute-optimal passes (tol 0).
  for e in (4, 8, 16, 32):
    c = {**cands[e], 'E': float(e)}
    c.pop('params_total')
    per_e = optimal_passes(law, compute, passes, c, active=c['N_active_pass'],
                           active_block=c['N_block_active'], tol=0.0)
    assert out['loss'] <= per_e['loss']
  with pytest.raises(ValueError, match=r'no candidate fits in memory_bytes=1000\b.*E=4'):
    joint_optimum(law, compute, passes, cands, 1000.0)
  with pytest.raises(ValueError, match='gives r or D'):
    joint_optimum(law, compute, passes, {4: {**cands[4], 'r': 2.0}}, limit)
