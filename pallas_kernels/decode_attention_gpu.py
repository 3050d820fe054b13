"""Flash-decoding kernel for GPU (Pallas Triton); on the CPU with interpret=True.

A decode step's queries (T new tokens a row, H/G query heads a KV head: Q = T x H/G rows a
head group) attend over the cache where it lies ([B, G, S, K], or the looped core's carried
[L, B, G, S, K] at pass p, a traced index). XLA's products read all S slots at every step;
here program (b, g, c) reads only those key blocks of chunk c of the slot axis (CHUNK slots)
that hold positions up to row b's last new token, start_B[b] + T - 1: a step reads the
filled part of the cache, not its length, and the chunks past it end at once. Each chunk
keeps its running max, sum and unnormalised output in float32 (online softmax, split over
the slots as in flash decoding, so a short batch still fills the GPU); `_merge` combines the
chunks. Query rows are padded to a power of two of at least 16 (a Triton dot's smallest
side). The cache is written by XLA before (attention.write_rows: in place on a GPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK = 64        # key slots a loop step reads
CHUNK = 512       # slots one program covers (BLOCK x 8)
MAX_ROWS = 128    # query rows a head group (T x H/G, padded): a longer prefill takes XLA's
NEG = -1e30       # a masked score: finite, so a block with no key for a row adds exactly 0
STAGES = 2        # the loop's software pipeline: key and value tiles in flight
SMEM_BUDGET = 96 * 1024  # shared memory a program may take: under every GPU's opt-in
                         # (Ada's 99 KiB the least)


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def padded_rows(rows: int) -> int:
  """Query rows as the kernel holds them: the next power of two, at least 16."""
  return max(16, 1 << (rows - 1).bit_length())


def key_block(slots: int, head_dim: int, itemsize: int, rows: int = 16) -> int:
  """The key block: the largest of BLOCK, 32 and 16 slots that divides `slots` and whose
  shared memory fits SMEM_BUDGET (the padded queries, STAGES pipelined key and value tiles
  and the probabilities fed to the second product); 0 when none does."""
  need = lambda b: (rows * head_dim + STAGES * 2 * b * head_dim + rows * b) * itemsize
  return next((b for b in (BLOCK, 32, 16) if slots % b == 0 and need(b) <= SMEM_BUDGET), 0)


def supports(slots: int, head_dim: int, itemsize: int, tokens: int = 1,
             per_group: int = 1) -> bool:
  """Whether the kernel serves a cache of `slots` x `head_dim` of `itemsize`-byte elements
  for a step of `tokens` a row (`per_group` query heads a KV head): heads of a power of two
  from 16 to 256 lanes, at most MAX_ROWS query rows a group, and slots in whole key blocks
  that fit shared memory with them (`key_block`; a long prefill takes XLA's products)."""
  rows = padded_rows(tokens * per_group)
  return (_pow2(head_dim) and 16 <= head_dim <= 256 and tokens <= slots and rows <= MAX_ROWS
          and key_block(slots, head_dim, itemsize, rows) > 0)


def _kernel(pass_ref, start_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, rows: int,
            per_group: int, tokens: int, block: int, blocks: int, slots: int):
  b, g, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  p, start = pass_ref[0], start_ref[b]
  last = start + tokens - 1
  r = jax.lax.broadcasted_iota(jnp.int32, (q_ref.shape[0], 1), 0)
  pos_R1 = start + jnp.minimum(r, rows - 1) // per_group  # padded rows: the last row's
  q = q_ref[...]
  scale = 1.0 / float(q.shape[-1]) ** 0.5
  lo = c * blocks
  hi = jnp.minimum(jnp.minimum(lo + blocks, last // block + 1), slots // block)

  def step(i, carry):
    acc, m, l = carry
    s0 = pl.multiple_of(i * block, block)
    k = k_ref[p, b, g, pl.ds(s0, block), :]
    v = v_ref[p, b, g, pl.ds(s0, block), :]
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale
    keys_1S = s0 + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    valid = keys_1S <= pos_R1
    s = jnp.where(valid, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    prob = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    keys_S1 = s0 + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    v = jnp.where(keys_S1 <= last, v, jnp.zeros_like(v))  # unwritten slots: never 0 x NaN
    acc = acc * alpha + jnp.dot(prob.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc, m_new, l * alpha + jnp.sum(prob, axis=1, keepdims=True)

  n = q.shape[0]
  init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((n, 1), NEG, jnp.float32),
          jnp.zeros((n, 1), jnp.float32))
  acc, m, l = jax.lax.fori_loop(lo, jnp.maximum(hi, lo), step, init)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _merge(o_BGCRK, m_BGCR1, l_BGCR1):
  """The chunks' partial softmaxes as one: [B, G, R, K] float32."""
  top = jnp.max(m_BGCR1, axis=2, keepdims=True)
  w = jnp.exp(m_BGCR1 - top)
  return jnp.sum(w * o_BGCRK, axis=2) / jnp.sum(w * l_BGCR1, axis=2)


def decode_attention(q_BGQK, k_cache, v_cache, start_B, pass_index=None, *, tokens: int,
                     num_warps: int = 4, interpret=False):
  """Causal attention of a decode step's queries over the cache (module docstring):
  q_BGQK [B, G, Q, K] with Q = tokens x H/G (attention.group_queries); k_cache, v_cache
  [B, G, S, K] or [L, B, G, S, K] read at pass `pass_index` (an int32 scalar); start_B [B]
  int32, each row's first new position, whose T entries are already in the cache. Returns
  [B, G, Q, K] in q's dtype."""
  if k_cache.ndim == 4:
    k_cache, v_cache = k_cache[None], v_cache[None]
    pass_index = 0
  b, g, q, kd = q_BGQK.shape
  slots = k_cache.shape[3]
  itemsize = k_cache.dtype.itemsize
  if q % tokens or not supports(slots, kd, itemsize, tokens, q // tokens):
    raise ValueError(f'decode_attention (GPU): {q} query rows a group over {tokens} tokens, '
                     f'{slots} slots, heads of {kd}: not served (supports)')
  rows = padded_rows(q)
  block = key_block(slots, kd, itemsize, rows)
  blocks = CHUNK // block
  chunks = -(-slots // (blocks * block))
  q_pad = jnp.pad(q_BGQK, ((0, 0), (0, 0), (0, rows - q), (0, 0)))
  pass_1 = jnp.reshape(jnp.asarray(pass_index, jnp.int32), (1,))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, c: (0,) * a.ndim)
  kernel = functools.partial(_kernel, rows=q, per_group=q // tokens, tokens=tokens,
                             block=block, blocks=blocks, slots=slots)
  part = lambda *tail: jax.ShapeDtypeStruct((b, g, chunks, rows, *tail), jnp.float32)
  out_spec = lambda *tail: pl.BlockSpec((None, None, None, rows, *tail),
                                        lambda i, j, c: (i, j, c, 0) + (0,) * len(tail))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, g, chunks),
      in_specs=[whole(pass_1), whole(start_B),
                pl.BlockSpec((None, None, rows, kd), lambda i, j, c: (i, j, 0, 0)),
                whole(k_cache), whole(v_cache)],
      out_specs=[out_spec(kd), out_spec(1), out_spec(1)],
      out_shape=[part(kd), part(1), part(1)],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=STAGES),
      interpret=interpret)(pass_1, start_B.astype(jnp.int32), q_pad, k_cache, v_cache)
  return _merge(o, m, l)[:, :, :q].astype(q_BGQK.dtype)
