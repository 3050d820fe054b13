"""Grouped matmul and dispatch backends against slow, obvious references.

- `gmm_tiled` == `jax.lax.ragged_dot` == a float64 numpy per-group loop, forward and VJP
  (lhs and rhs), on ragged group sizes: empty groups, one group taking every row, sizes not a
  multiple of the tile, sizes summing to less than M (trailing rows and their lhs gradient are
  exactly zero), a tile larger than M; an inf / NaN row of one group (or past the sum) leaves
  the other groups == ragged_dot (finite); numpy operands eagerly; float64 operands
  (jax_enable_x64) computed in float64 by gmm_tiled and gmm_xla (rtol 1e-12).
- `dispatch` backends 'tiled' and 'xla' == 'reference' in outputs and in gradients w.r.t. x,
  the combine weights and every expert tensor, with an idle expert and with every token
  routed to one expert (top-1 and top-2).
- `work_items` (pallas_kernels.metadata) lists exactly the (tile, group) pairs that intersect,
  in at most ceil(M / tile) + E - 1 loop iterations.

Tolerances: float32 inputs 1e-5 of the reference's largest magnitude; bfloat16 inputs 2e-2
(bf16 has an 8-bit mantissa: one output rounding is 2**-9 relative, accumulation is float32).
"""
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.runtime import HERE
from loopmoe_jax.dispatch import DENSE_MAX_MACS, dispatch, gmm_tiled, gmm_xla
from pallas_kernels.metadata import work_items
from reference import assert_close, gmm_numpy

TOL = {'float32': 1e-5, 'bfloat16': 2e-2}
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


# Grouped matmul ---------------------------------------------------------------------------

def gmm_vjp_numpy(lhs, rhs, sizes, ct):
  d_lhs, d_rhs = np.zeros_like(lhs), np.zeros_like(rhs)
  start = 0
  for g, n in enumerate(sizes):
    rows = slice(start, start + n)
    d_lhs[rows] = ct[rows] @ rhs[g].T
    d_rhs[g] = lhs[rows].T @ ct[rows]
    start += n
  return d_lhs, d_rhs


# Cases share a shape (M rows, G groups, tile) so one compilation serves all their group
# sizes (the sizes are traced values): {shape: {case name: sizes}}.
def _random_sizes(rng, m, groups, short):
  cuts = np.sort(rng.integers(0, m - short + 1, groups - 1))
  return np.diff(np.concatenate([[0], cuts, [m - short]])).astype(int).tolist()


_rng = np.random.default_rng(100)
GMM_CASES = {
    (53, 6, 8): {
        'empty_groups': [0, 9, 0, 0, 23, 0],            # also sums to less than M
        'one_group_all_rows': [0, 0, 53, 0, 0, 0],
        'ragged_not_tile_multiple': [5, 11, 3, 17, 1, 16],
        'sum_less_than_m': [7, 0, 12, 9, 1, 0],
        'all_empty': [0, 0, 0, 0, 0, 0],
        'last_group_only': [0, 0, 0, 0, 0, 53],
        **{f'random_{i}': _random_sizes(_rng, 53, 6, short) for i, short in enumerate((0, 4, 0))},
    },
    (13, 4, 64): {  # tile larger than M
        'tile_larger_than_m': [4, 0, 6, 3],
        'tile_larger_than_m_sum_less': [2, 5, 0, 0],
        'tile_larger_than_m_one_group': [0, 13, 0, 0],
    },
    (3, 4, 128): {'decode_rows_fit_tile_8': [1, 0, 2, 0], 'decode_rows_sum_less': [0, 1, 0, 1]},
    (9, 3, 1): {'tile_one': [3, 0, 6], 'tile_one_sum_less': [0, 2, 4]},
    (40, 11, 16): {f'many_groups_{i}': _random_sizes(_rng, 40, 11, short)
                   for i, short in enumerate((0, 7))},
}


@functools.partial(jax.jit, static_argnums=(4,))
def _gmm_both(lhs, rhs, group_sizes, ct, tile):
  """Outputs and VJPs of gmm_tiled and of ragged_dot, in one compiled function."""
  tiled = lambda l, r: gmm_tiled(l, r, group_sizes, tile)
  ragged = lambda l, r: jax.lax.ragged_dot(l, r, group_sizes,
                                           preferred_element_type=jnp.float32).astype(l.dtype)
  out_t, vjp_t = jax.vjp(tiled, lhs, rhs)
  out_r, vjp_r = jax.vjp(ragged, lhs, rhs)
  return (out_t, *vjp_t(ct)), (out_r, *vjp_r(ct))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('shape', sorted(GMM_CASES))
