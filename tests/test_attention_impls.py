"""Attention implementations (run.attention_impl), the chunked loss and the FLOP counter:
each against the plain computation it replaces."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax import attention_impls, dry_run
from loopmoe_jax import hlo as hlo_lib
from loopmoe_jax.attention import attend
from loopmoe_jax.attention_impls import chunked_attend, resolve
from loopmoe_jax.config import ModelConfig, RunConfig
from loopmoe_jax.layers import rope
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.objective import head_nll, lm_loss, loss_fn
from loopmoe_jax.runtime import HERE, Runtime
from reference import cuda_devices, requires_gpu


def _qkv(b, t, h, g, k, seed=0):
  rng = np.random.default_rng(seed)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  q = rope(jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32), pos, 1e4)
  kk = rope(jnp.asarray(rng.standard_normal((b, t, g, k)), jnp.float32), pos, 1e4)
  v = jnp.asarray(rng.standard_normal((b, t, g, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32)  # a cotangent
  return q, kk, v, pos, w


def _rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize('t,block', [(37, 16), (64, 16), (50, 512), (100, 32)])
def test_chunked_equals_xla_outputs_and_gradients(t, block):
  """Causal GQA (4 query heads on 2 KV heads) with RoPE, lengths that are and are not a
  multiple of the block, float32: outputs and gradients to 1e-5 relative."""
  q, k, v, pos, w = _qkv(2, t, 4, 2, 8)
  ref = lambda q, k, v: jnp.sum(attend(q, k, v, pos, pos) * w)
  got = lambda q, k, v: jnp.sum(chunked_attend(q, k, v, pos, pos, block) * w)
  assert _rel(chunked_attend(q, k, v, pos, pos, block), attend(q, k, v, pos, pos)) < 1e-5
  for a, b in zip(jax.grad(got, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
    assert _rel(a, b) < 1e-5


def test_chunked_skips_the_block_pairs_no_query_sees():
  """Block pairs whose keys all follow their queries are not computed, forward or backward:
  with NaN keys and values from position 32 on, the first two query blocks of 16 and their
  query gradients equal the attention of the first 32 tokens alone, finite (computing those
  pairs, as skip=False does, multiplies 0 by NaN)."""
  q, k, v, pos, w = _qkv(2, 64, 4, 2, 8, seed=3)
  k, v = k.at[:, 32:].set(jnp.nan), v.at[:, 32:].set(jnp.nan)
  first = lambda x: x[:, :32]
  p32 = first(pos)
  ref = lambda q: jnp.sum(attend(q, first(k), first(v), p32, p32) * first(w))
  want_out = attend(first(q), first(k), first(v), p32, p32)
  want_dq = jax.grad(ref)(first(q))
  for skip in (True, False):
    loss = lambda q, skip=skip: jnp.sum(first(chunked_attend(q, k, v, pos, pos, 16, skip))
                                        * first(w))
    out, dq = first(chunked_attend(q, k, v, pos, pos, 16, skip)), first(jax.grad(loss)(q))
    finite = np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dq)).all()
    assert finite == skip
    if skip:
      assert _rel(out, want_out) < 1e-5 and _rel(dq, want_dq) < 1e-5


def test_chunked_follows_positions_not_indices():
  """The mask is by position: a query at position p sees exactly keys at positions <= p, so
  reversing the keys' order (positions with them) changes nothing."""
  q, k, v, pos, _ = _qkv(1, 20, 2, 2, 8, seed=1)
  rev = lambda x: x[:, ::-1]
  out = chunked_attend(q, rev(k), rev(v), pos, rev(pos), 8)
  np.testing.assert_allclose(out, attend(q, k, v, pos, pos), rtol=1e-5, atol=1e-6)


