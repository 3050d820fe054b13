"""Grouped matmul and dispatch backends against slow, obvious references.

- `gmm_tiled` == `jax.lax.ragged_dot` == a float64 numpy per-group loop, forward and VJP
  (lhs and rhs), on ragged group sizes: empty groups, one group taking every row, sizes not a
  multiple of the tile, sizes summing to less than M (trailing rows and their lhs gradient are
  exactly zero), a tile larger than M.
- `dispatch` backends 'sorted' and 'xla' == 'reference' in outputs and in gradients w.r.t. x,
  the combine weights and every expert tensor, with an idle expert and with every token
  routed to one expert (top-1 and top-2).
- `_work_items` lists exactly the (tile, group) pairs that intersect, in at most
  ceil(M / tile) + E - 1 loop iterations.

Tolerances: float32 inputs 1e-5 of the reference's largest magnitude; bfloat16 inputs 2e-2
(bf16 has an 8-bit mantissa: one output rounding is 2**-9 relative, accumulation is float32).
"""
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.dispatch import _work_items, dispatch, gmm_tiled

TOL = {'float32': 1e-5, 'bfloat16': 2e-2}
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def assert_close(actual, expected, rtol, what=''):
  """max |actual - expected| <= rtol * max |expected| (plus a tiny floor for all-zero refs)."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  err = np.max(np.abs(actual - expected), initial=0.0)
  scale = np.max(np.abs(expected), initial=0.0)
  assert err <= rtol * scale + 1e-30, f'{what}: max err {err:.3g} vs scale {scale:.3g}'


# Grouped matmul ---------------------------------------------------------------------------

def gmm_numpy(lhs, rhs, sizes):
  """out rows of group g = lhs rows of g @ rhs[g]; rows past sum(sizes) stay zero."""
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, n in enumerate(sizes):
    out[start:start + n] = lhs[start:start + n] @ rhs[g]
    start += n
  return out


def gmm_vjp_numpy(lhs, rhs, sizes, ct):
  d_lhs, d_rhs = np.zeros_like(lhs), np.zeros_like(rhs)
  start = 0
  for g, n in enumerate(sizes):
    rows = slice(start, start + n)
    d_lhs[rows] = ct[rows] @ rhs[g].T
    d_rhs[g] = lhs[rows].T @ ct[rows]
    start += n
  return d_lhs, d_rhs


# (M rows, group sizes, tile): named edge cases and random ragged cases.
GMM_CASES = {
    'empty_groups': (40, [0, 9, 0, 0, 23, 0], 8),
    'one_group_all_rows': (37, [0, 0, 37, 0], 8),
    'ragged_not_tile_multiple': (53, [5, 11, 3, 17, 1, 16], 8),
    'sum_less_than_m': (50, [7, 0, 12, 9], 8),
    'sum_less_than_m_all_empty': (19, [0, 0, 0], 4),
    'tile_larger_than_m': (13, [4, 0, 6, 3], 64),
    'tile_larger_than_m_partial': (13, [2, 5], 32),
    'tile_one': (9, [3, 0, 6], 1),
    'single_group': (21, [21], 8),
}


def _random_sizes(rng, m, groups, short):
  cuts = np.sort(rng.integers(0, m - short + 1, groups - 1))
  return np.diff(np.concatenate([[0], cuts, [m - short]])).astype(int).tolist()


for _seed in range(4):
  _rng = np.random.default_rng(100 + _seed)
  _m = int(_rng.integers(20, 90))
  _g = int(_rng.integers(2, 12))
  _short = int(_rng.integers(0, 6)) if _seed % 2 else 0
  GMM_CASES[f'random_{_seed}'] = (_m, _random_sizes(_rng, _m, _g, _short),
                                  int(_rng.choice([4, 8, 16])))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('case', sorted(GMM_CASES))
def test_gmm_tiled_matches_ragged_dot_and_numpy(case, dtype):
  m, sizes, tile = GMM_CASES[case]
  assert sum(sizes) <= m
  k_dim, n_dim = 12, 10
  rng = np.random.default_rng(zlib.crc32(case.encode()))
  dt = DTYPES[dtype]
  lhs = jnp.asarray(rng.standard_normal((m, k_dim)), dt)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), k_dim, n_dim)), dt)
  ct = jnp.asarray(rng.standard_normal((m, n_dim)), dt)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  # The references see exactly the (rounded) inputs the kernels see.
  lhs64, rhs64, ct64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (lhs, rhs, ct))

  tiled = lambda l, r: gmm_tiled(l, r, group_sizes, tile)
  ragged = lambda l, r: jax.lax.ragged_dot(l, r, group_sizes,
                                           preferred_element_type=jnp.float32).astype(l.dtype)
  out_t, vjp_t = jax.vjp(jax.jit(tiled), lhs, rhs)
  out_r, vjp_r = jax.vjp(ragged, lhs, rhs)
  assert out_t.dtype == dt
  want = gmm_numpy(lhs64, rhs64, sizes)
  rtol = TOL[dtype]
  assert_close(out_t, want, rtol, 'gmm_tiled vs numpy')
  assert_close(out_t, np.asarray(out_r.astype(jnp.float32)), rtol, 'gmm_tiled vs ragged_dot')

  d_lhs_t, d_rhs_t = vjp_t(ct)
  d_lhs_r, d_rhs_r = vjp_r(ct)
  want_lhs, want_rhs = gmm_vjp_numpy(lhs64, rhs64, sizes, ct64)
  assert d_lhs_t.dtype == dt and d_rhs_t.dtype == dt
  assert_close(d_lhs_t, want_lhs, rtol, 'd_lhs vs numpy')
  assert_close(d_rhs_t, want_rhs, rtol, 'd_rhs vs numpy')
  assert_close(d_lhs_t, np.asarray(d_lhs_r.astype(jnp.float32)), rtol, 'd_lhs vs ragged_dot')
  assert_close(d_rhs_t, np.asarray(d_rhs_r.astype(jnp.float32)), rtol, 'd_rhs vs ragged_dot')

  # Rows past the sum of the sizes: exactly zero, and so is their lhs gradient.
  used = sum(sizes)
  np.testing.assert_array_equal(np.asarray(out_t[used:].astype(jnp.float32)), 0.0)
  np.testing.assert_array_equal(np.asarray(d_lhs_t[used:].astype(jnp.float32)), 0.0)
  # Empty groups get an exactly zero weight gradient.
  for g, n in enumerate(sizes):
    if n == 0:
      np.testing.assert_array_equal(np.asarray(d_rhs_t[g].astype(jnp.float32)), 0.0)


def test_gmm_tiled_under_grad_of_scalar_loss_and_jit():
  """jax.grad through a jitted scalar loss (not only jax.vjp) agrees with ragged_dot."""
  rng = np.random.default_rng(7)
  m, sizes, tile = 30, [4, 0, 19, 2], 8
  lhs = jnp.asarray(rng.standard_normal((m, 6)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((4, 6, 5)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((m, 5)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def loss(fn, l, r):
    return jnp.sum(jnp.tanh(fn(l, r, gs)) * w)

  g_t = jax.jit(jax.grad(lambda l, r: loss(lambda *a: gmm_tiled(*a, tile), l, r), (0, 1)))(lhs, rhs)
  g_r = jax.grad(lambda l, r: loss(jax.lax.ragged_dot, l, r), (0, 1))(lhs, rhs)
  for a, b in zip(g_t, g_r):
    assert_close(a, np.asarray(b), 1e-5)


# Work items -------------------------------------------------------------------------------

def _enumerate_pairs(sizes, m, tile):
  """Every (tile, group) whose row ranges intersect: a plain Python enumeration."""
  pairs, start = set(), 0
  for g, n in enumerate(sizes):
    for t in range(-(-m // tile)):
      lo, hi = t * tile, min((t + 1) * tile, m)
      if n and max(lo, start) < min(hi, start + n):
        pairs.add((t, g))
    start += n
  return pairs


WORK_CASES = [(m, sizes, tile) for m, sizes, tile in GMM_CASES.values()] + [
    (64, [64] + [0] * 255, 16),          # E = 256, all rows in the first group
    (64, [0] * 255 + [64], 16),          # ... in the last group
    (64, [1] * 64 + [0] * 192, 16),      # E = 256, one row each for 64 groups
    (100, [3] * 30 + [0] * 10, 7),       # many tiny groups straddling tile edges
]


@pytest.mark.parametrize('m,sizes,tile', WORK_CASES)
def test_work_items_bound_and_intersection(m, sizes, tile):
  num_groups = len(sizes)
  group, tile_idx, valid, starts, ends = jax.jit(_work_items, static_argnums=(1, 2))(
      jnp.asarray(sizes, jnp.int32), m, tile)
  group, tile_idx, valid = (np.asarray(a) for a in (group, tile_idx, valid))
  # The loop runs over `len(group)` items: bounded by tiles + E - 1, not by tiles * E.
  bound = math.ceil(m / tile) + num_groups - 1
  assert len(group) <= bound
  items = [(int(t), int(g)) for t, g, v in zip(tile_idx, group, valid) if v]
  cum = np.concatenate([[0], np.cumsum(sizes)])
  for t, g in items:
    assert 0 <= g < num_groups and 0 <= t < math.ceil(m / tile)
    # The work item's tile really overlaps its group's rows.
    assert max(t * tile, cum[g]) < min((t + 1) * tile, cum[g + 1]), (t, g)
  assert len(items) == len(set(items)), 'a (tile, group) pair is listed twice'
  assert set(items) == _enumerate_pairs(sizes, m, tile)
  np.testing.assert_array_equal(np.asarray(starts), cum[:-1])
  np.testing.assert_array_equal(np.asarray(ends), cum[1:])


# Dispatch backends ------------------------------------------------------------------------

def _routing(rng, tokens, k, experts, mode):
  """Distinct experts per token. mode: 'random', 'idle' (expert 1 never chosen),
  'one' (every token's first choice is expert 2)."""
  pool = [e for e in range(experts) if not (mode == 'idle' and e == 1)]
  rows = []
  for _ in range(tokens):
    if mode == 'one':
      rest = [e for e in range(experts) if e != 2]
      rows.append([2] + list(rng.permutation(rest)[:k - 1]))
    else:
      rows.append(list(rng.permutation(pool)[:k]))
  return np.asarray(rows, np.int32)


DISPATCH_CASES = [
    # (tokens, k, experts, mode, tile)
    (19, 2, 5, 'random', 8),
    (19, 2, 5, 'idle', 8),
    (17, 1, 4, 'idle', 4),
    (13, 1, 4, 'one', 8),
    (13, 2, 4, 'one', 8),
    (11, 2, 6, 'random', 64),   # tile larger than T*k
    (24, 3, 8, 'random', 5),
]


@pytest.mark.parametrize('backend', ['sorted', 'xla'])
@pytest.mark.parametrize('tokens,k,experts,mode,tile', DISPATCH_CASES)
def test_dispatch_backend_equals_reference(backend, tokens, k, experts, mode, tile):
  rng = np.random.default_rng(tokens * 100 + k * 10 + experts)
  d, f = 8, 12
  x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
  experts_Tk = jnp.asarray(_routing(rng, tokens, k, experts, mode))
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)
  params = {
      'gate': jnp.asarray(rng.standard_normal((experts, d, f)) / np.sqrt(d), jnp.float32),
      'up': jnp.asarray(rng.standard_normal((experts, d, f)) / np.sqrt(d), jnp.float32),
      'down': jnp.asarray(rng.standard_normal((experts, f, d)) / np.sqrt(f), jnp.float32),
  }
  counts = np.bincount(np.asarray(experts_Tk).ravel(), minlength=experts)
  if mode == 'idle':
    assert counts[1] == 0
  if mode == 'one':
    assert counts[2] == tokens
  ct = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)

  def run(name):
    fn = lambda x, w, p: dispatch(x, experts_Tk, w, p, name, tile)
    y, vjp = jax.vjp(jax.jit(fn), x, weights, params)
    return y, vjp(ct)

  y_ref, (gx_ref, gw_ref, gp_ref) = run('reference')
  y, (gx, gw, gp) = run(backend)
  scale_check = float(jnp.max(jnp.abs(y_ref)))
  assert scale_check > 0.1  # the reference does real work
  assert_close(y, np.asarray(y_ref), 1e-5, 'y')
  assert_close(gx, np.asarray(gx_ref), 1e-5, 'd_x')
  assert_close(gw, np.asarray(gw_ref), 1e-5, 'd_weights')
  for name in ('gate', 'up', 'down'):
    assert_close(gp[name], np.asarray(gp_ref[name]), 1e-5, f'd_{name}')
    for e in np.flatnonzero(counts == 0):  # an idle expert learns nothing
      np.testing.assert_array_equal(np.asarray(gp[name][e]), 0.0)


