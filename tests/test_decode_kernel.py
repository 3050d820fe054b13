"""The Pallas decode kernels (pallas_kernels/decode_attention.py), interpreted on this CPU.

- write_rows == attention.write_rows (the XLA scatter) and decode_attention == the XLA
  products over the written slot (attention.attend_cached), for one and three new tokens,
  with and without a pass axis, rows at different positions (one across a tile's edge, one
  at the cache's last slots), many key blocks most of which a row does not reach, each way a
  row is written (rows at any slot; a slots-minor cache's lane tiles; bf16's packed row
  tiles); a row whose chunk reaches past the cache is not written.
- attention.decode_attend (what Attention._cached calls) == the XLA path, output and
  cache; a looped model decoding with run.attention_impl='splash' (the kernels, interpreted)
  gives the XLA decode's logits, cache and batched greedy tokens, on a mesh (rows over
  `data`, head groups over `tensor`) its logits, the loop-draft plain greedy's tokens, and
  early exit and the shared layouts the XLA decode's logits (slow).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from helpers import make_cfg, rt
from loopmoe_jax import attention
from loopmoe_jax.attention import attend_cached, write_rows
from loopmoe_jax.batched import generate_batch
from loopmoe_jax.config.mesh import MeshConfig
from loopmoe_jax.decode import decode_step, generate, init_cache
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.sharding import make_mesh
from loopmoe_jax.speculative import generate_speculative
from pallas_kernels import decode_attention as dk

INTERPRET = pltpu.InterpretParams()


def _case(rng, lead, b, g, slots, kd, t, heads, dtype=jnp.float32):
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return (normal(*lead, b, g, slots, kd), normal(*lead, b, g, slots, kd),
          normal(b, t, heads, kd), normal(b, t, g, kd), normal(b, t, g, kd))


@pytest.mark.parametrize('tokens', [1, 3])
@pytest.mark.parametrize('passes', [0, 3], ids=['no pass axis', 'per pass'])
@pytest.mark.parametrize('kd,dtype', [(16, 'float32'), (128, 'float32'), (128, 'bfloat16')],
                         ids=['slots minor', 'heads of 128', 'packed rows'])
def test_kernels_write_and_attend_as_the_xla_path(tokens, passes, kd, dtype):
  b, g, slots, heads = 4, 2, 384, 4
  rng = np.random.default_rng(tokens + passes + kd)
  lead = (passes,) if passes else ()
  kc, vc, q, kn, vn = _case(rng, lead, b, g, slots, kd, tokens, heads, jnp.dtype(dtype))
  # block 0 only; across a lane tile's edge; a middle; the end (the last lane tiles)
  start = jnp.asarray([0, 127, 200, slots - tokens], jnp.int32)
  p = jnp.asarray(1, jnp.int32) if passes else None
  ref_k, ref_v = write_rows(kc, kn, start, p), write_rows(vc, vn, start, p)
  minor = dk.slots_minor(kd)
  got_k, got_v = dk.write_rows(dk.view(kc, minor), dk.view(vc, minor), kn.transpose(0, 2, 1, 3),
                               vn.transpose(0, 2, 1, 3), start, p, interpret=INTERPRET)
  np.testing.assert_array_equal(dk.view(got_k, minor), ref_k)
  np.testing.assert_array_equal(dk.view(got_v, minor), ref_v)
  slot = (lambda x: x[1]) if passes else (lambda x: x)
  pos = start[:, None] + jnp.arange(tokens)
  ref = attend_cached(q, slot(ref_k), slot(ref_v), pos, jnp.broadcast_to(jnp.arange(slots),
                                                                          (b, slots)))
  out = dk.decode_attention(attention.group_queries(q, g), got_k, got_v, start, p,
                            tokens=tokens, block=128 if minor else 16, interpret=INTERPRET)
  out = attention.ungroup_queries(out, tokens)
  tol = 1e-5 if dtype == 'float32' else 2e-2
  np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32),
                             atol=tol * float(jnp.abs(ref.astype(jnp.float32)).max()))


def test_decode_attend_takes_the_layer_layouts_and_returns_the_written_cache():
  """attention.decode_attend, what Attention._cached calls: [B, T, H, K] queries and
  [B, T, G, K] new K/V in, the XLA path's output and cache out."""
  b, g, slots, kd, t, heads = 2, 2, 32, 128, 2, 4
  kc, vc, q, kn, vn = _case(np.random.default_rng(1), (3,), b, g, slots, kd, t, heads)
  start, p = jnp.asarray([3, 20], jnp.int32), jnp.asarray(2, jnp.int32)
  ref_k, ref_v = write_rows(kc, kn, start, p), write_rows(vc, vn, start, p)
  ref = attend_cached(q, ref_k[2], ref_v[2], start[:, None] + jnp.arange(t),
                      jnp.broadcast_to(jnp.arange(slots), (b, slots)))
  out, got_k, got_v = attention.decode_attend(q, kn, vn, kc, vc, start, p,
                                                    runtime=rt(attention_impl='splash'))
  np.testing.assert_allclose(out, ref, atol=1e-5 * float(jnp.abs(ref).max()))
  np.testing.assert_array_equal(got_k, ref_k)
  np.testing.assert_array_equal(got_v, ref_v)