def test_splash_kernel_matches_xla_in_the_interpreter():
  """JAX's Pallas TPU splash kernel, run in Pallas's interpreter here: outputs and gradients
  equal the einsum's (a length of 100 is padded to 128 inside)."""
  q, k, v, pos, w = _qkv(1, 100, 4, 2, 64, seed=2)
  ref = lambda q, k, v: jnp.sum(attend(q, k, v, pos, pos) * w)
  splash = lambda q, k, v: attention_impls._splash(q, k, v, interpret=True)  # pylint: disable=protected-access
  got = lambda q, k, v: jnp.sum(splash(q, k, v) * w)
  assert _rel(splash(q, k, v), attend(q, k, v, pos, pos)) < 1e-5
  for a, b in zip(jax.grad(got, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
    assert _rel(a, b) < 1e-5


@pytest.mark.parametrize('platform,impl,call', [('tpu', 'splash', 'tpu_custom_call'),
                                                ('cuda', 'cudnn', '__cudnn$fmha')])
def test_fused_attention_lowers_for_its_platform(platform, impl, call):
  """The model's train step built for TPU / NVIDIA GPU from this CPU: with attention_impl
  'auto' (bfloat16) every layer's attention, forward and backward, is the platform's fused
  kernel, and no [B, H, T, T] score array is left in the program."""
  cfg = ModelConfig(vocab_size=64, d_model=128, num_heads=2, head_dim=64, expert_width=32,
                    prelude_layers=1, core_layers=1, coda_layers=0, num_loops=2,
                    dtype='bfloat16')
  model = LoopedMoE(cfg, runtime=Runtime.for_platform(platform).with_run(dispatch='xla'))
  toks = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), toks))['params'])
  batch = {'inputs': toks, 'targets': toks}
  assert resolve('auto', cfg.dtype, model.runtime.target_platform) == impl
  grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, model, b)[0]))
  text = grad.trace(params, batch).lower(lowering_platforms=(platform,)).as_text()
  calls = re.findall(r'custom_call @([\w$]+)', text)
  assert sum(c.startswith(call) for c in calls) >= 2 * 2  # 2 attention layers x fwd and bwd
  assert not re.search(r'tensor<2x2x(1x)?256x256xf32>', text)  # the einsum's scores


def test_attention_impl_errors_name_the_key_and_platform():
  with pytest.raises(ValueError, match=r"run.attention_impl='cudnn'.*platform 'cpu'"):
    resolve('cudnn', 'bfloat16', 'cpu')
  with pytest.raises(ValueError, match=r"run.attention_impl='splash'.*platform 'gpu'"):
    resolve('splash', 'bfloat16', 'gpu')
  with pytest.raises(ValueError, match='16-bit model.dtype'):
    resolve('cudnn', 'float32', 'gpu')
  assert resolve('auto', 'float32', 'gpu') == 'chunked'  # never a kernel that cannot run
  assert resolve('auto', 'bfloat16', 'cpu') == 'chunked'
  # cuDNN's head dims: multiples of 8 up to 128; auto falls back, asking for it is an error
  assert resolve('auto', 'bfloat16', 'gpu', 64) == 'cudnn'
  for head in (60, 256):
    assert resolve('auto', 'bfloat16', 'gpu', head) == 'chunked'
    with pytest.raises(ValueError, match=f'model.head_dim: {head}'):
      resolve('cudnn', 'bfloat16', 'gpu', head)
  for field, value in (('attention_impl', 'flash'), ('remat', 'most'), ('loss_chunk', -1),
                       ('attention_block', 0)):
    with pytest.raises(ValueError, match=f'run.{field}'):
      RunConfig(**{field: value})
  model = LoopedMoE(ModelConfig(dtype='bfloat16'), runtime=Runtime.of(attention_impl='cudnn'))
  with pytest.raises(ValueError, match="attention_impl='cudnn'"):
    model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize('chunk', [5, 8, 23, 40])  # 40 > V: the whole-logits path
def test_chunked_loss_equals_the_plain_loss_and_gradient(chunk):
  rng = np.random.default_rng(3)
  b, t, d, v = 2, 16, 8, 24
  h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
  tgt = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  mask = jnp.asarray(rng.random((b, t)) < 0.7, jnp.float32)
  plain = lambda h, w: lm_loss(h @ w, tgt, mask)
  chunked = lambda h, w: (lambda s, c: s / c)(*head_nll(h, w, tgt, mask, chunk))
  assert float(chunked(h, w)) == pytest.approx(float(plain(h, w)), rel=1e-6)
  for a, e in zip(jax.grad(chunked, (0, 1))(h, w), jax.grad(plain, (0, 1))(h, w)):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


