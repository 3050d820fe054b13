"""pallas_kernels.permute / combine kernels against numpy, on CPU in interpret mode; lowering.

- Both families ('gpu' Triton-style under interpret=True, 'tpu' Mosaic DMA gathers under
  pltpu.InterpretParams()) == a float64 numpy reference: permute (exact), combine, permute's
  VJP (sum of a token's k rows), combine's VJP in out (weighted permute of g) and in weights
  (<g[t], out[positions[t, j]]>). Positions and weights come from a real pallas_kernels.route
  call. Ragged shapes: T not a multiple of the row block (TPU blocks shrunk to 32 rows so
  several blocks and a partial last one run), k = 1, 2, 3, D = 24 and 40 (not powers of two:
  the GPU path pads D).
- Invariant: combine(permute(x)) == x * sum_j weights[t, j].
- libtpu compiles them, forward and gradient, bf16 and float32, at 16 and 4,096 rows.
- permute / combine (forward and gradient) lower for 'cuda' (Triton calls, not Mosaic GPU)
  and 'tpu' (Mosaic calls) at T=4096, k=4, D in {1024, 24}, bf16 and float32: four kernel
  calls per gradient (permute, combine, and one gather in each backward).

Tolerances: float32 1e-6 of the reference's largest magnitude, bf16 2e-2 (the reference is
computed from the bf16-rounded inputs; sums are float32 in every path).
"""
import importlib

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from lowering import lower_for
from reference import as64, assert_close, cuda_devices, requires_gpu
from test_targets import needs
from loopmoe_jax import targets
from loopmoe_jax.train import compile_cache

P = importlib.import_module('pallas_kernels.permute')
TOL = {'float32': 1e-6, 'bfloat16': 2e-2}
CALL = {'cuda': '__gpu$xla.gpu.triton', 'tpu': 'tpu_custom_call'}
CASES = {  # name: (T, k, D, E)
    'k2_d24_ragged': (45, 2, 24, 8),
    'k1_d40': (37, 1, 40, 4),
    'k3_d128': (21, 3, 128, 6),
}


def routed(t, k, e, seed):
  """positions_Tk (a permutation of range(T*k)) and weights_Tk from the routing kernel."""
  logits = jax.random.normal(jax.random.key(seed), (t, e), jnp.float32)
  got = pk.route(logits, k, block_t=16)
  pos = np.asarray(got['positions_Tk'])
  np.testing.assert_array_equal(np.sort(pos.reshape(-1)), np.arange(t * k))
  return got['positions_Tk'], got['weights_Tk']


def references(x, out, w, g, pos):
  """numpy float64: permute, combine, d_x (permute), d_out and d_w (combine)."""
  x, out, w, g, pos = as64(x), as64(out), as64(w), as64(g), np.asarray(pos)
  t, k = pos.shape
  x_M = np.zeros((t * k, x.shape[1]))
  x_M[pos.reshape(-1)] = np.repeat(x, k, axis=0)
  d_out = np.zeros_like(out)
  d_out[pos.reshape(-1)] = (w[:, :, None] * g[:, None, :]).reshape(t * k, -1)
  return dict(permute=x_M, combine=np.einsum('tkd,tk->td', out[pos], w),
              d_x=out[pos].sum(axis=1), d_out=d_out, d_w=np.einsum('td,tkd->tk', g, out[pos]))


# TPU interpret mode is slow: bf16 there on one case only.
RUNS = [(target, dtype, case) for target in ('gpu', 'tpu') for dtype in ('float32', 'bfloat16')
        for case in CASES if not (target == 'tpu' and dtype == 'bfloat16' and case != 'k2_d24_ragged')]


@pytest.mark.parametrize('target,dtype,case', RUNS)
def test_permute_combine_and_vjps_match_numpy(target, dtype, case, monkeypatch):
  monkeypatch.setattr(P, 'TPU_MAX_ROWS', 32)  # several TPU row blocks, the last one partial
  _check(target, dtype, *CASES[case], what=case)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_gpu_compiled_permute_combine_match_numpy(dtype):
  """Compiled Triton kernels (no interpreter) on the GPU, small ragged and MoE-sized."""
  with jax.default_device(cuda_devices()[0]):
    for t, k, d, e in list(CASES.values()) + [(4096, 4, 1024, 64)]:
      _check('gpu', dtype, t, k, d, e, what=f'gpu T{t} k{k} D{d}')


