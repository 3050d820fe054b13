"""Routing kernel gradient and GPU/TPU lowering; TPU grouped matmul with K tiling.

- route's custom VJP == jax.grad of the plain-JAX router (softmax/sigmoid -> top_k on
  score + bias -> gather -> optional renorm), both scores, renorm on/off, bias on/off; the
  bias gets zero gradient. Forward on padded shapes (E and k not powers of two, several
  token blocks): experts == lax.top_k, counts == bincount, positions == stable argsort.
- route lowers for 'cuda' (a Triton call) and 'tpu' (a Mosaic call) at T=8192, E in {64, 60},
  k in {4, 6}, forward and gradient.
- gmm_tpu.gmm / tgmm with tile_k < K (pltpu.InterpretParams()) == per-group numpy and
  jax.lax.ragged_dot on empty groups, one group taking every row, ragged sizes, transpose_rhs,
  float32 and bf16; they lower for 'tpu' at M=65536, K=4096, N=1024 bf16, G=64.

Tolerances: float32 1e-5 of the reference's largest magnitude, bf16 inputs 2e-2.
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels as pk
from pallas_kernels import gmm_tpu
from lowering import lower_for
from reference import assert_close, gmm_numpy

TOL = {'float32': 1e-5, 'bfloat16': 2e-2}
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
CALL = {'cuda': '__gpu$xla.gpu.triton', 'tpu': 'tpu_custom_call'}


def route_reference(logits_TE, bias_E, k, renormalize, score):
  """The obvious plain-JAX router: (weights_Tk, scores_TE, experts_Tk)."""
  scores = jax.nn.softmax(logits_TE) if score == 'softmax' else jax.nn.sigmoid(logits_TE)
  _, experts = jax.lax.top_k(scores + bias_E, k)
  weights = jnp.take_along_axis(scores, experts, axis=1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=1, keepdims=True)
  return weights, scores, experts


# ------------------------------------------------------------------------------- route
@pytest.mark.parametrize('score', ['softmax', 'sigmoid'])
@pytest.mark.parametrize('renormalize', [True, False])
@pytest.mark.parametrize('bias', [False, True])
def test_route_vjp_matches_plain_jax(score, renormalize, bias):
  t, e, k = 37, 12, 3  # E padded to 16, k to 4, 3 token blocks of 16 (the last one padded)
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(t, e)), jnp.float32)
  bias_E = jnp.asarray(rng.normal(size=(e,)) * 0.3 if bias else np.zeros(e), jnp.float32)
  cot_w = jnp.asarray(rng.normal(size=(t, k)), jnp.float32)
  cot_s = jnp.asarray(rng.normal(size=(t, e)), jnp.float32)

  def kern(l, b):
    out = pk.route(l, k, renormalize=renormalize, bias_E=b if bias else None, score=score,
                   block_t=16)
    return out['weights_Tk'], out['scores_TE']

  ref = lambda l, b: route_reference(l, b, k, renormalize, score)[:2]

  @jax.jit
  def vjps(l, b):
    out_k, vjp_k = jax.vjp(kern, l, b)
    out_r, vjp_r = jax.vjp(ref, l, b)
    return out_k, out_r, vjp_k((cot_w, cot_s)), vjp_r((cot_w, cot_s)), vjp_k((cot_w, 0 * cot_s))

  out_k, out_r, (dl_k, db_k), (dl_r, _), (dl_wk, _) = vjps(logits, bias_E)
  what = f'{score} renorm={renormalize} bias={bias}'
  for a, b_, name in zip(out_k, out_r, ('weights', 'scores')):
    assert_close(a, b_, TOL['float32'], f'{what}: {name}')
  assert_close(dl_k, dl_r, TOL['float32'], f'{what}: d_logits')
  assert not np.any(np.asarray(db_k)), f'{what}: bias got a gradient'
  dl_wr = jax.vjp(ref, logits, bias_E)[1]((cot_w, 0 * cot_s))[0]
  assert_close(dl_wk, dl_wr, TOL['float32'], f'{what}: d_logits through weights only')


def test_route_grad_dtype_and_integer_outputs():
  """bf16 logits get a bf16 gradient; a loss through every output only differentiates the
  float ones (integer outputs carry no cotangent)."""
  logits = jax.random.normal(jax.random.key(1), (20, 8), jnp.bfloat16)

  def loss(l):
    out = pk.route(l, 2, block_t=16)
    ints = out['experts_Tk'] + out['positions_Tk'] + jnp.sum(out['counts_E'])
    return jnp.sum(out['weights_Tk'] * ints) + jnp.sum(out['scores_TE'][:, 0])

  def ref(l):
    w, s, experts = route_reference(l.astype(jnp.float32), 0.0, 2, True, 'softmax')
    out = pk.route(l, 2, block_t=16)
    ints = experts + out['positions_Tk'] + jnp.sum(out['counts_E'])
    return jnp.sum(w * ints) + jnp.sum(s[:, 0])

  got, want = jax.jit(jax.grad(loss))(logits), jax.jit(jax.grad(ref))(logits)
  assert got.dtype == jnp.bfloat16
  assert_close(got, want, TOL['bfloat16'], 'bf16 route grad')


@pytest.mark.parametrize('target', ['gpu', 'tpu'])
def test_route_padded_shapes_match_top_k_and_stable_sort(target):
  """E=20 (padded to 32), k=5 (padded to 8), 4 token blocks of 16: experts, weights, counts
  and positions as the references; padding never wins."""
  t, e, k = 61, 20, 5
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(t, e)), jnp.float32)
  bias_E = jnp.asarray(rng.normal(size=(e,)) * 0.2, jnp.float32)
  got = jax.jit(lambda l, b: pk.route(l, k, bias_E=b, score='sigmoid', block_t=16,
                                      target=target))(logits, bias_E)
  want_w, want_s, want_e = route_reference(logits, bias_E, k, True, 'sigmoid')
  np.testing.assert_array_equal(got['experts_Tk'], want_e)
  assert_close(got['weights_Tk'], want_w, TOL['float32'], f'{target} weights')
  assert_close(got['scores_TE'], want_s, TOL['float32'], f'{target} scores')
  flat = np.asarray(want_e).reshape(-1)
  np.testing.assert_array_equal(got['counts_E'], np.bincount(flat, minlength=e))
  order = np.argsort(flat, kind='stable')
  np.testing.assert_array_equal(np.asarray(got['positions_Tk']).reshape(-1), np.argsort(order))


@pytest.mark.parametrize('platform', ['cuda', 'tpu'])
def test_route_lowers_forward_and_grad(platform):
  """T=8192, E in {64, 60}, k in {4, 6}: one Triton (cuda) / Mosaic (tpu) call, forward and
  gradient (the backward is plain JAX)."""
  target = 'gpu' if platform == 'cuda' else 'tpu'
  for e, k in [(64, 4), (60, 6)]:
    logits = jax.ShapeDtypeStruct((8192, e), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((e,), jnp.float32)
    fwd = lambda l, b: pk.route(l, k, bias_E=b, target=target, interpret=False)

    def loss(l, b):
      out = fwd(l, b)
      return jnp.sum(jnp.sin(out['weights_Tk'])) + jnp.sum(out['scores_TE'] ** 2)

    for name, fn in (('fwd', fwd), ('grad', jax.grad(loss))):
      text = lower_for(platform, fn, logits, bias)
      assert text.count(CALL[platform]) == 1, f'{platform} E={e} k={k} {name}: no kernel call'


# ------------------------------------------------------------------ TPU gmm, K tiling
M, K, N, G, TILE_M, TILE_N, TILE_K = 48, 256, 16, 5, 16, 8, 128
SIZES = {
    'ragged_empty': [0, 13, 0, 22, 5],  # empty groups, sizes off the tile, sum 40 < M
    'one_takes_all': [0, 0, 48, 0, 0],
}


def _kernel_operands(dtype, seed):
  rng = np.random.default_rng(seed)
  cast = lambda a: jnp.asarray(a, jnp.float32).astype(DTYPES[dtype])
  return cast(rng.normal(size=(M, K))), cast(rng.normal(size=(G, K, N)) / 8), cast(
      rng.normal(size=(M, N)))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_gmm_tpu_k_tiled_matches_numpy_and_ragged_dot(dtype):
  lhs, rhs, grad = _kernel_operands(dtype, seed=3)
  as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  tol, interp = TOL[dtype], pltpu.InterpretParams()

  @jax.jit
  def kernels(gs):
    out = gmm_tpu.gmm(lhs, rhs, gs, tile_m=TILE_M, tile_n=TILE_N, tile_k=TILE_K,
                      out_dtype=jnp.float32, interpret=interp)
    # transpose_rhs: grad [M, N] @ rhs[g].T, the contraction (N=16) tiled by 8.
    out_t = gmm_tpu.gmm(grad, rhs, gs, tile_m=TILE_M, tile_n=64, tile_k=8,
                        transpose_rhs=True, out_dtype=jnp.float32, interpret=interp)
    # tgmm: output blocks (tile_k, tile_n); empty groups are left to ops.py.
    got = gmm_tpu.tgmm(lhs, grad, gs, tile_m=TILE_M, tile_n=TILE_N, tile_k=TILE_K,
                       interpret=interp)
    return out, out_t, got

  for case, sizes in SIZES.items():
    gs = jnp.asarray(sizes, jnp.int32)
    total, what = sum(sizes), f'{dtype} {case}'
    out, out_t, got = kernels(gs)
    want = gmm_numpy(as64(lhs), as64(rhs), sizes)
    assert_close(out[:total], want[:total], tol, f'{what}: gmm vs numpy')
    ragged = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    assert_close(out[:total], ragged[:total], tol, f'{what}: gmm vs ragged_dot')
    want_t = gmm_numpy(as64(grad), np.swapaxes(as64(rhs), 1, 2), sizes)
    assert_close(out_t[:total], want_t[:total], tol, f'{what}: gmm transpose_rhs vs numpy')
    ends = np.cumsum(sizes)
    for g, (s, end) in enumerate(zip(sizes, ends)):
      if s:
        want_g = as64(lhs)[end - s:end].T @ as64(grad)[end - s:end]
        assert_close(got[g], want_g, tol, f'{what}: tgmm group {g}')


def test_gmm_tpu_tile_k_not_dividing_falls_back_to_whole_k():
  lhs, rhs, _ = _kernel_operands('float32', seed=4)
  gs = jnp.asarray(SIZES['ragged_empty'], jnp.int32)
  kw = dict(tile_m=TILE_M, tile_n=TILE_N, interpret=pltpu.InterpretParams())
  run = jax.jit(lambda tile_k: gmm_tpu.gmm(lhs, rhs, gs, tile_k=tile_k, **kw), static_argnums=0)
  whole, odd = run(None), run(96)  # 96 does not divide 256
  total = sum(SIZES['ragged_empty'])
  assert_close(odd[:total], whole[:total], 0.0, 'tile_k=96 vs whole K')


def test_gmm_tpu_lowers_at_large_k():
  """M=65536, K=4096, N=1024 bf16, G=64 with the default tiles (tile_k 512): gmm,
  gmm transpose_rhs and tgmm each lower to one Mosaic call."""
  m, k, n, g = 65536, 4096, 1024, 64
  bf = jnp.bfloat16
  sds = jax.ShapeDtypeStruct
  gs = sds((g,), jnp.int32)
  cases = {
      'gmm': (lambda l, r, s: gmm_tpu.gmm(l, r, s), (sds((m, k), bf), sds((g, k, n), bf))),
      'gmm_t': (lambda l, r, s: gmm_tpu.gmm(l, r, s, transpose_rhs=True),
                (sds((m, n), bf), sds((g, k, n), bf))),
      'tgmm': (lambda l, d, s: gmm_tpu.tgmm(l, d, s), (sds((m, k), bf), sds((m, n), bf))),
  }
  for name, (fn, args) in cases.items():
    text = lower_for('tpu', fn, *args, gs)
    assert text.count(CALL['tpu']) == 1, f'{name}: no Mosaic call'