def _buffers_of_shape(hlo: str, dims) -> int:
  """How many float32 arrays in a compiled program hold `dims` elements per their shape (a
  [B, T, V] or [B*T, V] logits buffer, whatever its layout)."""
  size = int(np.prod(dims))
  return sum(int(np.prod([int(x) for x in s.split(',') if x] or [1])) == size
             for s in re.findall(r'\bf32\[([\d,]*)\]', hlo))


def test_chunked_loss_train_step_holds_no_whole_logits():
  """The named check: the compiled train step's HLO (after XLA's optimisations) has no float32
  array of B x T x V elements with run.loss_chunk set, and has one without it (so the check
  can fail)."""
  cfg = ModelConfig(vocab_size=96, d_model=16, num_heads=2, expert_width=16, prelude_layers=0,
                    core_layers=1, coda_layers=0, num_loops=1, core_experts=2, top_k=1)
  toks = jax.ShapeDtypeStruct((2, 24), jnp.int32)
  batch = {'inputs': toks, 'targets': toks}
  counts = {}
  for chunk in (0, 8):
    model = LoopedMoE(cfg, runtime=Runtime.of(loss_chunk=chunk))
    params = nn.unbox(jax.eval_shape(lambda m=model: m.init(jax.random.key(0), toks))['params'])
    step = jax.jit(jax.grad(lambda p, b, m=model: loss_fn(p, m, b)[0]))
    counts[chunk] = _buffers_of_shape(step.lower(params, batch).compile().as_text(), (2, 24, 96))
  assert counts[0] > 0 and counts[8] == 0, counts


def test_dot_flops_counts_loop_bodies_by_trip_count():
  """hlo_lib.dot_flops against the obvious count: 10 passes of a [64, 32] x [32, 48] matmul
  plus one [64, 48] x [48, 16] (XLA's own cost analysis counts the loop body once)."""
  w1, w2 = jnp.ones((32, 32)), jnp.ones((48, 16))

  def f(x, w1, w2):
    x = jax.lax.scan(lambda c, _: (c @ w1, None), x, None, length=10)[0]
    return jnp.pad(x, ((0, 0), (0, 16))) @ w2
  x = jnp.ones((64, 32))
  hlo, _ = dry_run.partitioned_compile(jax.jit(f).lower(x, w1, w2))
  assert hlo_lib.dot_flops(hlo) == 10 * 2 * 64 * 32 * 32 + 2 * 64 * 48 * 16


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize('impl', ['cudnn', 'chunked'])
def test_gpu_attention_matches_xla(impl):
  """On an NVIDIA GPU: cuDNN's fused attention (bfloat16) and the chunked path against the
  einsum on the same inputs, outputs and gradients (bfloat16: 2e-2 relative; chunked in
  float32: 1e-4, the GPU's float32 dots)."""
  with jax.default_device(cuda_devices()[0]):
    q, k, v, pos, w = _qkv(2, 1000, 8, 2, 64, seed=4)
    dt = jnp.bfloat16 if impl == 'cudnn' else jnp.float32
    q, k, v = (x.astype(dt) for x in (q, k, v))
    ref = lambda q, k, v: jnp.sum(attend(q, k, v, pos, pos).astype(jnp.float32) * w)
    got = lambda q, k, v: jnp.sum(
        attention_impls.attend_with(impl, q, k, v, pos, pos, 256, runtime=HERE)
        .astype(jnp.float32) * w)
    tol = 2e-2 if impl == 'cudnn' else 1e-4
    f32 = lambda x: x.astype(jnp.float32)
    fused = lambda *a: attention_impls.attend_with(impl, *a, pos, pos, 256, runtime=HERE)
    assert _rel(f32(jax.jit(fused)(q, k, v)), f32(attend(q, k, v, pos, pos))) < tol
    for a, b in zip(jax.jit(jax.grad(got, (0, 1, 2)))(q, k, v),
                    jax.jit(jax.grad(ref, (0, 1, 2)))(q, k, v)):
      assert _rel(f32(a), f32(b)) < tol
