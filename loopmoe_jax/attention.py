"""Causal multi-head / grouped-query attention with RoPE and a KV cache.

Weights and computation are separate modules so a looped core can either own one set of
weights per physical layer (tied across passes) or receive per-pass weights that the core
stacks along a leading `loops` axis (untied, "Foil").
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import pallas_kernels
from loopmoe_jax import sharding
from loopmoe_jax.attention_impls import attend_with, chunked_attend, resolve
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.layers import DTYPES, fan_in_init, param, rope
from loopmoe_jax.runtime import HERE, Runtime
from pallas_kernels import capability
from pallas_kernels import decode_attention as decode_kernel
from pallas_kernels import decode_attention_gpu as gpu_kernel


class AttentionWeights(nn.Module):
  """q, k, v, o projections; with `stack` > 0 each gets a leading per-pass axis of that size,
  drawn independently per pass."""
  cfg: ModelConfig
  stack: int = 0

  @nn.compact
  def __call__(self):
    c, dt = self.cfg, DTYPES[self.cfg.param_dtype]
    d, h, g, k = c.d_model, c.num_heads, c.kv_heads, c.resolved_head_dim
    lead, lead_axes = ((self.stack,), ('loops',)) if self.stack else ((), ())
    b = len(lead)
    batch = tuple(range(b))
    w = {}
    for name, heads, axes in (('q', h, 'heads'), ('k', g, 'kv_heads'), ('v', g, 'kv_heads')):
      w[name] = param(self, name, lead + (d, heads, k), lead_axes + ('embed', axes, 'head_dim'),
                      fan_in_init([b], [b + 1, b + 2], batch), dt)
    w['o'] = param(self, 'o', lead + (h, k, d), lead_axes + ('heads', 'head_dim', 'embed'),
                   fan_in_init([b, b + 1], [b + 2], batch), dt)
    return w


class Attention(nn.Module):
  """Causal attention given its weights; in decode mode keeps a KV cache of `max_len` slots.

  positions_BT are absolute positions; in decode mode row b's chunk is written to the cache
  (heads-major, [B, G, S, K]) at positions_BT[b, 0] (rows may sit at different positions:
  batched.py) and attends to every filled slot before it.
  The write comes before the read, so the chunk's own positions are always read as this call's
  fresh K/V: with the core's cache shared by the passes (model.kv_cache 'last_pass' or
  'first_pass'), each pass attends to the shared K/V of earlier steps and its own K/V of this
  step, in the one slot the decode scan carries (`_cached`; under early exit a copy per
  pass, decode.py).

  Probes (opt-in, analysis/probes.py): only with `probe` (LoopedMoE(cfg, probe=True)), applied
  with mutable=['intermediates'] (outside decode), it sows float32 'q' [B,T,H,K], 'k' and 'v'
  [B,T,G,K] (after RoPE) and 'sink' [B,H], the attention mass on key 0 averaged over queries
  1..T-1. Otherwise nothing is sown and the traced program is unchanged.

  `run.attention_impl` picks the implementation (attention_impls.py); decoding (the cache
  path, `pass_index` the core's pass) runs Pallas decode kernels (`decode_kernels`): the
  TPU's where it resolves to splash (`decode_attend`), the GPU's where programs are built for
  a GPU and it is not xla (`decode_attend_gpu`), else `attend_cached` over the heads-major
  cache;
  the probes (they read the attention weights) take their own products whatever it says.
  q, k and v carry the checkpoint name 'attn_qkv', the attention output 'attention'.
  """
  cfg: ModelConfig
  decode: bool = False
  runtime: Runtime = HERE
  probe: bool = False

  @nn.compact
  def __call__(self, x_BTD, positions_BT, w, pass_index=None):
    c = self.cfg
    dt = x_BTD.dtype
    q_BTHK = jnp.einsum('btd,dhk->bthk', x_BTD, w['q'].astype(dt))
    k_BSGK = jnp.einsum('btd,dgk->btgk', x_BTD, w['k'].astype(dt))
    v_BSGK = jnp.einsum('btd,dgk->btgk', x_BTD, w['v'].astype(dt))
    q_BTHK = checkpoint_name(rope(q_BTHK, positions_BT, c.rope_theta), 'attn_qkv')
    k_BSGK = checkpoint_name(rope(k_BSGK, positions_BT, c.rope_theta), 'attn_qkv')
    v_BSGK = checkpoint_name(v_BSGK, 'attn_qkv')
    if self.decode:
      out_BTHK = self._cached(q_BTHK, k_BSGK, v_BSGK, positions_BT, pass_index)
    elif self.probe:
      out_BTHK, sink_BH = attend(q_BTHK, k_BSGK, v_BSGK, positions_BT, positions_BT, sink=True)
      for name, val in (('q', q_BTHK), ('k', k_BSGK), ('v', v_BSGK), ('sink', sink_BH)):
        self.sow('intermediates', name, val.astype(jnp.float32))
    elif (impl := resolve(self.runtime.run.attention_impl, c.dtype, self.runtime.target_platform,
                          c.resolved_head_dim)) == 'xla':
      out_BTHK = checkpoint_name(attend(q_BTHK, k_BSGK, v_BSGK, positions_BT, positions_BT),
                                 'attention')
    else:
      out_BTHK = attend_with(impl, q_BTHK, k_BSGK, v_BSGK, positions_BT, positions_BT,
                             self.runtime.run.attention_block, runtime=self.runtime)
    return jnp.einsum('bthk,hkd->btd', out_BTHK, w['o'].astype(dt))

  def _cached(self, q_BTHK, k_BTGK, v_BTGK, positions_BT, pass_index):
    """Decode mode: the chunk's K/V written into the cache (heads-major [B, G, S, K], the
    layout the attention's products read, so no step transposes the cache), then attention
    over every filled slot; at init the chunk's own K/V only. With `pass_index` p (the
    looped core's decode, core.Core) the cache holds every pass's slots, [L, B, G, S, K],
    carried through the passes: the chunk is written into pass p's slot in place and that
    slot read, so no pass copies its slot out and back. Under a shared layout
    (model.kv_cache 'last_pass' / 'first_pass') the carried cache is the one slot,
    [B, G, S, K]: under 'last_pass' pass p writes its chunk there and reads the slot
    (earlier positions the shared K/V, the chunk its own; the last pass's rows stay), under
    'first_pass' pass 0 alone writes and every pass reads the slot's earlier positions and
    its own chunk (`attend_split`): no per-pass copy of the slot."""
    initialized = self.has_variable('cache', 'k')
    b, t, g, k = k_BTGK.shape
    cache_k = self.variable('cache', 'k', jnp.zeros, (b, g, t, k), k_BTGK.dtype)
    cache_v = self.variable('cache', 'v', jnp.zeros, (b, g, t, k), v_BTGK.dtype)
    if not initialized:
      return attend_cached(q_BTHK, heads_major(k_BTGK), heads_major(v_BTGK), positions_BT,
                           positions_BT)
    start_B = positions_BT[:, 0]
    shared = pass_index is not None and cache_k.value.ndim == 4  # one slot for every pass
    if shared and self.cfg.kv_cache == 'first_pass':
      # the one slot keeps pass 0's rows: a later pass's write lands past the cache (dropped)
      # and every pass reads the slot before its chunk and its own K/V (`attend_split`)
      at_B = jnp.where(pass_index == 0, start_B, cache_k.value.shape[2])
      cache_k.value = write_rows(cache_k.value, k_BTGK, at_B)
      cache_v.value = write_rows(cache_v.value, v_BTGK, at_B)
      if self.runtime.empty_cache:
        return prefill_attend(q_BTHK, k_BTGK, v_BTGK, positions_BT, self.runtime, self.cfg)
      return attend_split(q_BTHK, cache_k.value, cache_v.value, k_BTGK, v_BTGK, positions_BT)
    kernels = decode_kernel_runs(self.runtime, self.cfg, cache_k.value, t)
    return self._over_cache(kernels, q_BTHK, k_BTGK, v_BTGK, cache_k, cache_v, positions_BT,
                            None if shared else pass_index)

  def _over_cache(self, kernels, q_BTHK, k_BTGK, v_BTGK, cache_k, cache_v, positions_BT,
                  pass_index):
    """The chunk written into the cache (pass `pass_index`'s slot, or the one slot) and its
    queries over the filled slots: in the TPU or GPU decode kernels (`kernels`), over the
    chunk alone for a prefill into an empty cache, else XLA's products over every slot."""
    start_B = positions_BT[:, 0]
    if kernels == 'tpu':  # written and read where the slots lie
      out_BTHK, cache_k.value, cache_v.value = decode_attend(
          q_BTHK, k_BTGK, v_BTGK, cache_k.value, cache_v.value, start_B, pass_index,
          runtime=self.runtime)
      return out_BTHK
    cache_k.value = write_rows(cache_k.value, k_BTGK, start_B, pass_index)
    cache_v.value = write_rows(cache_v.value, v_BTGK, start_B, pass_index)
    if kernels == 'gpu':  # the filled slots read where they lie
      return decode_attend_gpu(q_BTHK, cache_k.value, cache_v.value, start_B, pass_index,
                               runtime=self.runtime)
    if self.runtime.empty_cache:  # nothing before the chunk: it attends to itself alone
      return prefill_attend(q_BTHK, k_BTGK, v_BTGK, positions_BT, self.runtime, self.cfg)
    slot = ((lambda x: x) if pass_index is None else
            (lambda x: jax.lax.dynamic_index_in_dim(x, pass_index, 0, keepdims=False)))
    k_BGSK, v_BGSK = slot(cache_k.value), slot(cache_v.value)
    # Slots past the last written position are masked by causality (their position is larger
    # than every query's).
    slots = k_BGSK.shape[2]
    k_pos_BS = jnp.broadcast_to(jnp.arange(slots), (q_BTHK.shape[0], slots))
    return attend_cached(q_BTHK, k_BGSK, v_BGSK, positions_BT, k_pos_BS)


def prefill_attend(q_BTHK, k_BTGK, v_BTGK, positions_BT, runtime: Runtime, mc):
  """A prefill's attention into an empty cache: the chunk over its own K/V (nothing
  precedes it), [T, T] products where the cache's would be [T, S]: `attend` under
  run.attention_impl='xla', else flash attention's recurrence in blocks of
  run.attention_block (any length on every platform: [T, block] scores at a time)."""
  if resolve(runtime.run.attention_impl, mc.dtype, runtime.target_platform,
             mc.resolved_head_dim) == 'xla':
    return attend(q_BTHK, k_BTGK, v_BTGK, positions_BT, positions_BT)
  return chunked_attend(q_BTHK, k_BTGK, v_BTGK, positions_BT, positions_BT,
                        runtime.run.attention_block)


def heads_major(x_BTGK):
  """[B, T, G, K] -> [B, G, T, K]: the decode cache's layout."""
  return x_BTGK.transpose(0, 2, 1, 3)


def write_rows(cache, new_BTGK, start_B, pass_index=None):
  """The cache ([B, G, S, K]; with `pass_index` p, [L, B, G, S, K] and pass p's slot) with
  row b's T new entries at slots start_B[b] .. start_B[b] + T - 1: one scatter into the
  cache's own layout (the compilers update it in place; an entry past the cache is dropped,
  and decode_step's logits say so)."""
  b, t = new_BTGK.shape[:2]
  rows_B1 = jnp.arange(b)[:, None]
  slots_BT = start_B[:, None] + jnp.arange(t)
  new_BTGK = new_BTGK.astype(cache.dtype)
  if pass_index is None:
    return cache.at[rows_B1, :, slots_BT].set(new_BTGK, unique_indices=True)
  return cache.at[pass_index, rows_B1, :, slots_BT].set(new_BTGK, unique_indices=True)


def group_queries(q_BTHK, groups: int):
  """[B, T, H, K] -> [B, G, Q, K]: a head group's T x H/G queries as Q rows, query
  (t, head j of the group) at row t * H/G + j."""
  b, t, h, k = q_BTHK.shape
  return q_BTHK.reshape(b, t, groups, h // groups, k).transpose(0, 2, 1, 3, 4).reshape(
      b, groups, -1, k)


def ungroup_queries(out_BGQK, tokens: int):
  """group_queries' inverse: [B, G, Q, K] -> [B, T, H, K]."""
  b, g, q, k = out_BGQK.shape
  return out_BGQK.reshape(b, g, tokens, q // tokens, k).transpose(0, 2, 1, 3, 4).reshape(
      b, tokens, -1, k)


def attend_cached(q_BTHK, k_BGSK, v_BGSK, q_pos_BT, k_pos_BS):
  """`attend` over heads-major keys and values (the decode cache's layout): the same
  products, the T queries of a head group's H/G heads as one [T * H/G, S] block, batched
  over rows and groups."""
  _, t, h, k = q_BTHK.shape
  g = k_BGSK.shape[1]
  q_BGQK = group_queries(q_BTHK, g)
  q_pos_BQ = jnp.repeat(q_pos_BT, h // g, axis=1)  # query (t, head) at t's position
  mask_BGQS = (q_pos_BQ[:, :, None] >= k_pos_BS[:, None, :])[:, None]
  scores = jnp.einsum('bgqk,bgsk->bgqs', q_BGQK, k_BGSK,
                      preferred_element_type=jnp.float32) / jnp.sqrt(k).astype(jnp.float32)
  probs = _masked_softmax(scores, mask_BGQS).astype(v_BGSK.dtype)
  return ungroup_queries(jnp.einsum('bgqs,bgsk->bgqk', probs, v_BGSK), t)


def attend_split(q_BTHK, k_BGSK, v_BGSK, k_BTGK, v_BTGK, positions_BT):
  """One softmax over two key sets without joining them: each row's cache slots before its
  chunk (heads-major [B, G, S, K]) and the chunk's own K/V [B, T, G, K], causally; a shared
  slot's earlier positions and a pass's own rows ('first_pass', where only pass 0 writes)."""
  _, t, h, k = q_BTHK.shape
  g = k_BGSK.shape[1]
  q_BGQK = group_queries(q_BTHK, g)
  scale = 1.0 / jnp.sqrt(k).astype(jnp.float32)
  own_k, own_v = heads_major(k_BTGK), heads_major(v_BTGK)
  dots = lambda keys: jnp.einsum('bgqk,bgsk->bgqs', q_BGQK, keys,
                                 preferred_element_type=jnp.float32) * scale
  before = (jnp.arange(k_BGSK.shape[2])[None, :] < positions_BT[:, :1])[:, None, None]
  causal = (jnp.arange(t)[None, :] <= jnp.arange(q_BGQK.shape[2])[:, None] // (h // g))
  parts = [(dots(k_BGSK), before, v_BGSK), (dots(own_k), causal[None, None], own_v)]
  top = functools.reduce(jnp.maximum, [jnp.max(jnp.where(m, sc, -jnp.inf), -1, keepdims=True)
                                       for sc, m, _ in parts])
  probs = [(jnp.where(m, jnp.exp(sc - top), 0.0), v) for sc, m, v in parts]
  total = sum(jnp.sum(pr, -1, keepdims=True) for pr, _ in probs)
  out = sum(jnp.einsum('bgqs,bgsk->bgqk', (pr / total).astype(v.dtype), v) for pr, v in probs)
  return ungroup_queries(out, t)


def _masked_softmax(scores, mask):
  """Softmax over the last axis of float32 scores, masked positions at the float32 minimum."""
  return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)


def attend(q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, sink: bool = False):
  """Softmax attention in float32 with a causal mask by position; GQA by head groups.

  With `sink=True` also returns sink_BH: the probability on key slot 0 (the segment's first
  token, SMELT's attention sink) averaged over queries 1..T-1 (query 0 can only attend to
  itself); a reduction, the [B,H,T,S] probabilities are never returned."""
  b, t, h, k = q_BTHK.shape
  g = k_BSGK.shape[2]
  q = q_BTHK.reshape(b, t, g, h // g, k)
  scores = jnp.einsum('btgqk,bsgk->bgqts', q, k_BSGK,
                      preferred_element_type=jnp.float32) / jnp.sqrt(k).astype(jnp.float32)
  mask = q_pos_BT[:, None, None, :, None] >= k_pos_BS[:, None, None, None, :]
  probs = _masked_softmax(scores, mask).astype(v_BSGK.dtype)
  out = jnp.einsum('bgqts,bsgk->btgqk', probs, v_BSGK)
  if sink:
    col0 = probs[..., 1:, 0].astype(jnp.float32) if t > 1 else probs[..., 0].astype(jnp.float32)
    return out.reshape(b, t, h, k), jnp.mean(col0, axis=-1).reshape(b, h)
  return out.reshape(b, t, h, k)


def decode_kernels(runtime: Runtime, mc) -> str | None:
  """The Pallas decode kernels decode steps run: 'tpu' where `run.attention_impl` resolves to
  splash (a TPU; on the CPU named, interpreted: pallas_kernels.decode_attention), 'gpu' where
  programs are built for a GPU and it resolves to anything but xla
  (pallas_kernels.decode_attention_gpu; interpreted under Runtime(platform='gpu',
  interpret=True)), else None: XLA's products."""
  impl = resolve(runtime.run.attention_impl, mc.dtype, runtime.target_platform,
                 mc.resolved_head_dim)
  if impl == 'splash':
    return 'tpu'
  return 'gpu' if runtime.target_platform == 'gpu' and impl != 'xla' and _triton_runs(
      runtime) else None


def _triton_runs(runtime: Runtime) -> bool:
  """Whether the GPU programs are built for runs Pallas Triton: no failed Pallas check or
  refused target (`runtime.pallas_check`), and a compute capability of at least sm_80 (a
  named target's, aot.kernel_runtime, else this machine's GPU; unknown: assumed)."""
  if runtime.pallas_check:
    return False
  named = [dict(t).get('cc') for _, t in runtime.kernel_tiles]
  cc = next((c for c in named if c), None) or capability.local_cc()
  return cc is None or capability.family_refusal('gpu', cc) is None


def decode_kernel_runs(runtime: Runtime, mc, cache, tokens: int) -> str | None:
  """The kernels (`decode_kernels`) a decode step feeding `tokens` a row, attending over
  `cache` ([B, G, S, K] or [L, B, G, S, K]), runs in, where they serve that cache and chunk
  (a long prefill takes XLA's products); else None."""
  kernels = decode_kernels(runtime, mc)
  slots, head_dim, per_group = cache.shape[-2], cache.shape[-1], mc.num_heads // mc.kv_heads
  serves = {'tpu': lambda: decode_kernel.supports(slots, head_dim, cache.dtype.itemsize,
                                                  tokens, per_group),
            'gpu': lambda: gpu_kernel.supports(slots, head_dim, cache.dtype.itemsize, tokens,
                                               per_group)}
  return kernels if kernels and serves[kernels]() else None


def _kernel_shards(mesh, batch: int, groups: int, lead: int):
  """(rows, cache) PartitionSpecs of decode_attend's shard_map: the rows over the batch axes
  whose product divides the batch (the rest copied), head groups over `tensor` when it
  divides them; `lead` leading axes (the pass axis) whole."""
  rows = [a for a in sharding.batch_axes(mesh) if mesh.shape[a] > 1]
  while rows and batch % math.prod(mesh.shape[a] for a in rows):
    rows.pop()
  tensor = mesh.shape.get('tensor', 1)
  heads = 'tensor' if tensor > 1 and groups % tensor == 0 else None
  rows = tuple(rows) or None
  return P(rows, heads, None, None), P(*(None,) * lead, rows, heads, None, None), P(rows)


def decode_attend(q_BTHK, k_BTGK, v_BTGK, k_cache, v_cache, start_B, pass_index, *,
                  runtime: Runtime):
  """A decode step's attention in the Pallas decode kernels: the new K/V [B, T, G, K] written
  into the cache (pass `pass_index`'s slot of a [L, B, G, S, K] one) at positions
  start_B[b] + t, then the queries [B, T, H, K] over it; (out [B, T, H, K], k_cache, v_cache).
  Per batch shard inside `jax.shard_map` when the mesh splits work (`_kernel_shards`)."""
  b, t, _, k = q_BTHK.shape
  g = k_cache.shape[-3]
  interpret = pallas_kernels.ops.resolve_interpret('tpu', runtime.interpret,
                                                   runtime.target_platform)
  minor = decode_kernel.slots_minor(k)

  def step(q_BGQK, k_new, v_new, kc, vc, start, p):
    kc, vc = decode_kernel.write_rows(decode_kernel.view(kc, minor),
                                      decode_kernel.view(vc, minor), k_new, v_new, start, p,
                                      interpret=interpret)
    out = decode_kernel.decode_attention(q_BGQK, kc, vc, start, p, tokens=t,
                                         interpret=interpret)
    return out, decode_kernel.view(kc, minor), decode_kernel.view(vc, minor)

  pass_index = jnp.zeros((), jnp.int32) if pass_index is None else pass_index
  runtime = runtime.resolved()
  if runtime.sharded:
    rows4, cache, rows = _kernel_shards(runtime.mesh, b, g, k_cache.ndim - 4)
    step = jax.shard_map(step, in_specs=(rows4, rows4, rows4, cache, cache, rows, P()),
                         out_specs=(rows4, cache, cache), check_vma=False)
  out, k_cache, v_cache = step(group_queries(q_BTHK, g), heads_major(k_BTGK),
                               heads_major(v_BTGK), k_cache, v_cache, start_B, pass_index)
  return ungroup_queries(out, t), k_cache, v_cache


def decode_attend_gpu(q_BTHK, k_cache, v_cache, start_B, pass_index, *, runtime: Runtime):
  """A decode step's attention in the GPU decode kernel (its K/V already written): the
  queries [B, T, H, K] over the filled slots of the cache ([B, G, S, K], or pass
  `pass_index`'s slot of a [L, B, G, S, K] one); out [B, T, H, K]. Per batch shard inside
  `jax.shard_map` when the mesh splits work (`_kernel_shards`)."""
  b, t = q_BTHK.shape[:2]
  g = k_cache.shape[-3]
  interpret = pallas_kernels.ops.resolve_interpret('gpu', runtime.interpret,
                                                   runtime.target_platform)
  step = lambda q, kc, vc, start, p: gpu_kernel.decode_attention(q, kc, vc, start, p, tokens=t,
                                                                 interpret=interpret)
  pass_index = jnp.zeros((), jnp.int32) if pass_index is None else pass_index
  runtime = runtime.resolved()
  if runtime.sharded:
    rows4, cache, rows = _kernel_shards(runtime.mesh, b, g, k_cache.ndim - 4)
    step = jax.shard_map(step, in_specs=(rows4, cache, cache, rows, P()), out_specs=rows4,
                         check_vma=False)
  return ungroup_queries(step(group_queries(q_BTHK, g), k_cache, v_cache, start_B, pass_index),
                         t)