def _check(target, dtype, t, k, d, e, what):
  pos, w = routed(t, k, e, seed=t)
  keys = jax.random.split(jax.random.key(d), 3)
  x = jax.random.normal(keys[0], (t, d)).astype(dtype)
  out = jax.random.normal(keys[1], (t * k, d)).astype(dtype)
  g = jax.random.normal(keys[2], (t, d)).astype(dtype)

  @jax.jit
  def run(x, out, w, g, pos):
    x_M, vjp_p = jax.vjp(lambda x: pk.permute(x, pos, target=target), x)
    y, vjp_c = jax.vjp(lambda o, w: pk.combine(o, pos, w, target=target), out, w)
    return dict(permute=x_M, combine=y, d_x=vjp_p(out)[0], **dict(zip(('d_out', 'd_w'), vjp_c(g))))

  got = run(x, out, w, g, pos)
  want = references(x, out, w, g, pos)
  for name in ('permute', 'combine', 'd_x', 'd_out'):
    assert got[name].dtype == x.dtype, f'{name} dtype {got[name].dtype}'
  assert got['d_w'].dtype == w.dtype
  np.testing.assert_array_equal(as64(got['permute']), want['permute'])  # a copy: exact
  for name in ('combine', 'd_x', 'd_out', 'd_w'):
    assert_close(got[name], want[name], TOL[dtype], f'{target} {dtype} {what} {name}')


@pytest.mark.parametrize('target', ['gpu', 'tpu'])
def test_combine_of_permute_is_weight_sum(target):
  t, k, d, e = 29, 4, 16, 8
  pos, w = routed(t, k, e, seed=7)
  x = jax.random.normal(jax.random.key(8), (t, d), jnp.float32)
  y = jax.jit(lambda x: pk.combine(pk.permute(x, pos, target=target), pos, w, target=target))(x)
  assert_close(y, as64(x) * as64(w).sum(axis=1, keepdims=True), TOL['float32'],
               f'{target} combine(permute(x))')


@pytest.mark.parametrize('d', [1024, 24])
@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('platform,target', [('cuda', 'gpu'), ('tpu', 'tpu')])
def test_lowers_forward_and_grad(platform, target, dtype, d):
  t, k = 4096, 4
  kw = dict(target=target, interpret=False)

  def loss(x_TD, out_MD, weights_Tk, positions_Tk):
    x_M = pk.permute(x_TD, positions_Tk, **kw)
    y = pk.combine(out_MD * x_M, positions_Tk, weights_Tk, **kw)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  args = (jax.ShapeDtypeStruct((t, d), dtype), jax.ShapeDtypeStruct((t * k, d), dtype),
          jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32))
  forward = lower_for(platform, loss, *args)
  grad = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2)), *args)
  assert forward.count(CALL[platform]) == 2, 'permute + combine kernels'
  assert grad.count(CALL[platform]) == 4, 'forward kernels + one gather per backward'
  if platform == 'cuda':
    assert 'mosaic_gpu' not in grad, 'GPU kernels must lower through Triton'


@needs('tpu')
@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
def test_libtpu_compiles_forward_and_grad(dtype):
  """libtpu compiles the Mosaic calls (lowering only checks Mosaic's IR): at a decode step's
  16 rows and a train step's 4,096, D 64 and 24. A 16-bit row DMA'd alone into a VMEM block
  is refused ('Offsets along tiled dimensions must be aligned to tiles'), so such rows move
  as 32-bit words or float32 (permute.py)."""
  device = targets.get('v5p:2x2x1').devices()[0]
  shard = jax.sharding.SingleDeviceSharding(device)
  kw = dict(target='tpu', interpret=False)

  def loss(x_TD, out_MD, weights_Tk, positions_Tk):
    y = pk.combine(out_MD * pk.permute(x_TD, positions_Tk, **kw), positions_Tk, weights_Tk, **kw)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  for t, d in ((16, 64), (4096, 24)):
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=shard)
    args = (spec((t, d), dtype), spec((2 * t, d), dtype), spec((t, 2), jnp.float32),
            spec((t, 2), jnp.int32))
    with compile_cache.off():
      compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    assert compiled.as_text().count('tpu_custom_call') == 4


def test_bad_operands_raise_naming_them():
  x, pos, w = jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
  cases = [(lambda: pk.permute(x[:3], pos), r'x must be 2-D with 4 rows'),
           (lambda: pk.permute(x, pos.astype(jnp.float32)), 'positions must be a'),
           (lambda: pk.combine(jnp.zeros((7, 8)), pos, w), r'out must be 2-D with 8 rows'),
           (lambda: pk.combine(jnp.zeros((8, 8)), pos, w[:, :1]), 'weights shape'),
           (lambda: pk.route(jnp.zeros((4, 6)), 2, bias_E=jnp.zeros(5)), r'bias_E shape \(5,\)'),
           (lambda: pk.route(jnp.zeros((4, 6)), 7), r'top_k=7')]
  for fn, match in cases:
    with pytest.raises(ValueError, match=match):
      fn()