def test_gmm_tiled_matches_ragged_dot_and_numpy(shape, dtype):
  m, num_groups, tile = shape
  k_dim, n_dim = 12, 10
  dt, rtol = DTYPES[dtype], TOL[dtype]
  for case, sizes in GMM_CASES[shape].items():
    assert len(sizes) == num_groups and sum(sizes) <= m, case
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    lhs = jnp.asarray(rng.standard_normal((m, k_dim)), dt)
    rhs = jnp.asarray(rng.standard_normal((num_groups, k_dim, n_dim)), dt)
    ct = jnp.asarray(rng.standard_normal((m, n_dim)), dt)
    # The references see exactly the (rounded) inputs the kernels see.
    lhs64, rhs64, ct64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (lhs, rhs, ct))
    (out_t, d_lhs_t, d_rhs_t), (out_r, d_lhs_r, d_rhs_r) = _gmm_both(
        lhs, rhs, jnp.asarray(sizes, jnp.int32), ct, tile)
    assert out_t.dtype == d_lhs_t.dtype == d_rhs_t.dtype == dt

    want = gmm_numpy(lhs64, rhs64, sizes)
    want_lhs, want_rhs = gmm_vjp_numpy(lhs64, rhs64, sizes, ct64)
    assert_close(out_t, want, rtol, f'{case}: gmm_tiled vs numpy')
    assert_close(d_lhs_t, want_lhs, rtol, f'{case}: d_lhs vs numpy')
    assert_close(d_rhs_t, want_rhs, rtol, f'{case}: d_rhs vs numpy')
    for name, a, b in (('out', out_t, out_r), ('d_lhs', d_lhs_t, d_lhs_r),
                       ('d_rhs', d_rhs_t, d_rhs_r)):
      assert_close(a, np.asarray(b.astype(jnp.float32)), rtol, f'{case}: {name} vs ragged_dot')

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


# (m, tile, sizes, bad rows): rows of one group, or past the group-size sum, that lie inside
# the remainder chunk (the last `tile` rows up to its end, or rows 0..tile-1) of another group.
ISOLATION_CASES = [
    (30, 8, [3, 0, 10, 6, 4], {'group 2, in the chunk of group 3': 11,
                               'group 3, in the chunk of group 4': 16}),
    (13, 8, [2, 0, 3], {'group 2, in the chunk of group 0': 3,
                        'past the sum, in the chunks of groups 0 and 2': 6}),
]


def _assert_close_and_finite(got, want, keep, tol, what):
  """got == want (assert_close) on the entries `keep` selects, where want is finite."""
  got, want = (np.asarray(a.astype(jnp.float32), np.float64)[keep] for a in (got, want))
  assert np.all(np.isfinite(want)), f'{what}: the reference is not finite'
  assert np.all(np.isfinite(got)), f'{what}: a non-finite value leaked in'
  assert_close(got, want, tol, what)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_gmm_tiled_groups_stay_isolated_from_non_finite_rows(dtype):
  """An inf or NaN in one row of the cotangent or of lhs reaches no other group, as in
  ragged_dot: the remainder pass zeroes the rows outside the group in both operands of its
  outer product (0 x inf is NaN), so every other group's d_rhs, and every other row of the
  output and of d_lhs, == ragged_dot (finite)."""
  k_dim, n_dim = 6, 5
  dt, tol = DTYPES[dtype], TOL[dtype]
  for m, tile, sizes, bad_rows in ISOLATION_CASES:
    rng = np.random.default_rng(m)
    lhs, cot = rng.standard_normal((m, k_dim)), rng.standard_normal((m, n_dim))
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k_dim, n_dim)), dt)
    ends = np.cumsum(sizes)
    for where, row in bad_rows.items():
      for operand in ('cot', 'lhs'):
        for value in (np.inf, np.nan):
          lhs_b, cot_b = lhs.copy(), cot.copy()
          (lhs_b if operand == 'lhs' else cot_b)[row, 2] = value
          got, want = _gmm_both(jnp.asarray(lhs_b, dt), rhs, jnp.asarray(sizes, jnp.int32),
                                jnp.asarray(cot_b, dt), tile)
          what = f'{dtype} sizes {sizes}: {value} in {operand} row {row}, {where}'
          keep_rows = np.arange(m) != row
          keep_groups = np.arange(len(sizes)) != np.searchsorted(ends, row, side='right')
          for name, g, w, keep in (('out', got[0], want[0], keep_rows),
                                   ('d_lhs', got[1], want[1], keep_rows),
                                   ('d_rhs', got[2], want[2], keep_groups)):
            _assert_close_and_finite(g, w, keep, tol, f'{what}: {name}')


