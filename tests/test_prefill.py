"""A prompt's prefill into an empty cache (decode.decode_step's empty_cache, what generate,
the batch program, the loop-draft and decode_nll run first): the chunk attends to itself
alone, so its products are [T, T] (or flash's [T, block]) where the cache's are [T, S].

- Its logits and cache are the prefill over the whole cache's, and so is the next step from
  it, under every KV layout and early exit.
- On a cache that holds positions it is refused by name (concrete) or NaN (under jit).
- Compiled, a 512-token prefill into 4,096 slots holds a fraction of the temporaries.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_cfg, rt
from loopmoe_jax.decode import decode_step, init_cache
from loopmoe_jax.model import LoopedMoE, for_init


def _model(**kw):
  cfg = make_cfg(num_kv_heads=2, injection='add', core_layers=1, num_loops=3, **kw)
  v = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  return cfg, v['params']


@pytest.mark.parametrize('kw', [dict(), dict(kv_cache='last_pass'), dict(kv_cache='first_pass'),
                                dict(exit='kl', exit_threshold=1e-3)],
                         ids=['per pass', 'last', 'first', 'early exit'])
@pytest.mark.parametrize('impl', ['auto', 'xla'])
def test_a_prefill_into_an_empty_cache_is_the_prefill_over_the_cache(kw, impl):
  cfg, params = _model(**kw)
  runtime = rt(attention_impl=impl)
  toks = jnp.asarray([[3, 5, 7, 9, 11, 2], [2, 4, 6, 8, 10, 1]], jnp.int32)
  out = {}
  for empty in (True, False):
    step = jax.jit(lambda p, c, t, e=empty: decode_step(cfg, p, c, t, runtime=runtime,
                                                         empty_cache=e))
    first, cache = step(params, init_cache(cfg, 2, 32), toks)
    nxt, cache = decode_step(cfg, params, cache, toks[:, :1], runtime=runtime)
    out[empty] = (first, nxt, cache)
  for a, b in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_empty_cache_on_a_cache_that_holds_positions_is_refused():
  cfg, params = _model()
  toks = jnp.asarray([[3, 5, 7]], jnp.int32)
  _, cache = decode_step(cfg, params, init_cache(cfg, 1, 16), toks)
  with pytest.raises(ValueError, match=r'empty_cache=True but the cache holds positions up to 3'):
    decode_step(cfg, params, cache, toks, empty_cache=True)
  logits, _ = jax.jit(lambda c: decode_step(cfg, params, c, toks, empty_cache=True))(cache)
  assert jnp.isnan(logits).all()


@pytest.mark.parametrize('impl', ['auto', 'xla'])
def test_a_long_prefill_into_an_empty_cache_holds_a_fraction_of_the_temporaries(impl):
  """512 tokens into 4,096 slots (XLA:CPU's compiled program): the products over the whole
  cache hold [B, H, T, S] float32 scores; from an empty cache the whole program's temporaries
  are under half of those (the chunk's own scores S / T = 8 times fewer (xla), or flash's
  blocks (auto: chunked))."""
  cfg, params = _model()
  runtime = rt(attention_impl=impl)
  b, t, s = 2, 512, 4096
  toks = jax.ShapeDtypeStruct((b, t), jnp.int32)
  scores = b * cfg.num_heads * t * s * 4  # the products over the whole cache, float32
  temps = {}
  for empty in (True, False):
    step = jax.jit(lambda p, c, t, e=empty: decode_step(cfg, p, c, t, runtime=runtime,
                                                         empty_cache=e))
    compiled = step.lower(params, init_cache(cfg, b, s), toks).compile()
    temps[empty] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[False] > 0.9 * scores and temps[True] < scores / 2, (temps, scores)