def test_reference_dispatch_equals_per_token_loop():
  """The 'reference' backend itself against a per-token, per-choice numpy loop."""
  rng = np.random.default_rng(3)
  tokens, k, experts, d, f = 9, 2, 4, 6, 5
  x = rng.standard_normal((tokens, d))
  ex = _routing(rng, tokens, k, experts, 'idle')
  w = rng.uniform(0.1, 1.0, (tokens, k))
  p = {n: rng.standard_normal(s) for n, s in
       (('gate', (experts, d, f)), ('up', (experts, d, f)), ('down', (experts, f, d)))}
  want = np.zeros((tokens, d))
  for t in range(tokens):
    for j in range(k):
      e = ex[t, j]
      g = x[t] @ p['gate'][e]
      h = g / (1 + np.exp(-g)) * (x[t] @ p['up'][e])
      want[t] += w[t, j] * (h @ p['down'][e])
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  for backend in ('reference', 'sorted', 'xla'):
    got = dispatch(f32(x), jnp.asarray(ex), f32(w), {n: f32(v) for n, v in p.items()},
                   backend, 4)
    assert_close(got, want, 1e-5, backend)


def test_dispatch_bfloat16_backends_agree():
  rng = np.random.default_rng(11)
  tokens, k, experts, d, f = 21, 2, 6, 8, 8
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  x = bf(rng.standard_normal((tokens, d)))
  ex = jnp.asarray(_routing(rng, tokens, k, experts, 'idle'))
  w = bf(rng.uniform(0.1, 1.0, (tokens, k)))
  p = {n: bf(rng.standard_normal(s) / 3) for n, s in
       (('gate', (experts, d, f)), ('up', (experts, d, f)), ('down', (experts, f, d)))}
  ref = dispatch(x, ex, w, p, 'reference')
  assert ref.dtype == jnp.bfloat16
  for backend in ('sorted', 'xla'):
    got = dispatch(x, ex, w, p, backend, 8)
    assert got.dtype == jnp.bfloat16
    assert_close(got, np.asarray(ref.astype(jnp.float32)), 2e-2, backend)


def test_dispatch_rejects_unknown_backend():
  x = jnp.zeros((2, 4))
  p = {'gate': jnp.zeros((2, 4, 3)), 'up': jnp.zeros((2, 4, 3)), 'down': jnp.zeros((2, 3, 4))}
  with pytest.raises(ValueError, match='dispatch'):
    dispatch(x, jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1)), p, 'magic')