def test_gmm_tiled_accepts_numpy_operands_eagerly():
  """Eagerly (outside jit) with numpy lhs, rhs and sizes, as every backend accepts: gmm_tiled
  (and gmm_xla) == ragged_dot, forward and VJP."""
  rng = np.random.default_rng(3)
  lhs = rng.standard_normal((21, 6)).astype(np.float32)
  rhs = rng.standard_normal((4, 6, 5)).astype(np.float32)
  cot = rng.standard_normal((21, 5)).astype(np.float32)
  sizes = np.array([5, 0, 9, 4], np.int32)  # sum 18 < 21
  ragged = lambda l, r: jax.lax.ragged_dot(l, r, jnp.asarray(sizes),
                                           preferred_element_type=jnp.float32)
  want, vjp_r = jax.vjp(ragged, lhs, rhs)
  for name, fn in (('gmm_tiled', gmm_tiled), ('gmm_xla', gmm_xla)):
    assert_close(fn(lhs, rhs, sizes, 8), want, TOL['float32'], f'{name}: numpy operands')
    got, vjp_t = jax.vjp(lambda l, r, fn=fn: fn(l, r, sizes, 8), lhs, rhs)
    for what, a, b in zip(('d_lhs', 'd_rhs'), vjp_t(cot), vjp_r(cot)):
      assert_close(a, b, TOL['float32'], f'{name}: {what}')


def test_gmm_tiled_and_xla_compute_float64_in_float64():
  """float64 operands (jax_enable_x64) are accumulated in float64 (float32 would be ~3e-8
  off): gmm_tiled (forward and VJP) and gmm_xla == a float64 numpy loop to rtol 1e-12."""
  rng = np.random.default_rng(8)
  m, sizes, tile = 29, [5, 0, 11, 9], 8  # sum 25 < 29
  lhs64, ct64 = rng.standard_normal((m, 7)), rng.standard_normal((m, 6))
  rhs64 = rng.standard_normal((4, 7, 6))
  want = gmm_numpy(lhs64, rhs64, sizes)
  want_lhs, want_rhs = gmm_vjp_numpy(lhs64, rhs64, sizes, ct64)
  with jax.enable_x64(True):
    lhs, rhs, ct = (jnp.asarray(a, jnp.float64) for a in (lhs64, rhs64, ct64))
    gs = jnp.asarray(sizes, jnp.int32)
    out_x = gmm_xla(lhs, rhs, gs)
    out_t, vjp_t = jax.vjp(lambda l, r: gmm_tiled(l, r, gs, tile), lhs, rhs)
    d_lhs, d_rhs = vjp_t(ct)
    assert out_x.dtype == out_t.dtype == d_lhs.dtype == d_rhs.dtype == jnp.float64
    for what, got, ref in (('gmm_xla', out_x, want), ('gmm_tiled', out_t, want),
                           ('gmm_tiled d_lhs', d_lhs, want_lhs),
                           ('gmm_tiled d_rhs', d_rhs, want_rhs)):
      # np.testing, not assert_close (which compares in float32)
      np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-12, atol=1e-12, err_msg=what)


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


WORK_CASES = [(m, sizes, tile) for (m, _, tile), cases in GMM_CASES.items()
              for sizes in cases.values()] + [
    (64, [64] + [0] * 255, 16),          # E = 256, all rows in the first group
    (64, [0] * 255 + [64], 16),          # ... in the last group
    (64, [1] * 64 + [0] * 192, 16),      # E = 256, one row each for 64 groups
    (100, [3] * 30 + [0] * 10, 7),       # many tiny groups straddling tile edges
]