def test_shards_split_rows_over_the_batch_axes_that_divide_them():
  mesh = make_mesh(MeshConfig(data=4, tensor=2))
  assert attention._kernel_shards(mesh, 8, 2, 1) == (
      jax.sharding.PartitionSpec(('data',), 'tensor', None, None),
      jax.sharding.PartitionSpec(None, ('data',), 'tensor', None, None),
      jax.sharding.PartitionSpec(('data',)))
  rows4, cache, rows = attention._kernel_shards(mesh, 1, 3, 0)  # batch 1, 3 groups: copied
  assert rows4 == jax.sharding.PartitionSpec(None, None, None, None) and rows == (
      jax.sharding.PartitionSpec(None)) and cache == rows4


@pytest.mark.parametrize('kd,dtype', [(16, 'float32'), (128, 'float32'), (128, 'bfloat16')],
                         ids=['slots minor', 'heads of 128', 'packed rows'])
def test_a_chunk_past_the_cache_is_not_written(kd, dtype):
  rng = np.random.default_rng(0)
  kc, vc, _, kn, vn = _case(rng, (), 2, 1, 256, kd, 3, 2, jnp.dtype(dtype))
  start = jnp.asarray([4, 254], jnp.int32)  # row 1's slots 254, 255, 256: past 256 slots
  before = np.asarray(kc)
  minor = dk.slots_minor(kd)
  got_k, _ = dk.write_rows(dk.view(kc, minor), dk.view(vc, minor), kn.transpose(0, 2, 1, 3),
                           vn.transpose(0, 2, 1, 3), start, interpret=INTERPRET)
  got_k = dk.view(got_k, minor)
  np.testing.assert_array_equal(kc, before)  # called alone, the cache given stays as it was
  np.testing.assert_array_equal(got_k[1], before[1])
  np.testing.assert_array_equal(got_k[0, :, 4:7], kn[0].transpose(1, 0, 2))
  np.testing.assert_array_equal(got_k[0, :, 7:], before[0, :, 7:])


def test_supports_blocks_within_vmem_and_slots_of_whole_tiles():
  assert dk.supports(4096, 128, 4) and dk.supports(1000, 128, 4) and dk.supports(4096, 64, 4)
  assert dk.supports(1008, 256, 2) and not dk.supports(1000, 256, 2)  # bf16: 16-row tiles
  assert not dk.supports(999_999, 128, 4)      # no block divides: one block over VMEM
  assert not dk.supports(1000, 64, 4)          # slots-minor, slots not of whole lane tiles
  assert dk.window(1, 4096, 128) == 256 and dk.window(200, 4096, 128) == 384
  assert dk.window(3, 128, 128) == 128 and dk.window(3, 4096, 16) == 32
  assert [dk.slot_tile(128, n) for n in (4, 2, 1)] == [1, 16, 32] and dk.slot_tile(64, 4) == 128
  assert [dk.layout_tile(128, n) for n in (4, 2, 1)] == [8, 16, 32] and dk.layout_tile(64, 2) == 128
  assert dk.key_block(4096) == 512 and dk.key_block(1000) == 8 and dk.key_block(999) == 999
  assert dk.key_block(1000, block=100) == 8  # a block size not of whole sublanes is not used
  assert dk.supports(4096, 128, 4, tokens=512, per_group=2)  # a prefill that fits VMEM
  assert not dk.supports(4096, 128, 4, tokens=4096, per_group=4)  # one that does not: XLA
  assert not dk.supports(128, 128, 4, tokens=200)
  assert dk.key_block_of(384, 64, block=16) == 128 and dk.key_block_of(384, 128, 16) == 16


def _looped(head_dim):
  cfg = make_cfg(head_dim=head_dim, num_kv_heads=2, injection='add', core_layers=1,
                 num_loops=2)
  v = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  return cfg, v['params']


