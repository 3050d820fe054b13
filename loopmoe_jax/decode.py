"""Autoregressive decoding with a KV cache of one slot per executed (pass, layer).

    cache = init_cache(cfg, batch=2, max_len=64)
    logits, cache = decode_step(cfg, params, cache, prompt_BT)     # prefill
    logits, cache = decode_step(cfg, params, cache, next_B1)       # one token
    tokens = generate(cfg, params, prompt_BT, steps=32, key=key, temperature=0.8)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE, for_init, variables


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None = None):
  """The cache's leaves as ShapeDtypeStructs (nothing allocated)."""
  return jax.tree.map(lambda s: s, _cache_shapes(cfg, batch, max_len, num_loops))


@functools.lru_cache(maxsize=64)
def _cache_shapes(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None):
  """Traces the model once per (config, shape): a generate call asks for the cache's bytes
  and then the cache itself."""
  model = for_init(LoopedMoE(cfg, decode=True))
  dummy = jax.ShapeDtypeStruct((batch, max_len), jnp.int32)
  shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t, num_loops=num_loops), dummy)
  return shapes['cache']


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None = None) -> int:
  """Bytes a cache of `batch` rows of `max_len` tokens takes. The size is linear in the
  length, so it is read off caches of 1 and 2 tokens (any length works, nothing is traced at
  `max_len`)."""
  size = lambda n: sum(x.size * x.dtype.itemsize
                       for x in jax.tree.leaves(cache_shapes(cfg, batch, n, num_loops)))
  one, two = size(1), size(2)
  return one + (two - one) * (max_len - 1)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None = None):
  """A zeroed cache for `batch` rows of up to `max_len` tokens."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                      cache_shapes(cfg, batch, max_len, num_loops))


def cache_length(cache) -> int:
  """Slots per row of a cache (k/v leaves are [..., B, S, G, K])."""
  return next(x.shape[-3] for x in jax.tree.leaves(cache) if x.ndim >= 4)


def decode_step(cfg: ModelConfig, params, cache, tokens_BT, num_loops: int | None = None,
                router_bias=None):
  """Feeds a chunk of tokens (a prompt, or one token) and returns (logits_BTV, new cache).
  `router_bias`: the trained router bias (model.router_bias other than 'none').

  Writing past the cache's length raises when the position is concrete; under jit the
  logits of such a step are NaN instead of silently wrong."""
  max_len, pos = cache_length(cache), cache['position']
  end = pos + tokens_BT.shape[1]
  try:
    concrete_end = int(end)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    concrete_end = None  # traced under jit: the NaN below reports it
  if concrete_end is not None and concrete_end > max_len:
    raise ValueError(f'decode_step: position {int(pos)} + {tokens_BT.shape[1]} tokens exceeds '
                     f'the cache length max_len={max_len}')
  (logits, _), mutated = LoopedMoE(cfg, decode=True).apply(
      variables(params, cache=cache, router_bias=router_bias), tokens_BT, num_loops=num_loops,
      mutable=['cache'])
  return jnp.where(end > max_len, jnp.nan, logits), mutated['cache']


def sample(logits_BV, key, temperature: float):
  if temperature <= 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits_BV / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('cfg', 'steps', 'temperature', 'num_loops'))
def generate(cfg: ModelConfig, params, prompt_BT, steps: int, key, temperature: float = 0.0,
             num_loops: int | None = None, router_bias=None):
  """Greedy (temperature 0) or sampled continuation; returns [B, P + steps] tokens."""
  if steps < 1:
    raise ValueError(f'steps={steps}: must be >= 1')
  if jnp.issubdtype(prompt_BT.dtype, jnp.floating):
    raise ValueError('prompt tokens must be integer ids')
  batch, plen = prompt_BT.shape
  cache = init_cache(cfg, batch, plen + steps, num_loops)
  logits, cache = decode_step(cfg, params, cache, prompt_BT, num_loops, router_bias)
  first = sample(logits[:, -1], jax.random.fold_in(key, 0), temperature)

  def body(carry, i):
    cache, tok = carry
    logits, cache = decode_step(cfg, params, cache, tok[:, None], num_loops, router_bias)
    nxt = sample(logits[:, -1], jax.random.fold_in(key, i), temperature)
    return (cache, nxt), tok

  (_, last), toks = jax.lax.scan(body, (cache, first), jnp.arange(1, steps))
  new = jnp.concatenate([toks.T, last[:, None]], axis=1) if steps > 1 else first[:, None]
  return jnp.concatenate([prompt_BT.astype(jnp.int32), new], axis=1)