@pytest.mark.parametrize('m,sizes,tile', WORK_CASES,
                         ids=[f'M{m}-E{len(s)}-tile{t}-{i}' for i, (m, s, t) in enumerate(WORK_CASES)])
def test_work_items_bound_and_intersection(m, sizes, tile):
  num_groups = len(sizes)
  group, tile_idx, valid, starts, ends = jax.jit(work_items, static_argnums=(1, 2))(
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


BACKENDS = ('reference', 'tiled', 'xla', 'dense')


@functools.partial(jax.jit, static_argnums=(5,))
def _all_backends(x, experts_Tk, weights, params, ct, tile):
  """Outputs and VJPs (w.r.t. x, weights, params) of every backend, in one compilation."""
  out = {}
  for name in BACKENDS:
    fn = lambda x, w, p: dispatch(x, experts_Tk, w, p, name, tile, runtime=HERE)
    y, vjp = jax.vjp(fn, x, weights, params)
    out[name] = (y, *vjp(ct))
  return out


def _expert_params(rng, experts, d, f, dtype=jnp.float32):
  return {
      'gate': jnp.asarray(rng.standard_normal((experts, d, f)) / np.sqrt(d), dtype),
      'up': jnp.asarray(rng.standard_normal((experts, d, f)) / np.sqrt(d), dtype),
      'down': jnp.asarray(rng.standard_normal((experts, f, d)) / np.sqrt(f), dtype),
  }


def _per_token_loop(x, ex, w, p):
  """y_t = sum_j w_tj * SwiGLU_{e_tj}(x_t), one token and one choice at a time (float64)."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  p = {n: np.asarray(v, np.float64) for n, v in p.items()}
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(ex.shape[1]):
      e = ex[t, j]
      g = x[t] @ p['gate'][e]
      y[t] += w[t, j] * ((g / (1 + np.exp(-g)) * (x[t] @ p['up'][e])) @ p['down'][e])
  return y


# (tokens, k, experts, tile); every shape runs the routings 'random', 'idle' and 'one'.
DISPATCH_SHAPES = [
    (19, 2, 5, 8),
    (17, 1, 4, 4),
    (11, 3, 8, 64),   # tile larger than T * k
]


@pytest.mark.parametrize('tokens,k,experts,tile', DISPATCH_SHAPES)
def test_dispatch_backends_equal_reference(tokens, k, experts, tile):
  d, f = 8, 12
  for mode in ('random', 'idle', 'one'):
    rng = np.random.default_rng(tokens * 100 + k * 10 + experts + len(mode))
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
    ex = _routing(rng, tokens, k, experts, mode)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)
    params = _expert_params(rng, experts, d, f)
    ct = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
    counts = np.bincount(ex.ravel(), minlength=experts)
    if mode == 'idle':
      assert counts[1] == 0
    if mode == 'one':
      assert counts[2] == tokens

    res = _all_backends(x, jnp.asarray(ex), weights, params, ct, tile)
    y_ref, gx_ref, gw_ref, gp_ref = res['reference']
    # The reference itself against the obvious per-token loop.
    assert_close(y_ref, _per_token_loop(x, ex, weights, params), 1e-5, f'{mode}: reference')
    for backend in ('tiled', 'xla', 'dense'):
      y, gx, gw, gp = res[backend]
      what = f'{mode}/{backend}'
      assert_close(y, np.asarray(y_ref), 1e-5, f'{what}: y')
      assert_close(gx, np.asarray(gx_ref), 1e-5, f'{what}: d_x')
      assert_close(gw, np.asarray(gw_ref), 1e-5, f'{what}: d_weights')
      for name in ('gate', 'up', 'down'):
        assert_close(gp[name], np.asarray(gp_ref[name]), 1e-5, f'{what}: d_{name}')
        for e in np.flatnonzero(counts == 0):  # an idle expert learns nothing
          np.testing.assert_array_equal(np.asarray(gp[name][e]), 0.0)
        # ... and a used one does.
        assert float(jnp.max(jnp.abs(gp[name][int(np.argmax(counts))]))) > 0


def test_dispatch_bfloat16_backends_agree():
  """bf16 inputs: 'tiled' and 'xla' within 2e-2 of 'reference', outputs and gradients."""
  rng = np.random.default_rng(11)
  tokens, k, experts, d, f, tile = 21, 2, 6, 8, 8, 8
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  x = bf(rng.standard_normal((tokens, d)))
  ex = jnp.asarray(_routing(rng, tokens, k, experts, 'idle'))
  w = bf(rng.uniform(0.1, 1.0, (tokens, k)))
  p = _expert_params(rng, experts, d, f, jnp.bfloat16)
  ct = bf(rng.standard_normal((tokens, d)))
  res = _all_backends(x, ex, w, p, ct, tile)
  ref = jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32)), res['reference'])
  assert res['reference'][0].dtype == jnp.bfloat16
  for backend in ('tiled', 'xla', 'dense'):
    got = res[backend]
    assert got[0].dtype == jnp.bfloat16
    for i, name in enumerate(('y', 'd_x', 'd_weights')):
      assert_close(got[i], ref[i], 2e-2, f'{backend}: {name}')
    for name in ('gate', 'up', 'down'):
      assert_close(got[3][name], ref[3][name], 2e-2, f'{backend}: d_{name}')


def test_decode_steps_of_small_experts_run_dense_and_equal_the_grouped_path():
  """A decode step on the 'tiled' backend: every expert on every token in three matmuls
  (no sort) while 3 T E D F <= DENSE_MAX_MACS, the grouped path past it; the same outputs as
  the per-token loop either way."""
  rng = np.random.default_rng(12)
  experts, d, f = 4, 8, 12
  params = _expert_params(rng, experts, d, f)
  for tokens in (3, DENSE_MAX_MACS // (3 * experts * d * f) + 1):
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
    ex = _routing(rng, tokens, 2, experts, 'random')
    w = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 2)), jnp.float32)
    fn = jax.jit(lambda x, w: dispatch(x, jnp.asarray(ex), w, params, 'tiled', 8, runtime=HERE,
                                       decode=True))
    assert_close(fn(x, w), _per_token_loop(x, ex, w, params), 1e-5, f'{tokens} tokens')
    sorts = fn.lower(x, w).as_text().count('stablehlo.sort')
    assert (sorts == 0) == (tokens <= 3), (tokens, sorts)


def test_dispatch_rejects_unknown_backend():
  x = jnp.zeros((2, 4))
  p = {'gate': jnp.zeros((2, 4, 3)), 'up': jnp.zeros((2, 4, 3)), 'down': jnp.zeros((2, 3, 4))}
  with pytest.raises(ValueError, match='dispatch'):
    dispatch(x, jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1)), p, 'magic', runtime=HERE)


def test_gmm_tiled_keeps_no_float32_copy_of_its_rows():
  """bfloat16 operands: the compiled grouped matmul keeps no float32 array of every output
  row (each tile is written in bfloat16 as soon as its matmul ends): its temporaries are 0.58
  of a float32 [M, N] here, where keeping one made them 1.05. An expert-parallel step's
  largest buffers were such copies, over the worst-case receive rows."""
  m, k, n, g = 4096, 16, 512, 4
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  fwd = jax.jit(lambda l, r, s: gmm_tiled(l, r, s, 128)).lower(lhs, rhs, sizes).compile()
  assert fwd.memory_analysis().temp_size_in_bytes < 0.8 * m * n * 4


def test_row_permutations_differentiate_as_indexing_without_a_scatter():
  """permute_rows and gather_tokens: values and gradients (float32 and bfloat16) equal plain
  indexing's, and their backward programs gather (no scatter of the [rows, D] gradient)."""
  from loopmoe_jax.dispatch import gather_tokens, inverse_permutation, permute_rows
  rng = np.random.default_rng(0)
  t, k, d = 7, 3, 5
  experts = jnp.asarray(rng.integers(0, 4, t * k))
  order = jnp.argsort(experts, stable=True)
  inverse = inverse_permutation(order)
  np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(t * k))
  w_MD = jnp.asarray(rng.normal(size=(t * k, d)), jnp.float32)
  for dtype in (jnp.float32, jnp.bfloat16):
    x_TD = jnp.asarray(rng.normal(size=(t, d)), dtype)
    ours = lambda x: permute_rows(gather_tokens(x, order, inverse, k) * w_MD.astype(dtype),
                                  inverse, order)
    plain = lambda x: (x[order // k] * w_MD.astype(dtype))[inverse]
    np.testing.assert_array_equal(np.asarray(ours(x_TD), np.float32),
                                  np.asarray(plain(x_TD), np.float32))
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x).astype(jnp.float32)))
    g_ours, g_plain = jax.grad(loss(ours))(x_TD), jax.grad(loss(plain))(x_TD)
    assert g_ours.dtype == dtype
    np.testing.assert_allclose(np.asarray(g_ours, np.float32), np.asarray(g_plain, np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)
    hlo = jax.jit(jax.grad(loss(ours))).lower(x_TD).as_text()
    assert 'scatter' not in hlo
    assert 'scatter' in jax.jit(jax.grad(loss(plain))).lower(x_TD).as_text()


@pytest.mark.parametrize('backend', ['tiled', 'pallas'])
def test_token_chunked_dispatch_equals_whole_and_keeps_less(backend):
  """dispatch(block_rows=r): the tokens in chunks of at most r routed rows, each recomputed
  in its backward: the same outputs and gradients (tokens, routing weights and every expert
  tensor) as one chunk, on a skewed routing (two experts take half the rows) and a token count
  that the chunks do not divide (padded tokens); the backward program keeps fewer
  temporaries."""
  from loopmoe_jax.chunks import token_chunks
  from loopmoe_jax.dispatch import dispatch
  rng = np.random.default_rng(3)
  t, k, d, f, g = 120, 2, 16, 64, 5
  ids = np.stack([rng.choice(g, k, replace=False) for _ in range(t)]).astype(np.int32)
  ids[:60] = [0, 1]
  ids, w = jnp.asarray(ids), jnp.asarray(rng.random((t, k)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  params = {n: jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
            for n, s in (('gate', (g, d, f)), ('up', (g, d, f)), ('down', (g, f, d)))}
  ct = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  # 240 rows: at most 100 -> 3 chunks of 40 tokens (80 rows; 2 chunks hold 120), 50 -> 5,
  # 14 -> 18 chunks of 7 tokens (126: 6 padded), 2 -> 120 of one token; under one token's rows
  assert [token_chunks(t, k, g, 1, r) for r in (0, 240, 100, 50, 14, 2)] == [1, 1, 3, 5, 18,
                                                                              120]
  with pytest.raises(ValueError, match=r'run\.expert_block_rows=1: one token alone fills 2'):
    token_chunks(t, k, g, 1, 1)

  def vjp(block_rows):
    def run(x, w, params):
      out, pull = jax.vjp(
          lambda x, w, p: dispatch(x, ids, w, p, backend, 8, None, block_rows, runtime=HERE),
          x, w, params)
      return out, pull(ct)
    return jax.jit(run)

  want = vjp(0)(x, w, params)
  scale = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(want))
  for block_rows in (100, 50, 14):
    got = vjp(block_rows)(x, w, params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale)
  if backend == 'tiled':
    temp = {b: vjp(b).lower(x, w, params).compile().memory_analysis().temp_size_in_bytes
            for b in (0, 50)}
    assert temp[50] < 0.6 * temp[0], temp


@pytest.mark.filterwarnings('ignore:invalid value encountered:RuntimeWarning')
def test_pallas_expert_ffn_contains_non_finite_rows_past_the_sum():
  """The Pallas expert FFN leaves its gate/up output's rows past the group-size sum unzeroed
  (gmm zero_tail=False): NaN / inf rows there (here put into its input) reach no output row,
  no input-gradient row and no expert weight gradient; all equal the tiled FFN's."""
  from loopmoe_jax.dispatch import grouped_ffn
  rng = np.random.default_rng(4)
  m, d, f, g = 96, 16, 32, 3
  sizes = jnp.asarray([20, 31, 17], jnp.int32)  # rows 68.. past the sum
  x = np.asarray(rng.normal(size=(m, d)), np.float32)
  x[70], x[90] = np.nan, np.inf
  x = jnp.asarray(x)
  params = {k: jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
            for k, s in (('gate', (g, d, f)), ('up', (g, d, f)), ('down', (g, f, d)))}
  ct = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)

  def vjp(backend):
    out, pull = jax.vjp(lambda x, p: grouped_ffn(x, sizes, p, backend, 8, runtime=HERE), x, params)
    return out, *pull(ct)

  got, want = jax.jit(lambda: vjp('pallas'))(), jax.jit(lambda: vjp('tiled'))()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
