"""Causal multi-head / grouped-query attention with RoPE and a KV cache.

Weights and computation are separate modules so a looped core can either own one set of
weights per physical layer (tied across passes) or receive per-pass weights that the core
stacks along a leading `loops` axis (untied, "Foil").
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from loopmoe_jax.attention_impls import attend_with, resolve
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.layers import DTYPES, fan_in_init, param, rope
from loopmoe_jax.runtime import HERE, Runtime


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

  positions_BT are absolute positions; in decode mode row b's chunk is written to the cache at
  positions_BT[b, 0] (rows may sit at different positions: batched.py) and attends to every
  filled slot before it.
  The write comes before the read, so the chunk's own positions are always read as this call's
  fresh K/V: with the core's cache shared by the passes (model.kv_cache 'last_pass' or
  'first_pass'), each pass gets a copy of the shared slot (decode.py), so it attends to the
  shared K/V of earlier steps and its own K/V of this step, and decode.py keeps the named
  pass's copy.

  Probes (opt-in, analysis/probes.py): only with `probe` (LoopedMoE(cfg, probe=True)), applied
  with mutable=['intermediates'] (outside decode), it sows float32 'q' [B,T,H,K], 'k' and 'v'
  [B,T,G,K] (after RoPE) and 'sink' [B,H], the attention mass on key 0 averaged over queries
  1..T-1. Otherwise nothing is sown and the traced program is unchanged.

  `run.attention_impl` picks the implementation (attention_impls.py); decoding (the cache
  path) and the probes (they read the attention weights) use 'xla' whatever it says. q, k and
  v carry the checkpoint name 'attn_qkv', the attention output 'attention'.
  """
  cfg: ModelConfig
  decode: bool = False
  runtime: Runtime = HERE
  probe: bool = False

  @nn.compact
  def __call__(self, x_BTD, positions_BT, w):
    c = self.cfg
    dt = x_BTD.dtype
    q_BTHK = jnp.einsum('btd,dhk->bthk', x_BTD, w['q'].astype(dt))
    k_BSGK = jnp.einsum('btd,dgk->btgk', x_BTD, w['k'].astype(dt))
    v_BSGK = jnp.einsum('btd,dgk->btgk', x_BTD, w['v'].astype(dt))
    q_BTHK = checkpoint_name(rope(q_BTHK, positions_BT, c.rope_theta), 'attn_qkv')
    k_BSGK = checkpoint_name(rope(k_BSGK, positions_BT, c.rope_theta), 'attn_qkv')
    v_BSGK = checkpoint_name(v_BSGK, 'attn_qkv')
    k_pos_BS = positions_BT
    if self.decode:
      initialized = self.has_variable('cache', 'k')
      cache_k = self.variable('cache', 'k', jnp.zeros, k_BSGK.shape, k_BSGK.dtype)
      cache_v = self.variable('cache', 'v', jnp.zeros, v_BSGK.shape, v_BSGK.dtype)
      if initialized:
        start_B = positions_BT[:, 0]
        cache_k.value = write_rows(cache_k.value, k_BSGK, start_B)
        cache_v.value = write_rows(cache_v.value, v_BSGK, start_B)
        k_BSGK, v_BSGK = cache_k.value, cache_v.value
        # Slots past the last written position are masked by causality (their position is
        # larger than every query's).
        k_pos_BS = jnp.broadcast_to(jnp.arange(k_BSGK.shape[1]), (x_BTD.shape[0],
                                                                   k_BSGK.shape[1]))
    if self.probe and not self.decode:
      out_BTHK, sink_BH = attend(q_BTHK, k_BSGK, v_BSGK, positions_BT, k_pos_BS, sink=True)
      for name, val in (('q', q_BTHK), ('k', k_BSGK), ('v', v_BSGK), ('sink', sink_BH)):
        self.sow('intermediates', name, val.astype(jnp.float32))
    elif self.decode or (impl := resolve(
        self.runtime.run.attention_impl, c.dtype, self.runtime.target_platform,
        c.resolved_head_dim)) == 'xla':
      out_BTHK = checkpoint_name(attend(q_BTHK, k_BSGK, v_BSGK, positions_BT, k_pos_BS),
                                 'attention')
    else:
      out_BTHK = attend_with(impl, q_BTHK, k_BSGK, v_BSGK, positions_BT, k_pos_BS,
                             self.runtime.run.attention_block, runtime=self.runtime)
    return jnp.einsum('bthk,hkd->btd', out_BTHK, w['o'].astype(dt))


def write_rows(cache_BSGK, new_BTGK, start_B):
  """The cache with row b's T new entries at slots start_B[b] .. start_B[b] + T - 1."""
  put = lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x, s, 0)
  return jax.vmap(put)(cache_BSGK, new_BTGK.astype(cache_BSGK.dtype), start_B)


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
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGK.dtype)
  out = jnp.einsum('bgqts,bsgk->btgqk', probs, v_BSGK)
  if sink:
    col0 = probs[..., 1:, 0].astype(jnp.float32) if t > 1 else probs[..., 0].astype(jnp.float32)
    return out.reshape(b, t, h, k), jnp.mean(col0, axis=-1).reshape(b, h)
  return out.reshape(b, t, h, k)
