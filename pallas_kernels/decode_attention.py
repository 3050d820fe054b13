"""Decode attention over the KV cache where it lies (TPU Pallas Mosaic; interpreted on CPU).

    k_cache, v_cache = write_rows(k_cache, v_cache, k_new, v_new, start_B, pass_index)
    out_BGQK = decode_attention(q_BGQK, k_cache, v_cache, start_B, pass_index, tokens=T)

A decode step's T new tokens per row are written into the cache and attend to its slots,
causally by position. The cache is heads-major, [B, G, S, K], or with a looped core's slot
per pass [L, B, G, S, K] and `pass_index` p. XLA:TPU, left to itself, lays the carried cache
out for its scatter and its products and copies it to and from that layout and a pass's slot
out of it at every step (docs/results.md: 3.8 times the cache's bytes a step). Here:

- `write_rows` DMAs each row's [G, T, K] block into the cache, which it aliases (updated in
  place; XLA never writes it, so its layout stays the one the kernels read); where a DMA
  cannot start at any slot (a 16-bit cache's packed rows, a slots-minor cache's lanes) it
  reads the whole tiles around the new slots, merges them in and writes the tiles back;
- `decode_attention` reads pass p's slot in key blocks straight from the cache (the block's
  index names the pass, a scalar prefetched into SMEM), and only the blocks up to the row's
  last query position (later grid steps repeat the last one's index, which the pipeline does
  not fetch again): a step reads the filled part of the cache once.

XLA:TPU keeps a cache whose head dim is not a multiple of the 128 lanes slots-minor (its
[S, K] tiles would pad K), so the kernels read such a cache as [.., K, S] (`view`, a bitcast
there; `slots_minor`). `supports` says which caches they serve.

Queries: a head group's T x H/G queries as Q rows, query i at token t = i // (H/G), token t
of row b at position start_B[b] + t (decoding feeds consecutive positions). Grid (B, G, key
blocks), the key blocks innermost with the online softmax (running max, sum and output in
float32 VMEM scratch), written once at the last block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASKED = float(jnp.finfo(jnp.float32).min)  # a masked score, as attention._masked_softmax
LANES = 128  # TPU vreg lanes: the head dim's multiple; the running max and sum's width
VMEM_BLOCKS = 8 << 20  # bytes of the blocks and scratch a call may hold (of 16 MiB scoped)


def key_block(slots: int, block: int = 512) -> int:
  """The key block: the largest of `block`, 256, ..., 8 that divides `slots`, else `slots`
  (one block: a TPU block's second-minor dimension is a multiple of 8 or the whole axis)."""
  for size in (block, 256, 128, 64, 32, 16, 8):
    if size <= block and size % 8 == 0 and slots % size == 0:
      return size
  return slots


def key_block_of(slots: int, head_dim: int, block: int = 512) -> int:
  """The key block of a cache: key_block, or read slots-minor the largest of `block` (in whole
  lane tiles, at least one), 256 and 128 that divides `slots`, else `slots`."""
  if not slots_minor(head_dim):
    return key_block(slots, block)
  top = max(block // LANES * LANES, LANES)
  return next((s for s in (top, 256, 128) if s <= top and slots % s == 0), slots)


def slots_minor(head_dim: int) -> bool:
  """Whether the kernels read the cache as [.., K, S] (module docstring)."""
  return head_dim % LANES != 0


def layout_tile(head_dim: int, itemsize: int) -> int:
  """The slots of one tile of the cache as the kernels keep it: 128 lanes read slots-minor,
  8 sublanes of 32-bit words otherwise (16 rows of a 16-bit dtype, 32 of an 8-bit one)."""
  return LANES if slots_minor(head_dim) else 32 // itemsize


def slot_tile(head_dim: int, itemsize: int) -> int:
  """The unit a write's DMA offset must be a multiple of: the layout's tile (`layout_tile`),
  or 1, any offset, where 32-bit rows lie slots-major ([S, K])."""
  if not slots_minor(head_dim) and itemsize >= 4:
    return 1
  return layout_tile(head_dim, itemsize)


def window(tokens: int, slots: int, tile: int) -> int:
  """The slots a windowed write reads and writes back: whole tiles covering any `tokens`
  consecutive slots, or the whole cache when it is narrower."""
  return min(tile * (-(-tokens // tile) + 1), slots)


def window_start(start, slots: int, width: int, tile: int):
  """The first slot of the `width`-slot window (`window`) around slots from `start`: the
  start's tile, moved back where the window would pass the cache's end."""
  return jnp.minimum(jax.lax.div(start, tile) * tile, slots - width)


def supports(slots: int, head_dim: int, itemsize: int, tokens: int = 1, per_group: int = 1,
             block: int = 512) -> bool:
  """Whether the kernels serve a cache of `slots` x `head_dim` for a step of `tokens` a row
  (`per_group` query heads a KV head): slots of whole tiles along the slot axis
  (`slot_tile`), and within VMEM_BLOCKS the attention's double-buffered key and value
  blocks, its queries, float32 scores, output and running max and sum, and the write's
  window (a long prefill does not fit: XLA's products take it)."""
  tile = slot_tile(head_dim, itemsize)
  if slots % tile or tokens > slots:
    return False
  lanes = -(-head_dim // LANES) * LANES
  bs = key_block_of(slots, head_dim, block)
  rows = tokens * per_group
  attend = 4 * bs * lanes * itemsize + rows * (2 * lanes * itemsize + 4 * (bs + lanes + 2 * LANES))
  write = 0 if tile == 1 else 4 * window(tokens, slots, tile) * lanes * max(itemsize, 4)
  return max(attend, write) <= VMEM_BLOCKS


def view(cache, minor: bool):
  """The cache as the kernels read it: itself, or `minor` with its last two axes swapped
  ([.., K, S]; the swap is its own inverse)."""
  return jnp.swapaxes(cache, -1, -2) if minor else cache


def _attend_kernel(pass_ref, start_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
                   tokens: int, per_group: int, block: int, minor: bool):
  del pass_ref  # read by the index maps only
  b, s = pl.program_id(0), pl.program_id(2)
  start = start_ref[b]

  @pl.when(s == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(s * block <= start + tokens - 1)  # a block holding a slot some query sees
  def _block():
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    scale = jnp.sqrt(jnp.float32(q.shape[-1]))
    # key and value blocks [bs, K], or [K, bs] read slots-minor
    scores = jax.lax.dot_general(q, k, (((1,), (0 if minor else 1,)), ((), ())),
                                 preferred_element_type=jnp.float32) / scale
    shape = scores.shape
    # lax.div, not //: floor division lowers through `sign`, which asks the chip's generation
    q_pos = start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, 0), per_group)
    k_pos = s * block + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    scores = jnp.where(q_pos >= k_pos, scores, MASKED)
    m_prev = m_ref[:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    p = jnp.exp(scores - m_new)
    alpha = jnp.exp(m_prev - m_new)
    l_ref[...] = jnp.broadcast_to(alpha * l_ref[:, :1] + jnp.sum(p, axis=1, keepdims=True),
                                  l_ref.shape)
    acc_ref[...] = alpha * acc_ref[...] + jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (1 if minor else 0,)), ((), ())),
        preferred_element_type=jnp.float32)
    m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)

  @pl.when(s == pl.num_programs(2) - 1)
  def _store():
    o_ref[...] = (acc_ref[...] / l_ref[:, :1]).astype(o_ref.dtype)


def _with_passes(k_cache, v_cache, pass_index):
  """A [B, G, S, K] cache as one pass's [1, B, G, S, K] (pass 0)."""
  if k_cache.ndim == 4:
    return k_cache[None], v_cache[None], 0
  return k_cache, v_cache, pass_index


def _scalars(pass_index, start_B):
  return jnp.asarray(pass_index, jnp.int32).reshape(1), start_B.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('tokens', 'block', 'interpret'))
def decode_attention(q_BGQK, k_view, v_view, start_B, pass_index=None, *, tokens: int,
                     block: int = 512, interpret=False):
  """Causal attention of a decode step's queries over the cache (module docstring):
  q_BGQK [B, G, Q, K] with Q = tokens x H/G; k_view, v_view the cache's `view`s ([B, G, S, K]
  or [L, B, G, S, K] read at pass `pass_index`, an int32 scalar; slots-minor [.., K, S]);
  start_B [B] int32, each row's first new position. Returns [B, G, Q, K] in q's dtype.
  `interpret`: False, True or pltpu.InterpretParams() (a CPU)."""
  k_cache, v_cache, pass_index = _with_passes(k_view, v_view, pass_index)
  b, g, q, kd = q_BGQK.shape
  minor = slots_minor(kd)
  slots = k_cache.shape[4 if minor else 3]
  if q % tokens:
    raise ValueError(f'decode_attention: {q} query rows per group is not a multiple of '
                     f'tokens={tokens}')
  bs = key_block_of(slots, kd, block)
  last = lambda r, st_ref, s: jnp.minimum(s, jax.lax.div(st_ref[r] + tokens - 1, bs))
  kv_spec = (pl.BlockSpec((None, None, None, kd, bs),
                          lambda r, h, s, p_ref, st_ref: (p_ref[0], r, h, 0, last(r, st_ref, s)))
             if minor else
             pl.BlockSpec((None, None, None, bs, kd),
                          lambda r, h, s, p_ref, st_ref: (p_ref[0], r, h, last(r, st_ref, s), 0)))
  q_spec = pl.BlockSpec((None, None, q, kd), lambda r, h, s, *_: (r, h, 0, 0))
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b, g, slots // bs),
      in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec,
      scratch_shapes=[pltpu.VMEM((q, LANES), jnp.float32), pltpu.VMEM((q, LANES), jnp.float32),
                      pltpu.VMEM((q, kd), jnp.float32)])
  kernel = functools.partial(_attend_kernel, tokens=tokens, per_group=q // tokens, block=bs,
                             minor=minor)
  return pl.pallas_call(
      kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(q_BGQK.shape, q_BGQK.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      cost_estimate=pl.CostEstimate(
          flops=4 * b * g * q * slots * kd, transcendentals=b * g * q * slots,
          bytes_accessed=2 * b * g * slots * kd * k_cache.dtype.itemsize + 2 * q_BGQK.nbytes),
      interpret=interpret)(*_scalars(pass_index, start_B), q_BGQK, k_cache, v_cache)


def _write_kernel(pass_ref, start_ref, k_new_ref, v_new_ref, k_in, v_in, k_out, v_out, *scratch,
                  tokens: int, slots: int, minor: bool, tile: int):
  del k_in, v_in  # the same buffers as k_out, v_out (aliased)
  b = pl.program_id(0)
  start, p = start_ref[b], pass_ref[0]
  pairs = ((k_new_ref, k_out), (v_new_ref, v_out))
  at = lambda out, first, n: (out.at[p, b, :, :, pl.ds(first, n)] if minor
                              else out.at[p, b, :, pl.ds(first, n)])

  @pl.when(start + tokens <= slots)  # a chunk reaching past the cache is dropped
  def _write():
    if tile == 1:  # any offset: the new rows themselves
      sems, = scratch
      copies = [pltpu.make_async_copy(new.at[0], at(out, start, tokens), sems.at[i])
                for i, (new, out) in enumerate(pairs)]
      for copy in copies:
        copy.start()
      for copy in copies:
        copy.wait()
      return
    # the whole tiles around the new slots, read, merged, written back
    buf, sems = scratch
    axis = 2 if minor else 1  # the slot axis of a row's [G, K, W] or [G, W, K]
    width = buf.shape[axis + 1]
    first = pl.multiple_of(window_start(start, slots, width, tile), tile)
    offset = start - first
    for i, (_, out) in enumerate(pairs):
      pltpu.make_async_copy(at(out, first, width), buf.at[i], sems.at[i]).start()
    for i, (new, out) in enumerate(pairs):
      pltpu.make_async_copy(at(out, first, width), buf.at[i], sems.at[i]).wait()
      slot = jax.lax.broadcasted_iota(jnp.int32, buf.shape[1:], axis)
      # the new slots moved to theirs (in float32: Mosaic rotates no packed type; exact)
      fresh = pltpu.roll(new[0].astype(jnp.float32), offset, axis)
      keep = buf[i].astype(jnp.float32)
      buf[i] = jnp.where((slot >= offset) & (slot < offset + tokens), fresh,
                         keep).astype(buf.dtype)
      pltpu.make_async_copy(buf.at[i], at(out, first, width), sems.at[i]).start()
    for i, (_, out) in enumerate(pairs):
      pltpu.make_async_copy(buf.at[i], at(out, first, width), sems.at[i]).wait()


@functools.partial(jax.jit, static_argnames=('interpret',))
def write_rows(k_view, v_view, k_new, v_new, start_B, pass_index=None, *, interpret=False):
  """The caches' `view`s ([B, G, S, K], or [L, B, G, S, K] at pass `pass_index`; slots-minor
  [.., K, S]) with row b's T new entries k_new, v_new [B, G, T, K] at slots start_B[b] ..
  start_B[b] + T - 1, written in place by DMA (module docstring): the rows themselves where
  a DMA may start at any slot, else the whole tiles (`slot_tile`) around them, read, merged
  and written back. A row whose chunk reaches past the cache is not written (decode_step's
  logits say so). In place under an enclosing jit (the caches aliased to the outputs);
  called alone, the caches given stay as they were."""
  squeeze = k_view.ndim == 4
  k_cache, v_cache, pass_index = _with_passes(k_view, v_view, pass_index)
  b, g, tokens, kd = k_new.shape
  minor = slots_minor(kd)
  slots = k_cache.shape[4 if minor else 3]
  tile = slot_tile(kd, k_cache.dtype.itemsize)
  if slots % tile or tokens > slots:
    raise ValueError(f'write_rows: a cache of {slots} slots takes no chunk of {tokens} '
                     f'(slots must be a multiple of {tile} and at least the chunk: supports)')
  news = [x.astype(k_cache.dtype) for x in (k_new, v_new)]
  scratch = [pltpu.SemaphoreType.DMA((2,))]
  if tile > 1:  # [B, G, K, W] or [B, G, W, K]: the new slots first, moved in the kernel
    width = window(tokens, slots, tile)
    pad = [(0, 0)] * 4
    pad[3 if minor else 2] = (0, width - tokens)
    news = [jnp.pad(x.transpose(0, 1, 3, 2) if minor else x, pad) for x in news]
    scratch = [pltpu.VMEM((2,) + news[0].shape[1:], k_cache.dtype)] + scratch
  new_spec = pl.BlockSpec((1,) + news[0].shape[1:], lambda r, *_: (r, 0, 0, 0))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b,), in_specs=[new_spec, new_spec, hbm, hbm],
      out_specs=[hbm, hbm], scratch_shapes=scratch)
  k_cache, v_cache = pl.pallas_call(
      functools.partial(_write_kernel, tokens=tokens, slots=slots, minor=minor, tile=tile),
      grid_spec=spec, out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
      input_output_aliases={4: 0, 5: 1},
      compiler_params=pltpu.CompilerParams(dimension_semantics=('arbitrary',)),
      interpret=interpret)(*_scalars(pass_index, start_B), *news, k_cache, v_cache)
  return (k_cache[0], v_cache[0]) if squeeze else (k_cache, v_cache)