@pytest.fixture(scope='module')
def looped():
  return _looped(128)


@pytest.mark.parametrize('head_dim', [128, 16], ids=['heads of 128', 'slots minor'])
def test_decode_with_the_kernels_is_the_xla_decode(head_dim):
  cfg, params = _looped(head_dim)
  kernels, xla = rt(attention_impl='splash'), rt(attention_impl='xla')
  slots = 128  # slots-minor: whole lane tiles (the write's window the whole cache)
  cache = init_cache(cfg, 2, slots)
  assert attention.decode_kernel_runs(kernels, cfg, cache['core']['body']['layer_0'][
      'attention']['k'], 5)
  toks = jnp.asarray([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], jnp.int32)
  caches = {name: init_cache(cfg, 2, slots) for name in ('kernels', 'xla')}
  for chunk in (toks, toks[:, 1:3]):  # a prefill, then two tokens
    out = {}
    for name, runtime in (('kernels', kernels), ('xla', xla)):
      out[name], caches[name] = decode_step(cfg, params, caches[name], chunk, runtime=runtime)
    np.testing.assert_allclose(out['kernels'], out['xla'], atol=2e-5)
  for a, b in zip(jax.tree.leaves(caches['kernels']), jax.tree.leaves(caches['xla'])):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_batched_greedy_generation_with_the_kernels_is_the_xla_ones(looped):
  cfg, params = looped
  prompts = [[3, 5, 7], [2, 4, 6, 8, 10, 12], [9]]
  gen = lambda runtime: generate_batch(cfg, params, prompts, 4, jax.random.key(0),
                                       batch_size=3, runtime=runtime)
  assert gen(rt(attention_impl='splash')) == gen(rt(attention_impl='xla'))


def test_loop_draft_with_the_kernels_is_plain_greedy(looped):
  """The loop-draft's pass ranges (pass_range.py) write and read their slots in the kernels;
  its cache rounds up to whole lane tiles (decode.slots_for)."""
  cfg, params = looped
  prompt = jnp.asarray([[3, 5, 7, 9]], jnp.int32)
  plain = generate(cfg, params, prompt, 6, jax.random.key(0), runtime=rt(attention_impl='xla'))
  spec = generate_speculative(cfg, params, prompt, 6, jax.random.key(0), draft_loops=1,
                              lookahead=2, runtime=rt(attention_impl='splash'))
  np.testing.assert_array_equal(spec.tokens, plain)


def test_on_a_mesh_the_kernels_run_per_shard_and_equal_the_xla_decode(looped):
  """Rows over `data`, the two head groups over `tensor`: decode_attend's shard_map."""
  cfg, params = looped
  toks = jnp.asarray(np.arange(20).reshape(4, 5) % cfg.vocab_size, jnp.int32)
  ref, _ = decode_step(cfg, params, init_cache(cfg, 4, 16), toks,
                       runtime=rt(attention_impl='xla'))
  with jax.set_mesh(make_mesh(MeshConfig(data=4, tensor=2))):
    out, _ = jax.jit(lambda p, c, t: decode_step(cfg, p, c, t, runtime=rt(
        attention_impl='splash')))(params, init_cache(cfg, 4, 16), toks)
  np.testing.assert_allclose(out, ref, atol=2e-5)


@pytest.mark.parametrize('kw', [dict(exit='kl', exit_threshold=1e-3), dict(kv_cache='last_pass'),
                                dict(kv_cache='first_pass')], ids=['early exit', 'last', 'first'])
def test_early_exit_and_shared_layouts_with_the_kernels_are_the_xla_decode(kw):
  """Early exit's pass loop (pass p's slot of the carried cache a call) and the shared
  layouts (the one slot carried) around the kernels: the XLA decode's logits, prefill and step."""
  cfg = make_cfg(head_dim=128, num_kv_heads=2, injection='add', core_layers=1, num_loops=3,
                 **kw)
  params = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(0),
                                                   jnp.zeros((1, 4), jnp.int32)))['params']
  toks = jnp.asarray([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], jnp.int32)
  out = {}
  for name in ('splash', 'xla'):
    cache = init_cache(cfg, 2, 128)
    first, cache = decode_step(cfg, params, cache, toks, runtime=rt(attention_impl=name))
    out[name] = (first, decode_step(cfg, params, cache, toks[:, :2],
                                    runtime=rt(attention_impl=name))[0])
  for kernels, xla in zip(out['splash'], out['xla']):
    np.testing.assert_allclose(kernels, xla, atol=2e-5)
