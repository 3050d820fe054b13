"""pallas_kernels against slow, obvious references, on CPU in interpret mode.

- gmm (every kernel family: 'gpu' Triton under interpret=True, 'mgpu' Mosaic GPU under its
  interpreter, persistent and one CTA per tile, 'mgpu_ws' warp-specialised (Mosaic GPU: 16-bit
  inputs; float32 goes to Triton), 'tpu'
  Mosaic under pltpu.InterpretParams()) == a float64 numpy per-group loop ==
  jax.lax.ragged_dot, forward and both gradients, float32 and bf16, K in two tile steps, on
  ragged sizes: empty groups, one group taking every row, sizes not a multiple of the tile,
  sizes summing to less than M (trailing rows zero).
- Group isolation (every family): an inf / NaN in a row of the cotangent or of lhs, of one
  group or past the group-size sum, leaves every other group's d_rhs and every other row of
  the output and d_lhs == ragged_dot's (finite).
- tgmm == numpy per-group lhs^T @ grad (empty groups give zero blocks).
- float64 operands (jax_enable_x64) are refused by gmm, tgmm and gmm_swiglu with a ValueError.
- gmm_swiglu (fused gate/up) == separate ragged_dots.
- route == softmax/sigmoid + jax.lax.top_k (+ bias steering only the choice), counts ==
  bincount, positions == inverse of a stable argsort; permute/combine == gathers by the sort.
- dispatch 'pallas' == 'reference' (outputs and gradients); 'auto' resolves to 'tiled' on CPU.
- A LoopedMoE trained 3 SGD steps with dispatch 'pallas' (routing kernel, permute, gmm,
  combine) == with 'reference' (losses, params); its train step, and an MoE-sized gmm
  forward+backward, lower to compiled Triton / Mosaic GPU / Mosaic TPU kernels here.
- The Pallas self-check behind 'auto' executes even inside a trace and fails, with a reason,
  on a wrong kernel.
- GPU-marked tests (`-m gpu`, need a CUDA device and run without tests/conftest.py's CPU pin:
  scripts/gpu_check.sh) compile the GPU kernels for real and compare with ragged_dot; on CPU
  CI they skip with the reason printed.

Tolerances: float32 1e-5 of the reference's largest magnitude (1e-4 for a trained model);
bf16 inputs 2e-2 (8-bit mantissa; accumulation is float32 in every path).
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from loopmoe_jax import bench
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.dispatch import dispatch, resolve_backend
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.moe import route as moe_route
from loopmoe_jax.runtime import HERE, Runtime
from reference import as64, assert_close, cuda_devices, gmm_numpy, requires_gpu

TOL = {'float32': 1e-5, 'bfloat16': 2e-2}
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
M, K, N, G, TILE_M, TILE_N = 80, 16, 24, 6, 16, 8
SIZES = {  # sum <= M; tile 16
    'ragged_empty': [0, 21, 0, 7, 33, 0],    # empty groups, sizes not multiples of 16, sum 61
    'one_takes_all': [0, 0, 80, 0, 0, 0],
}
K_TILES = {'gmm': {'tile_k': 8}, 'tgmm': {'tile_k': 8}}  # K = 16 in two steps


def operands(dtype, seed=0):
  rng = np.random.default_rng(seed)
  cast = lambda a: jnp.asarray(a, jnp.float32).astype(DTYPES[dtype])
  return (cast(rng.normal(size=(M, K))), cast(rng.normal(size=(G, K, N)) / 4),
          cast(rng.normal(size=(M, N))))


FAMILIES = {  # name -> (target, tile overrides): every kernel family and the mgpu grid modes
    'gpu': ('gpu', K_TILES), 'tpu': ('tpu', K_TILES),
    'mgpu': ('mgpu', {op: {'tile_k': 8, 'persistent': True} for op in ('gmm', 'tgmm')}),
    'mgpu_cta_per_tile': ('mgpu', {op: {'tile_k': 8, 'persistent': False}
                                   for op in ('gmm', 'tgmm')}),
    # warp-specialised Mosaic GPU: the CTA tile is split between two compute warpgroups
    'mgpu_ws': ('mgpu_ws', K_TILES),
    # the GPU default: Mosaic GPU forward and input gradient, Triton weight gradient
    'mixed': (None, {'gmm': {'family': 'mgpu', 'tile_k': 8},
                     'tgmm': {'family': 'gpu', 'tile_k': 8}}),
}


def test_kernel_family_per_op_and_bad_names():
  assert [dict(cfg)['family'] for cfg in pk.ops.tiling('mgpu')] == ['mgpu', 'mgpu']
  fams = [dict(cfg)['family'] for cfg in pk.ops.tiling(None, overrides={'tgmm': {'family': 'tpu'}})]
  assert fams == ['gpu', 'tpu']  # CPU default 'gpu'; the override names its own family
  with pytest.raises(ValueError, match="family='cuda'"):
    pk.gmm(jnp.zeros((8, 4)), jnp.zeros((2, 4, 4)), jnp.array([4, 4]),
           tiles={'gmm': {'family': 'cuda'}})
  with pytest.raises(ValueError, match=r"unknown op\(s\) \['gmn'\]"):
    pk.gmm(jnp.zeros((8, 4)), jnp.zeros((2, 4, 4)), jnp.array([4, 4]), tiles={'gmn': {}})
  with pytest.raises(ValueError, match="target='triton'"):
    pk.gmm(jnp.zeros((8, 4)), jnp.zeros((2, 4, 4)), jnp.array([4, 4]), target='triton')


def test_bad_operands_raise_naming_the_problem():
  lhs, rhs, sizes = jnp.zeros((8, 4)), jnp.zeros((2, 4, 3)), jnp.array([4, 4])
  cases = [(lambda: pk.gmm(lhs, jnp.zeros((2, 5, 3)), sizes), r'lhs.shape\[1\] = 4, rhs.shape\[1\] = 5'),
           (lambda: pk.gmm(lhs, rhs, jnp.array([4, 2, 2])), 'group_sizes has 3 groups but rhs has 2'),
           (lambda: pk.gmm(lhs[0], rhs, sizes), r'lhs must be \[M, K\]'),
           (lambda: pk.gmm(lhs, rhs, jnp.array([4.0, 4.0])), 'group_sizes must be a 1-D integer'),
           (lambda: pk.tgmm(lhs, jnp.zeros((7, 3)), sizes), r'grad.shape \(7, 3\)'),
           (lambda: pk.gmm_swiglu(lhs, rhs, rhs[:, :, :2], sizes), 'gate and up shapes differ'),
           (lambda: pk.gmm(lhs, rhs, sizes, target='gpu', tile_m=24), 'tile_m=24 .* power of two'),
           (lambda: pk.gmm(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes,
                           target='mgpu', tiles={'gmm': {'tile_m': 0}}), 'tile_m=0 .* positive'),
           (lambda: pk.gmm(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes,
                           target='mgpu_ws', tile_m=32, interpret=False), 'multiple of 64')]
  for fn, match in cases:
    with pytest.raises(ValueError, match=match):
      fn()


def test_sizes_past_the_rows_are_clipped_and_mixed_dtypes_promote():
  """Sizes summing past M end the groups at row M (negative sizes count as 0): the same as
  ragged_dot on the clipped sizes and as numpy; bf16 x float32 promotes like ragged_dot."""
  lhs, rhs, _ = operands('float32', seed=3)
  sizes = [30, -5, 40, 0, 25, 9]  # cumulative 30, 30, 70, 70, 95 > M = 80
  clipped = [30, 0, 40, 0, 10, 0]
  np.testing.assert_array_equal(pk.ops.clip_sizes(jnp.asarray(sizes), M), clipped)
  huge = [10, 2**31 - 1, 2**30, 2**30, 5]  # a plain int32 running sum would wrap
  np.testing.assert_array_equal(pk.ops.clip_sizes(jnp.asarray(huge, jnp.int32), M),
                                [10, M - 10, 0, 0, 0])
  got = pk.gmm(lhs, rhs[:5], jnp.asarray(huge, jnp.int32), tile_m=TILE_M, tile_n=TILE_N)
  assert_close(got, gmm_numpy(as64(lhs), as64(rhs[:5]), [10, M - 10, 0, 0, 0]),
               TOL['float32'], 'sizes near the int32 limit')
  got = pk.gmm(lhs, rhs, jnp.asarray(sizes), tile_m=TILE_M, tile_n=TILE_N)
  assert_close(got, gmm_numpy(as64(lhs), as64(rhs), clipped), TOL['float32'], 'clipped sizes')
  mixed = pk.gmm(lhs.astype(jnp.bfloat16), rhs, jnp.asarray(clipped), tile_m=TILE_M,
                 tile_n=TILE_N)
  want = jax.lax.ragged_dot(lhs.astype(jnp.bfloat16), rhs, jnp.asarray(clipped))
  assert mixed.dtype == want.dtype == jnp.float32
  assert_close(mixed, want, TOL['float32'], 'bf16 x float32')


@pytest.mark.parametrize('family', list(FAMILIES))
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_gmm_forward_and_vjp_match_numpy_and_ragged_dot(family, dtype):
  target, tiles = FAMILIES[family]
  lhs, rhs, cot = operands(dtype)
  for case, sizes in SIZES.items():
    gs = jnp.asarray(sizes, jnp.int32)
    kern = lambda l, r: pk.gmm(l, r, gs, target=target, tile_m=TILE_M, tile_n=TILE_N,
                               tiles=tiles)
    ragged = lambda l, r: jax.lax.ragged_dot(l, r, gs, preferred_element_type=jnp.float32)

    @jax.jit
    def both(l, r, c):
      out_k, vjp_k = jax.vjp(kern, l, r)
      out_r, vjp_r = jax.vjp(ragged, l, r)
      return out_k, vjp_k(c), out_r, vjp_r(c.astype(jnp.float32))

    out_k, (dl_k, dr_k), out_r, (dl_r, dr_r) = both(lhs, rhs, cot)
    assert out_k.dtype == lhs.dtype and dl_k.dtype == lhs.dtype and dr_k.dtype == rhs.dtype
    tol, what = TOL[dtype], f'{family} {dtype} {case}'
    want = gmm_numpy(as64(lhs), as64(rhs), sizes)
    assert_close(out_k, want, tol, f'{what}: gmm vs numpy')
    assert_close(out_k, out_r, tol, f'{what}: gmm vs ragged_dot')
    assert_close(dl_k, dl_r, tol, f'{what}: d_lhs vs ragged_dot')
    assert_close(dr_k, dr_r, tol, f'{what}: d_rhs vs ragged_dot')
    total = sum(sizes)
    assert not np.any(as64(out_k)[total:]) and not np.any(as64(dl_k)[total:]), 'rows past sum'
    for g in np.flatnonzero(np.asarray(sizes) == 0):
      assert not np.any(as64(dr_k[g])), f'{what}: d_rhs of empty group {g} not zero'


# Groups of the isolation test, on the first 48 rows: row tile 16..31 holds rows of groups
# 1, 3 and 4; tile 32..47 rows of group 4 and rows 41..47, past the group-size sum 41.
ISOLATION_SIZES = [0, 21, 0, 7, 13, 0]
# {operand: {row: value}}: inf and NaN in rows of lhs and of the cotangent at once (one
# interpreted run per family). Rows 24 and 25 are in group 3, rows 44 and 47 past the sum.
NON_FINITE_CASES = [{'lhs': {24: np.nan, 44: np.inf}, 'cot': {25: np.inf, 47: np.nan}}]


def group_of_row(sizes, row):
  """The group owning `row`, or None past the group-size sum."""
  ends = np.cumsum(sizes)
  return int(np.searchsorted(ends, row, side='right')) if row < ends[-1] else None


def assert_close_and_finite(got, want, keep, tol, what):
  """got == want (assert_close) on the entries `keep` selects, where want is finite."""
  got, want = as64(got)[keep], as64(want)[keep]
  assert np.all(np.isfinite(want)), f'{what}: the reference is not finite'
  assert np.all(np.isfinite(got)), f'{what}: a non-finite value leaked in'
  assert_close(got, want, tol, what)


@pytest.mark.filterwarnings('ignore:invalid value encountered:RuntimeWarning')  # the bad group
@pytest.mark.parametrize('family', list(FAMILIES))
def test_gmm_groups_stay_isolated_from_non_finite_rows(family):
  """An inf or NaN in rows of the cotangent or of lhs (of group 3, or past the group-size sum)
  reaches no other group, as in ragged_dot: every other group's d_rhs (tgmm masks both of its
  operands: 0 x inf is NaN), every other row of the output and of d_lhs == ragged_dot
  (finite). bf16 where the family needs 16-bit inputs (Mosaic GPU), else float32."""
  target, tiles = FAMILIES[family]
  dtype = 'float32' if family in ('gpu', 'tpu') else 'bfloat16'
  m, n = 48, 16
  lhs, rhs, cot = (np.asarray(a.astype(jnp.float32)) for a in operands(dtype, seed=5))
  lhs, rhs, cot = lhs[:m], rhs[:, :, :n], cot[:m, :n]
  sizes = ISOLATION_SIZES
  gs = jnp.asarray(sizes, jnp.int32)
  kern = lambda l, r: pk.gmm(l, r, gs, target=target, tile_m=TILE_M, tile_n=TILE_N, tiles=tiles)
  ragged = lambda l, r: jax.lax.ragged_dot(l, r, gs, preferred_element_type=jnp.float32)

  @jax.jit
  def both(l, r, c):
    out_k, vjp_k = jax.vjp(kern, l, r)
    out_r, vjp_r = jax.vjp(ragged, l.astype(jnp.float32), r.astype(jnp.float32))
    return (out_k, *vjp_k(c)), (out_r, *vjp_r(c.astype(jnp.float32)))

  cast = lambda a: jnp.asarray(a).astype(DTYPES[dtype])
  for case in NON_FINITE_CASES:
    lhs_b, cot_b = lhs.copy(), cot.copy()
    for operand, rows in case.items():
      for row, value in rows.items():
        (lhs_b if operand == 'lhs' else cot_b)[row, 3] = value
    got, want = both(cast(lhs_b), cast(rhs), cast(cot_b))
    bad = {row for rows in case.values() for row in rows}
    bad_groups = {group_of_row(sizes, row) for row in bad}
    what = f'{family} {dtype}: {case} (groups {bad_groups})'
    # the bad rows' own output / d_lhs rows and their group's d_rhs may be non-finite
    keep_rows = ~np.isin(np.arange(m), list(bad))
    keep_groups = ~np.isin(np.arange(G), [g for g in bad_groups if g is not None])
    for name, g, w, keep in (('out', got[0], want[0], keep_rows),
                             ('d_lhs', got[1], want[1], keep_rows),
                             ('d_rhs', got[2], want[2], keep_groups)):
      assert_close_and_finite(g, w, keep, TOL[dtype], f'{what}: {name}')
    for g in np.flatnonzero(np.asarray(sizes) == 0):
      assert not np.any(as64(got[2][g])), f'{what}: d_rhs of empty group {g} not zero'


def test_mgpu_ws_splits_tiles_between_warpgroups_or_falls_back():
  """The warp-specialised kernels give each of the two compute warpgroups the largest tile
  (>= 8) whose double divides the dimension, with several column / K tiles per group here,
  and fall back to the plain Mosaic GPU kernel when none does: all == numpy."""
  split = pk.gmm_mgpu_ws._split  # pylint: disable=protected-access
  assert [split(128, d) for d in (1024, 1408, 384, 24, 16)] == [128, 64, 64, None, 8]
  rng = np.random.default_rng(4)
  sizes = [5, 0, 30, 2]  # sum 37 < 48: rows past the sum are zero
  ends = np.cumsum(sizes)
  for n, k in ((32, 32), (24, 24)):  # split (two tiles per warpgroup); no split: fall back
    lhs = jnp.asarray(rng.normal(size=(48, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(4, k, n)) / 4, jnp.bfloat16)
    grad = jnp.asarray(rng.normal(size=(48, n)), jnp.bfloat16)
    tiles = {'gmm': {'tile_n': 8, 'tile_k': 8}, 'tgmm': {'tile_n': 8, 'tile_k': 8}}
    kw = dict(target='mgpu_ws', tile_m=16, tiles=tiles)
    got = pk.gmm(lhs, rhs, jnp.asarray(sizes), **kw)
    assert_close(got, gmm_numpy(as64(lhs), as64(rhs), sizes), TOL['bfloat16'], f'gmm n={n}')
    got = pk.tgmm(lhs, grad, jnp.asarray(sizes), **kw)
    want = np.stack([as64(lhs)[e - s:e].T @ as64(grad)[e - s:e] for s, e in zip(sizes, ends)])
    assert_close(got, want, TOL['bfloat16'], f'tgmm k={k}')


def test_float64_operands_are_refused_naming_the_dtype():
  """The kernels compute in float32 / bfloat16: float64 operands (jax_enable_x64), also mixed
  with float32, raise a ValueError naming the dtype rather than silently losing precision."""
  with jax.enable_x64(True):
    lhs, rhs = jnp.zeros((8, 4), jnp.float64), jnp.zeros((2, 4, 3), jnp.float64)
    sizes = jnp.array([4, 4])
    cases = [('gmm', lambda: pk.gmm(lhs, rhs, sizes)),
             ('gmm', lambda: pk.gmm(lhs.astype(jnp.float32), rhs, sizes, target='tpu')),
             ('tgmm', lambda: pk.tgmm(lhs, jnp.zeros((8, 3), jnp.float32), sizes)),
             ('gmm_swiglu', lambda: pk.gmm_swiglu(lhs, rhs, rhs, sizes, target='mgpu'))]
    for op, fn in cases:
      with pytest.raises(ValueError, match=rf'pallas_kernels\.{op}: .*float64.*float32/bfloat16'):
        fn()


@pytest.mark.parametrize('target', ['gpu', 'mgpu', 'tpu'])
def test_tgmm_matches_numpy_per_group(target):
  lhs, _, grad = operands('float32', seed=1)
  sizes = SIZES['ragged_empty']
  got = pk.tgmm(lhs, grad, jnp.asarray(sizes), target=target, tile_m=TILE_M, tile_n=TILE_N,
                tiles=K_TILES)
  lhs64, grad64 = np.asarray(lhs, np.float64), np.asarray(grad, np.float64)
  ends = np.cumsum(sizes)
  want = np.stack([lhs64[e - s:e].T @ grad64[e - s:e] for s, e in zip(sizes, ends)])
  assert got.dtype == jnp.float32
  assert_close(got, want, TOL['float32'], f'{target} tgmm')


def test_gmm_swiglu_fused_matches_separate_ragged_dots():
  lhs, rhs, _ = operands('float32', seed=2)
  up = rhs[::-1]
  gs = jnp.asarray(SIZES['ragged_empty'])
  got = pk.gmm_swiglu(lhs, rhs, up, gs, tile_m=TILE_M, tile_n=TILE_N)
  want = jax.nn.silu(jax.lax.ragged_dot(lhs, rhs, gs)) * jax.lax.ragged_dot(lhs, up, gs)
  assert_close(got, want, TOL['float32'], 'gmm_swiglu')


@pytest.mark.parametrize('score,renormalize,bias', [
    ('softmax', True, False), ('softmax', False, False), ('softmax', True, True),
    ('sigmoid', True, True)])
def test_route_matches_top_k_and_stable_sort(score, renormalize, bias):
  t, e, k = 45, 8, 2  # 3 token blocks of 16, the last one padded
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(t, e)), jnp.float32)
  bias_E = jnp.asarray(rng.normal(size=(e,)) * 0.2, jnp.float32) if bias else None
  got = pk.route(logits, k, renormalize=renormalize, bias_E=bias_E, score=score, block_t=16)
  if score == 'softmax' and not bias:  # the model's own router is the reference
    want_e, want_w, want_s = moe_route(logits, k, renormalize)
  else:
    want_s = jax.nn.softmax(logits) if score == 'softmax' else jax.nn.sigmoid(logits)
    _, want_e = jax.lax.top_k(want_s + (0 if bias_E is None else bias_E), k)
    want_w = jnp.take_along_axis(want_s, want_e, axis=1)
    if renormalize:
      want_w = want_w / jnp.sum(want_w, axis=1, keepdims=True)
  np.testing.assert_array_equal(got['experts_Tk'], want_e)
  assert_close(got['weights_Tk'], want_w, TOL['float32'], 'route weights')
  assert_close(got['scores_TE'], want_s, TOL['float32'], 'route scores')
  flat = np.asarray(want_e).reshape(-1)
  np.testing.assert_array_equal(got['counts_E'], np.bincount(flat, minlength=e))
  order = np.argsort(flat, kind='stable')
  np.testing.assert_array_equal(np.asarray(got['positions_Tk']).reshape(-1), np.argsort(order))
  x = jnp.asarray(rng.normal(size=(t, 4)), jnp.float32)
  x_M = pk.permute(x, got['positions_Tk'])
  np.testing.assert_array_equal(x_M, np.asarray(x)[order // k])
  y = pk.combine(x_M * 2.0, got['positions_Tk'], got['weights_Tk'])
  assert_close(y, 2.0 * x * jnp.sum(got['weights_Tk'], axis=1, keepdims=True), 1e-6, 'combine')


def _expert_params(e, d, f, seed):
  keys = jax.random.split(jax.random.key(seed), 3)
  return {'gate': jax.random.normal(keys[0], (e, d, f)) / 4,
          'up': jax.random.normal(keys[1], (e, d, f)) / 4,
          'down': jax.random.normal(keys[2], (e, f, d)) / 4}


@pytest.mark.parametrize('case', ['idle_expert', 'all_to_one'])
def test_dispatch_pallas_equals_reference(case):
  t, d, f, e, k = 40, 16, 16, 4, 2
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  experts = np.stack([rng.choice(3, size=k, replace=False) for _ in range(t)])  # expert 3 idle
  if case == 'all_to_one':
    experts = np.stack([np.full(t, 2), np.full(t, 0)], axis=1)
  experts = jnp.asarray(experts, jnp.int32)
  weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(t, k)), jnp.float32))
  params = _expert_params(e, d, f, 5)

  def run(backend):
    loss = lambda x, w, p: jnp.sum(jnp.sin(dispatch(x, experts, w, p, backend, 8, runtime=HERE)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, weights, params)

  (v_p, g_p), (v_r, g_r) = run('pallas'), run('reference')
  assert_close(v_p, v_r, TOL['float32'], f'{case} loss')
  for path, a, b in zip(range(5), jax.tree.leaves(g_p), jax.tree.leaves(g_r)):
    assert_close(a, b, 1e-4, f'{case} grad leaf {path}')


def test_auto_resolves_to_tiled_on_cpu_and_matches():
  assert jax.default_backend() == 'cpu'
  assert resolve_backend('auto', runtime=HERE) == 'tiled'
  t, d, f, e = 24, 8, 8, 4
  x = jax.random.normal(jax.random.key(0), (t, d))
  experts = jax.random.randint(jax.random.key(1), (t, 2), 0, e)
  weights = jnp.full((t, 2), 0.5)
  params = _expert_params(e, d, f, 2)
  assert_close(dispatch(x, experts, weights, params, 'auto', 8, runtime=HERE),
               dispatch(x, experts, weights, params, 'reference', runtime=HERE),
               TOL['float32'], 'auto')


def test_pallas_self_check_runs_inside_a_trace_and_catches_a_wrong_kernel(monkeypatch):
  """The self-check executes for real even inside a trace (interpret mode on CPU) and fails,
  naming why, when the kernel is wrong. Where 'auto' would pick Pallas (here: with CPU's
  choice set to it), the verdict is settled into the runtime once (a Job's, a loaded run's)
  and every trace reads it: Pallas when it passed, the fallback when not."""
  import loopmoe_jax.dispatch as dsp
  from loopmoe_jax.runtime import Runtime
  seen = {}
  jax.jit(lambda x: seen.setdefault('error', dsp.pallas_self_check()) or x)(1.0)
  assert seen['error'] == ''
  monkeypatch.setattr(dsp, 'FASTEST', {**dsp.FASTEST, 'cpu': 'pallas'})
  assert Runtime.of().pallas_check is None and dsp.settle(Runtime.of()).pallas_check == ''
  calls = []
  real_check = dsp.pallas_self_check
  monkeypatch.setattr(dsp, 'pallas_self_check', lambda: calls.append(1) or real_check())
  real = pk.gmm
  monkeypatch.setattr(dsp.pallas_kernels, 'gmm', lambda l, r, s: real(l, r[::-1], s))
  bad = dsp.settle(Runtime.of())
  assert 'relative error' in bad.pallas_check and len(calls) == 1
  assert dsp.resolve_backend('auto', runtime=bad) == dsp.FALLBACK
  assert dsp.resolve_backend('auto', runtime=bad.with_run(remat='full')) == dsp.FALLBACK
  assert dsp.resolve_backend('auto', runtime=bad.replace(pallas_check='')) == 'pallas'
  assert len(calls) == 1  # settled: read, not checked again
  # asking for Pallas by name where the check failed: refused, naming why and what would run
  with pytest.raises(ValueError, match=r"run.dispatch='pallas': relative error .* use auto or "
                                       'xla'):
    dsp.resolve_backend('pallas', runtime=bad)
  assert dsp.resolve_backend('pallas', runtime=bad.replace(pallas_check='')) == 'pallas'


@pytest.mark.parametrize('target', ['gpu', 'mgpu', 'mgpu_ws'])
def test_gmm_forward_and_backward_lower_for_cuda_at_moe_size(target):
  """The compiled GPU kernels (Triton; Mosaic GPU with in-kernel transposes, plain and
  warp-specialised) lower at an MoE-sized bf16 problem (M 65536, K 2048, N 1024, 64 groups):
  the default tiles fit shared memory (Mosaic GPU checks it while lowering)."""
  from lowering import lower_for
  shapes = (jax.ShapeDtypeStruct((65536, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 2048, 1024), jnp.bfloat16))
  sizes = jnp.full((64,), 1024, jnp.int32)
  loss = lambda l, r: jnp.sum(pk.gmm(l, r, sizes, target=target, interpret=False)
                              .astype(jnp.float32))
  text = lower_for('cuda', jax.value_and_grad(loss, (0, 1)), *shapes)
  marker = {'gpu': 'custom_call @__gpu$xla.gpu.triton(', 'mgpu': 'custom_call @mosaic_gpu_v2(',
            'mgpu_ws': 'custom_call @mosaic_gpu_v2('}
  assert text.count(marker[target]) == 3, 'forward gmm, backward gmm and tgmm kernels'


@pytest.mark.parametrize('family', ['mgpu', 'mgpu_ws'])
def test_every_benchmark_variant_lowers_for_cuda(family):
  """Every Mosaic GPU tile variant `scripts/benchmark.py kernels` times on a GPU fits shared
  memory at the benchmark's shape (else the device run would lose it to a compile error)."""
  from lowering import lower_for
  from loopmoe_jax.bench.kernels import VARIANTS
  lhs = jax.ShapeDtypeStruct((65536, 2048), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((64, 2048, 1024), jnp.bfloat16)
  grad = jax.ShapeDtypeStruct((65536, 1024), jnp.bfloat16)
  sizes = jnp.full((64,), 1024, jnp.int32)
  for tiles in VARIANTS[family]['gmm']:
    kw = dict(target=family, interpret=False, tiles={'gmm': tiles})
    lower_for('cuda', lambda l, r, kw=kw: pk.gmm(l, r, sizes, **kw), lhs, rhs)
    # the input gradient: transposed rhs, N = 2048
    lower_for('cuda', lambda g, r, kw=kw: jax.vjp(lambda l: pk.gmm(l, r, sizes, **kw),
                                                  jnp.zeros(lhs.shape, lhs.dtype))[1](g),
              grad, rhs)
  for tiles in VARIANTS[family]['tgmm']:
    lower_for('cuda', lambda l, g, t=tiles: pk.tgmm(l, g, sizes, target=family, interpret=False,
                                                    tiles={'tgmm': t}), lhs, grad)


TINY_MOE = ModelConfig(vocab_size=32, d_model=16, num_heads=2, expert_width=16, top_k=2,
                       prelude_layers=0, core_layers=1, core_experts=4, num_loops=2,
                       coda_layers=0)
TINY_RUN = Runtime.of(dispatch_tile=8)  # the tiny model's run settings


def _trained(cfg, backends, steps=3):
  """Losses and params after `steps` SGD steps (LM + load-balance + z loss) per backend."""
  tokens = jax.random.randint(jax.random.key(7), (2, 9), 0, cfg.vocab_size)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  params0 = bench.init_params(LoopedMoE(cfg, runtime=TINY_RUN), batch['inputs'])
  results = {}
  for backend in backends:
    model = LoopedMoE(cfg, runtime=TINY_RUN.with_run(dispatch=backend))
    step = jax.jit(bench.make_train_step(model, lr=0.1))
    params, losses = params0, []
    for _ in range(steps):
      params, metrics = step(params, batch)
      losses.append(float(metrics['loss']))
    results[backend] = (losses, params)
  return results


def test_model_trained_with_pallas_matches_reference():
  """3 SGD steps of a tiny LoopedMoE: same losses and params with 'pallas' (routing kernel,
  permute, gmm, combine; interpret mode) and 'reference'."""
  results = _trained(TINY_MOE, ('pallas', 'reference'))
  (loss_p, par_p), (loss_r, par_r) = results['pallas'], results['reference']
  np.testing.assert_allclose(loss_p, loss_r, rtol=1e-5)
  assert loss_p[-1] < loss_p[0], 'training did not lower the loss'
  for a, b in zip(jax.tree.leaves(par_p), jax.tree.leaves(par_r)):
    assert_close(a, b, 1e-4, 'trained params')


@pytest.mark.parametrize('platform', ['cuda', 'tpu'])
def test_model_train_step_with_pallas_lowers_for_the_device(platform):
  """The whole pallas path of a train step (routing kernel, permute, fused gate/up gmm, down
  gmm, combine and their VJPs) lowers to compiled Triton / Mosaic kernels for the device."""
  from lowering import lower_for
  runtime = Runtime(platform=platform, interpret=False,
                    kernel_family={'cuda': 'gpu', 'tpu': 'tpu'}[platform],
                    run=TINY_RUN.run.replace(dispatch='pallas',
                                             attention_impl='chunked'))  # only the dispatch's kernels
  cfg = TINY_MOE.replace(d_model=128, expert_width=128, core_experts=8)
  tokens = jnp.zeros((2, 65), jnp.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  params = bench.init_params(LoopedMoE(cfg, runtime=TINY_RUN), batch['inputs'])
  text = lower_for(platform, bench.make_train_step(LoopedMoE(cfg, runtime=runtime)), params,
                   batch)
  marker = {'cuda': 'custom_call @__gpu$xla.gpu.triton(', 'tpu': 'custom_call @tpu_custom_call('}
  # forward: route, permute, gate/up gmm, down gmm, combine; backward: the cotangent's
  # permute (combine's VJP), two gmm + two tgmm, combine (permute's VJP)
  assert text.count(marker[platform]) == 11 == text.count('custom_call @'), text.count(
      marker[platform])


# GPU: compiled kernels (not interpreted) on a CUDA device ---------------------------------------

def _gpu_operands(dtype, m=1000, k=256, n=384, seed=0):
  sizes = [0, 300, 1, 0, 64, 500, 0, 100]  # sum 965 < m; empty groups; tile-crossing edges
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32).astype(DTYPES[dtype])
  rhs = (jnp.asarray(rng.normal(size=(8, k, n)), jnp.float32) / 16).astype(DTYPES[dtype])
  return lhs, rhs, jnp.asarray(sizes, jnp.int32)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize('target', ['gpu', 'mgpu', 'mgpu_ws'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_gpu_gmm_compiled_matches_ragged_dot(dtype, target):
  """Default tiles (K in several steps), rows past the sum, forward and both gradients vs
  ragged_dot (HIGHEST); the Mosaic GPU families run float32 through the Triton kernels
  (16-bit only), and transpose in the kernel (never under the CPU interpreter)."""
  with jax.default_device(cuda_devices()[0]):
    lhs, rhs, gs = _gpu_operands(dtype)
    loss = lambda f: lambda l, r: jnp.sum(jnp.sin(f(l, r).astype(jnp.float32)))
    kern = lambda l, r: pk.gmm(l, r, gs, target=target, interpret=False)
    ragged = lambda l, r: jax.lax.ragged_dot(l, r, gs, preferred_element_type=jnp.float32,
                                             precision=jax.lax.Precision.HIGHEST)
    out = jax.jit(kern)(lhs, rhs)
    # float32 dots run as tf32 on the tensor cores (Triton's default): ~3e-4 relative
    tol = {'float32': 2e-3, 'bfloat16': TOL['bfloat16']}[dtype]
    assert_close(out, jax.jit(ragged)(lhs, rhs), tol, 'gpu fwd')
    assert not np.any(np.asarray(out[965:], np.float32)), 'rows past the group-size sum'
    g_k = jax.jit(jax.grad(loss(kern), (0, 1)))(lhs, rhs)
    g_r = jax.jit(jax.grad(loss(ragged), (0, 1)))(lhs, rhs)
    for a, b, what in zip(g_k, g_r, ('d_lhs', 'd_rhs')):
      assert_close(a, b, tol * 5, f'gpu {what}')


@pytest.mark.gpu
@requires_gpu
def test_gpu_model_trained_with_pallas_matches_reference():
  """3 SGD steps of a tiny LoopedMoE on the GPU, compiled kernels: 'pallas' == 'reference'
  (float32 params; Triton's float32 dots run as tf32, hence 2e-3)."""
  with jax.default_device(cuda_devices()[0]):
    results = _trained(TINY_MOE.replace(d_model=64, expert_width=64), ('pallas', 'reference'))
  (loss_p, par_p), (loss_r, par_r) = results['pallas'], results['reference']
  np.testing.assert_allclose(loss_p, loss_r, rtol=2e-3)
  assert loss_p[-1] < loss_p[0], 'training did not lower the loss'
  for a, b in zip(jax.tree.leaves(par_p), jax.tree.leaves(par_r)):
    assert_close(a, b, 2e-3, 'trained params')


@pytest.mark.gpu
@requires_gpu
def test_gpu_route_compiled_matches_top_k():
  """Compiled routing kernel: experts == top_k, counts == bincount, positions == the inverse
  of a stable argsort, weights and their gradient == plain JAX (E 60: padded to 64 inside)."""
  with jax.default_device(cuda_devices()[0]):
    logits = jax.random.normal(jax.random.key(0), (4100, 60))
    got = pk.route(logits, 6, interpret=False)
    probs = jax.nn.softmax(logits)
    w_want, e_want = jax.lax.top_k(probs, 6)
    np.testing.assert_array_equal(got['experts_Tk'], e_want)
    np.testing.assert_array_equal(got['counts_E'],
                                  np.bincount(np.asarray(e_want).ravel(), minlength=60))
    order = np.argsort(np.asarray(e_want).ravel(), kind='stable')
    np.testing.assert_array_equal(np.asarray(got['positions_Tk']).ravel()[order], np.arange(4100 * 6))
    assert_close(got['weights_Tk'], w_want / w_want.sum(-1, keepdims=True), 1e-5, 'weights')
    loss = lambda f: lambda l: jnp.sum(jnp.sin(f(l)))
    g_k = jax.grad(loss(lambda l: pk.route(l, 6, interpret=False)['weights_Tk']))(logits)
    g_r = jax.grad(loss(lambda l: moe_route(l, 6, True)[1]))(logits)
    assert_close(g_k, g_r, 1e-4, 'route grad')


def test_kernels_benchmark_quick_reports_ratios(tmp_path):
  """`benchmark.py kernels --quick`: the CPU ratio keys are positive finite numbers and the
  JSON file holds them (no timing thresholds here: those are the benchmark's PASS/FAIL)."""
  from loopmoe_jax.bench import kernels  # noqa: F401  (registers 'kernels')
  import json
  import math
  path = tmp_path / 'kernels.json'
  res = bench.run('kernels', quick=True, json_path=str(path))
  for key in ('cpu_tiled_E64_over_E8', 'cpu_tiled_over_dense', 'cpu_tiled_fwd_bwd_E64_over_E8'):
    assert isinstance(res[key], float) and math.isfinite(res[key]) and res[key] > 0, key
  assert json.loads(path.read_text()) == res
