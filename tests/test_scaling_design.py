"""Design from fitted laws against brute-force numeric references."""
import numpy as np
import pytest

from loopmoe_jax.scaling import (chinchilla_optimal, compute_efficiency, frontier_loss,
                                 from_params, memory_optimal_experts, optimal_passes)

LAW = {'A': 482.01, 'B': 2085.43, 'E': 1.82, 'alpha': 0.3478, 'beta': 0.3658}


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
