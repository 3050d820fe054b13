"""The GPU decode kernel (pallas_kernels/decode_attention_gpu.py), interpreted on this CPU.

- decode_attention == the XLA products over the written slot (attention.attend_cached), for
  one and three new tokens, with and without a pass axis, float32 and bf16, rows at
  different positions over several chunks of the slot axis (a row in the first block only,
  one across a chunk's edge, one at the cache's end); slots past a row's last position,
  poisoned with NaN, never enter its result (XLA's products take NaN from them).
- A looped model built for a GPU (Runtime(platform='gpu', interpret=True): the kernel runs
  in every decode step) gives the XLA decode's logits and cache, and its batched, plain and
  loop-draft greedy tokens, and on a data x tensor mesh its logits (slow).
On a CUDA device (scripts/gpu_check.sh, marked gpu): the compiled kernel and a model's decode
with it against XLA's. The compiled GPU program (compile-only, here):
tests/test_targets.py::test_a_gpu_decode_step_reads_its_cache_in_the_pallas_kernel.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_cfg, rt
from reference import cuda_devices, requires_gpu
from loopmoe_jax import attention
from loopmoe_jax.attention import attend_cached
from loopmoe_jax.batched import generate_batch
from loopmoe_jax.config.mesh import MeshConfig
from loopmoe_jax.decode import decode_step, generate, init_cache
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.runtime import Runtime
from loopmoe_jax.sharding import make_mesh
from loopmoe_jax.speculative import generate_speculative
from pallas_kernels import decode_attention_gpu as gk

GPU = Runtime(platform='gpu', interpret=True).with_run(dispatch='tiled')  # the MoE: XLA's
XLA = rt(attention_impl='xla')


@pytest.mark.parametrize('tokens', [1, 3])
@pytest.mark.parametrize('passes', [0, 3], ids=['no pass axis', 'per pass'])
@pytest.mark.parametrize('kd,dtype', [(16, 'float32'), (64, 'bfloat16')])
def test_kernel_attends_as_the_xla_products_and_reads_no_slot_past_a_row(tokens, passes, kd,
                                                                         dtype):
  b, g, heads, slots = 4, 2, 4, 1152  # 3 chunks of 512 slots, the last one partial
  rng = np.random.default_rng(tokens + passes + kd)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.dtype(dtype))
  lead = (passes,) if passes else ()
  kc, vc, q = normal(*lead, b, g, slots, kd), normal(*lead, b, g, slots, kd), normal(
      b, tokens, heads, kd)
  start = jnp.asarray([0, 510, 700, slots - tokens], jnp.int32)
  after = jnp.arange(slots)[:, None] > (start + tokens - 1)[:, None, None, None]  # [B,1,S,1]
  poisoned = lambda c: jnp.where(after, jnp.nan, c)
  p = jnp.asarray(1, jnp.int32) if passes else None
  slot = (lambda x: x[1]) if passes else (lambda x: x)
  pos, k_pos = start[:, None] + jnp.arange(tokens), jnp.broadcast_to(jnp.arange(slots),
                                                                      (b, slots))
  ref = attend_cached(q, slot(kc), slot(vc), pos, k_pos).astype(jnp.float32)
  out = gk.decode_attention(attention.group_queries(q, g), poisoned(kc), poisoned(vc), start,
                            p, tokens=tokens, interpret=True)
  out = attention.ungroup_queries(out, tokens).astype(jnp.float32)
  tol = 1e-5 if dtype == 'float32' else 2e-2
  np.testing.assert_allclose(out, ref, atol=tol * float(jnp.abs(ref).max()))
  xla = attend_cached(q, slot(poisoned(kc)), slot(poisoned(vc)), pos, k_pos)
  assert not jnp.isfinite(xla[:3]).all()  # the XLA products read every slot


def test_supports_heads_of_powers_of_two_slots_of_whole_blocks_and_short_chunks():
  assert gk.supports(4096, 128, 4) and gk.supports(4096, 16, 4) and gk.supports(96, 64, 2)
  assert not gk.supports(4096, 88, 4)          # SMELT's looped width: XLA's products
  assert not gk.supports(4096, 8, 4) and not gk.supports(4096, 512, 2)
  assert not gk.supports(100, 64, 4)           # no block of 16 or more divides 100 slots
  assert gk.supports(4096, 64, 2, tokens=16, per_group=8)       # 128 query rows a group
  assert not gk.supports(4096, 64, 2, tokens=17, per_group=8)   # a prefill: XLA's
  assert [gk.padded_rows(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
  assert [gk.key_block(n, 64, 2) for n in (4096, 96, 48, 100)] == [64, 32, 16, 0]
  # the queries and two stages of key and value tiles within shared memory (float32 heads of
  # 128 on an RTX 4090 asked 110,592 bytes of its 101,376 at 64 slots a block; 128 query rows
  # of heads of 256 asked 122,880 in bf16, 188,416 of an A100's 166,912 in float32)
  assert [gk.key_block(4096, 128, n) for n in (2, 4)] == [64, 32]
  assert gk.key_block(4096, 256, 4) == 16 and gk.key_block(48, 256, 4) == 16
  assert gk.supports(4096, 256, 2, tokens=8, per_group=4)
  assert not gk.supports(4096, 256, 2, tokens=16, per_group=8)
  assert not gk.supports(4096, 256, 4, tokens=16, per_group=8)


def test_a_gpu_that_runs_no_triton_keeps_the_xla_products():
  """Below sm_80 (a named target's capability) or where the Pallas check failed, a decode
  step built for a GPU takes XLA's products, as the MoE takes XLA's dispatch."""
  cfg = make_cfg(head_dim=16, num_kv_heads=2)
  assert attention.decode_kernels(GPU, cfg) == 'gpu'
  assert attention.decode_kernels(GPU.with_tiles({'gmm': {'cc': (8, 0)}}), cfg) == 'gpu'
  assert attention.decode_kernels(GPU.with_tiles({'gmm': {'cc': (7, 5)}}), cfg) is None
  assert attention.decode_kernels(GPU.replace(pallas_check='Triton needs 8.0+'), cfg) is None


def _looped(head_dim=16, loops=2):
  cfg = make_cfg(head_dim=head_dim, num_kv_heads=2, injection='add', core_layers=1,
                 num_loops=loops)
  v = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  return cfg, v['params']


def test_a_model_built_for_a_gpu_decodes_in_the_kernel_as_the_xla_decode():
  cfg, params = _looped()
  cache = init_cache(cfg, 2, 128)
  layer = cache['core']['body']['layer_0']['attention']['k']
  assert attention.decode_kernel_runs(GPU, cfg, layer, 1) == 'gpu'
  assert attention.decode_kernel_runs(GPU.with_run(attention_impl='xla'), cfg, layer, 1) is None
  assert attention.decode_kernel_runs(XLA, cfg, layer, 1) is None  # the CPU: XLA's products
  toks = jnp.asarray([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], jnp.int32)
  step = {name: jax.jit(lambda p, c, t, r=r: decode_step(cfg, p, c, t, runtime=r))
          for name, r in (('gpu', GPU), ('xla', XLA))}
  caches = {name: init_cache(cfg, 2, 128) for name in step}
  for chunk in (toks, toks[:, 1:3], toks[:, 4:]):  # a prefill, two tokens, one
    out = {}
    for name in step:
      out[name], caches[name] = step[name](params, caches[name], chunk)
    np.testing.assert_allclose(out['gpu'], out['xla'], atol=2e-5)
  for a, b in zip(jax.tree.leaves(caches['gpu']), jax.tree.leaves(caches['xla'])):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_generation_built_for_a_gpu_gives_the_xla_decodes_tokens():
  """Batched greedy rows, plain greedy and the loop-draft (its pass ranges read pass d..L-1's
  slots in the kernel), each with the kernel, equal the XLA decode's greedy tokens."""
  cfg, params = _looped(loops=3)
  prompts = [[3, 5, 7], [2, 4, 6, 8, 10, 12], [9]]
  batch = lambda r: generate_batch(cfg, params, prompts, 5, jax.random.key(0), batch_size=3,
                                   runtime=r)
  assert batch(GPU) == batch(XLA)
  prompt = jnp.asarray([[3, 5, 7, 9]], jnp.int32)
  plain = generate(cfg, params, prompt, 6, jax.random.key(0), runtime=XLA)
  np.testing.assert_array_equal(generate(cfg, params, prompt, 6, jax.random.key(0),
                                         runtime=GPU), plain)
  spec = generate_speculative(cfg, params, prompt, 6, jax.random.key(0), draft_loops=1,
                              lookahead=2, runtime=GPU)
  np.testing.assert_array_equal(spec.tokens, plain)


@pytest.mark.slow
def test_on_a_mesh_the_gpu_kernel_runs_per_shard_and_equals_the_xla_decode():
  """Rows over `data`, the two head groups over `tensor`: decode_attend_gpu's shard_map."""
  cfg, params = _looped()
  toks = jnp.asarray(np.arange(20).reshape(4, 5) % cfg.vocab_size, jnp.int32)
  ref, _ = decode_step(cfg, params, init_cache(cfg, 4, 128), toks, runtime=XLA)
  with jax.set_mesh(make_mesh(MeshConfig(data=4, tensor=2))):
    out, _ = jax.jit(lambda p, c, t: decode_step(cfg, p, c, t, runtime=GPU))(
        params, init_cache(cfg, 4, 128), toks)
  np.testing.assert_allclose(out, ref, atol=2e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_on_a_gpu_the_compiled_kernel_attends_as_the_xla_products(dtype):
  """On an NVIDIA GPU (scripts/gpu_check.sh): the compiled Triton kernel against the XLA
  products, 3 tokens over a per-pass cache of 4,096 slots (tolerance: the GPU's float32 dots
  may run in TF32), and a model's decode steps with the GPU's default runtime (the kernel)
  against run.attention_impl='xla'."""
  with jax.default_device(cuda_devices()[0]):
    b, g, heads, slots, kd, tokens = 4, 2, 8, 4096, 64, 3
    rng = np.random.default_rng(7)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.dtype(dtype))
    kc, vc, q = normal(2, b, g, slots, kd), normal(2, b, g, slots, kd), normal(b, tokens, heads,
                                                                               kd)
    start = jnp.asarray([0, 511, 2000, slots - tokens], jnp.int32)
    ref = attend_cached(q, kc[1], vc[1], start[:, None] + jnp.arange(tokens),
                        jnp.broadcast_to(jnp.arange(slots), (b, slots))).astype(jnp.float32)
    out = jax.jit(lambda *a: gk.decode_attention(*a, tokens=tokens))(
        attention.group_queries(q, g), kc, vc, start, jnp.int32(1))
    out = attention.ungroup_queries(out, tokens).astype(jnp.float32)
    np.testing.assert_allclose(out, ref, atol=2e-2 * float(jnp.abs(ref).max()))
    cfg, params = _looped(head_dim=64)
    cfg = cfg.replace(dtype=dtype)
    toks = jnp.asarray([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], jnp.int32)
    here = Runtime().with_run(dispatch='tiled')  # the MoE in XLA: the attention is tested
    runs = {'kernel': here, 'xla': here.with_run(attention_impl='xla')}
    assert attention.decode_kernels(runs['kernel'], cfg) == 'gpu'
    logits = {}
    for name, runtime in runs.items():
      step = jax.jit(lambda p, c, t, r=runtime: decode_step(cfg, p, c, t, runtime=r))
      first, cache = step(params, init_cache(cfg, 2, 256), toks)
      logits[name] = step(params, cache, toks[:, :1])[0].astype(jnp.float32)
    np.testing.assert_allclose(logits['kernel'], logits['xla'],
                               atol=2e-2 * float(jnp.abs(logits['xla']).max()))
