"""Autoregressive decoding with a KV cache.

    cache = init_cache(cfg, batch=2, max_len=64)
    logits, cache = decode_step(cfg, params, cache, prompt_BT)     # prefill
    logits, cache = decode_step(cfg, params, cache, next_B1)       # one token
    tokens = generate(cfg, params, prompt_BT, steps=32, key=key, temperature=0.8)
    rows = batched.generate_batch(cfg, params, [[1, 2], [3]], max_new=32, key=key)   # any lengths
    out = speculative.generate_speculative(cfg, params, prompt_1T, 32, key, draft_loops=1,
                                           lookahead=4)       # loop-draft, plain greedy's tokens
    nll_BT = decode_nll(cfg, params, inputs_BT, targets_BT)        # fed one token at a time

Prelude and coda layers keep one cache slot each. The looped core's layout is
`model.kv_cache`, a decoding option (training and the full-sequence forward never read it, so
a model trained under one decodes under any):

- 'per_pass' (default): one slot per executed (pass, layer), leaves [L, B, G, S, K]. Decoding
  is the full forward exactly, however the text is cut into steps.
- 'last_pass' and 'first_pass': one slot per core layer shared by every pass, leaves
  [B, G, S, K], L times smaller (Huginn's KV-cache sharing with a budget of one entry,
  Geiping et al. 2025, 'Scaling up Test-Time Compute with Latent Reasoning'; the recursive KV
  sharing of Mixture-of-Recursions, Bae et al. 2025). In a step that feeds the tokens of
  positions [s, e) (a prompt, or one token), pass p at core layer l attends to
    * positions < s: the shared slot of layer l, the K/V that the named pass made when those
      tokens were fed (one per position, whatever pass is asking), and
    * positions in [s, e), causally: pass p's own K/V of this step, freshly computed;
  after the step, positions [s, e) of the slot hold this step's K/V of the last pass
  (`last_pass`) or of the first (`first_pass`).
  So: at one pass the three layouts are the same computation. A step only reads earlier
  steps through the shared slot, so a prefill from an empty cache is the full forward
  exactly, and the logits depend on how the text is cut into steps (feeding T tokens one
  at a time is another computation than feeding them in one chunk; tests/test_kv_sharing.py
  checks both against plain references). With `first_pass`, pass 0 only ever reads pass-0
  K/V, as under 'per_pass', so the first pass and the cache are per_pass's exactly; the
  later passes see earlier tokens through the first pass's K/V (Mixture-of-Recursions). With
  `last_pass` every pass sees earlier tokens through the deepest pass's K/V (Huginn).
  Sharing needs one K/V projection for every pass: untied attention (model.tie_attention=
  False) is refused by the config.
  Memory: the cache is the shared one throughout: the core's decode scan (core.Core) carries
  the one slot; under 'last_pass' pass p writes this step's positions there in place and
  reads it, under 'first_pass' only pass 0 writes (the later passes' writes land past the
  cache and are dropped) and each pass reads the slot's earlier positions and its own K/V
  (attention.Attention._cached), so no step copies the slot. Under early exit a step runs on
  L copies that decode_step broadcasts from the slot and reads the named pass's back from
  (early_exit.fill_skipped fills a skipped pass's slot from the exit pass's).

`accounting.count(cfg)['kv_per_token']` and `cache_bytes` follow the layout.

Early exit (model.exit 'kl' | 'gate', early_exit.py) applies in every decode_step: a token stops
looping once its rule fires; the slots of the passes it skipped (this step's positions) are
filled with its last computed pass's K/V (early_exit.fill_skipped, before a shared layout keeps its
pass), and the cache's 'exit' entry counts the passes run and the tokens fed
(`mean_passes`). When every row has exited the remaining passes are skipped, so at batch 1 a
step's time follows the passes the token ran.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from loopmoe_jax import early_exit as early_exit_lib
from loopmoe_jax.attention import decode_kernels
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE, check_loops, for_init, variables
from loopmoe_jax.objective import token_nll_of_logits
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.sampling import Sampling
from pallas_kernels import decode_attention as decode_kernel

CORE = 'core'  # the cache's subtree with a slot per pass, [L, B, G, S, K] (core.Core)


def shares_passes(cfg: ModelConfig) -> bool:
  """The core's cache keeps one slot per layer (model.kv_cache 'last_pass' or 'first_pass')."""
  return cfg.kv_cache != 'per_pass' and cfg.core_layers > 0


def _shared_pass(cfg: ModelConfig) -> int:
  """The pass whose K/V a shared slot keeps (an index into the scan's per-pass axis)."""
  return -1 if cfg.kv_cache == 'last_pass' else 0


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None = None):
  """The cache's leaves as ShapeDtypeStructs (nothing allocated), in model.kv_cache's layout."""
  return jax.tree.map(lambda s: s, _cache_shapes(cfg, batch, max_len, num_loops))


@functools.lru_cache(maxsize=64)
def _cache_shapes(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None):
  """Traces the model once per (config, shape): a generate call asks for the cache's bytes
  and then the cache itself."""
  model = for_init(LoopedMoE(cfg, decode=True))
  dummy = jax.ShapeDtypeStruct((batch, max_len), jnp.int32)
  shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t, num_loops=num_loops), dummy)
  cache = dict(shapes['cache'])
  if cfg.exit != 'none':  # running sums: passes run, tokens fed (mean_passes)
    cache[EXIT] = {k: jax.ShapeDtypeStruct((), jnp.float32) for k in ('passes', 'tokens')}
  if shares_passes(cfg):
    return _with_core(cache, lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype))
  return cache


EXIT = 'exit'  # the cache's early-exit counters (model.exit other than 'none')


def mean_passes(cache) -> float:
  """The core passes run per token fed so far under early exit (model.exit)."""
  stats = cache[EXIT]
  return stats['passes'] / jnp.maximum(stats['tokens'], 1.0)


def _with_core(cache, fn):
  """`cache` with `fn` applied to every leaf of the core's subtree."""
  return {**cache, CORE: jax.tree.map(fn, cache[CORE])}


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None = None) -> int:
  """Bytes a cache of `batch` rows of `max_len` tokens takes. The size is linear in the
  length, so it is read off caches of 1 and 2 tokens (any length works, nothing is traced at
  `max_len`)."""
  size = lambda n: sum(x.size * x.dtype.itemsize
                       for x in jax.tree.leaves(cache_shapes(cfg, batch, n, num_loops)))
  one, two = size(1), size(2)
  return one + (two - one) * (max_len - 1)


def slots_for(cfg: ModelConfig, runtime: Runtime, length: int) -> int:
  """The slots a decoding program allocates for `length` positions: `length`, rounded up to
  whole 128-slot lane tiles where the Pallas decode kernels run (attention.decode_kernels:
  the TPU's serve a slots-minor cache of whole tiles, the GPU's whole key blocks); the slots
  past `length` are never written and the causal mask hides them."""
  if not decode_kernels(runtime.resolved(), cfg):
    return length
  return -(-length // decode_kernel.LANES) * decode_kernel.LANES


def init_cache(cfg: ModelConfig, batch: int, max_len: int, num_loops: int | None = None):
  """A zeroed cache for `batch` rows of up to `max_len` tokens."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                      cache_shapes(cfg, batch, max_len, num_loops))


def cache_length(cache) -> int:
  """Slots per row of a cache (k/v leaves are heads-major, [..., B, G, S, K])."""
  return next(x.shape[-2] for x in jax.tree.leaves(cache) if x.ndim >= 4)


def decode_step(cfg: ModelConfig, params, cache, tokens_BT, num_loops: int | None = None,
                router_bias=None, runtime: Runtime = HERE, empty_cache: bool = False):
  """Feeds a chunk of tokens (a prompt, or one token) and returns (logits_BTV, new cache).
  The cache's 'position' is one for every row (a scalar, init_cache's) or one per row ([B]:
  row b's chunk sits at its own positions, batched.py). `router_bias`: the trained router
  bias (model.router_bias other than 'none'); `runtime`: the model's (its run settings: the
  dispatch backend, ...; runtime.py). The cache is
  in model.kv_cache's layout (init_cache's; what each pass attends to: the module docstring).
  `empty_cache`: the cache holds nothing yet (init_cache's, every position 0: a prompt's
  prefill), so the chunk attends to itself alone (Runtime.empty_cache), not to every slot.

  Writing past the cache's length, or a position other than 0 with `empty_cache`, raises when
  the position is concrete; under jit the logits of such a step are NaN instead of silently
  wrong."""
  early_exit_lib.check_params(cfg, params)
  max_len, pos = cache_length(cache), cache['position']
  end = jnp.max(pos + tokens_BT.shape[1])
  try:
    concrete_end = int(end)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    concrete_end = None  # traced under jit: the NaN below reports it
  if concrete_end is not None and concrete_end > max_len:
    raise ValueError(f'decode_step: position {concrete_end - tokens_BT.shape[1]} + '
                     f'{tokens_BT.shape[1]} tokens exceeds the cache length max_len={max_len}')
  bad = end > max_len
  if empty_cache:
    bad = bad | jnp.any(pos != 0)
    if concrete_end is not None and concrete_end != tokens_BT.shape[1]:
      raise ValueError(f'decode_step: empty_cache=True but the cache holds positions up to '
                       f'{int(jnp.max(pos))}: feed a cache from init_cache, or empty_cache=False')
    runtime = runtime.replace(empty_cache=True)
  shared, passes = shares_passes(cfg), check_loops(cfg, num_loops)
  _check_layout(cfg, cache, shared, passes)
  stacked = shared and cfg.exit != 'none'  # fill_skipped reads a slot per pass
  if stacked:  # each pass's slot a copy of the shared one
    cache = _with_core(cache, lambda x: jnp.broadcast_to(x, (passes,) + x.shape))
  cache = dict(cache)
  counts = cache.pop(EXIT, None)
  (logits, extras), mutated = LoopedMoE(cfg, decode=True, runtime=runtime).apply(
      variables(params, cache=cache, router_bias=router_bias), tokens_BT, num_loops=num_loops,
      mutable=['cache'])
  cache = dict(mutated['cache'])
  if 'exit' in extras:
    passes_BT = extras['exit']['passes_BT']
    cache[CORE] = early_exit_lib.fill_skipped(cache[CORE], passes_BT, pos,
                                              *_fill_tiles(cfg, runtime, cache[CORE]))
    if counts is not None:
      cache[EXIT] = {'passes': counts['passes'] + jnp.sum(passes_BT).astype(jnp.float32),
                     'tokens': counts['tokens'] + jnp.float32(passes_BT.size)}
  if stacked:  # pass p's slot is the shared one with this step's positions holding p's K/V
    cache = _with_core(cache, lambda x: x[_shared_pass(cfg)])
  return jnp.where(bad, jnp.nan, logits), cache


def _fill_tiles(cfg: ModelConfig, runtime: Runtime, core_cache) -> tuple[int, bool]:
  """(tile, slots-minor) of the core's cache where the TPU decode kernels keep it
  (decode_attention.layout_tile, slots_minor), for early_exit.fill_skipped's window;
  (0, False) elsewhere."""
  if decode_kernels(runtime.resolved(), cfg) != 'tpu':
    return 0, False
  k, itemsize = cfg.resolved_head_dim, jax.tree.leaves(core_cache)[0].dtype.itemsize
  return decode_kernel.layout_tile(k, itemsize), decode_kernel.slots_minor(k)


def _check_layout(cfg: ModelConfig, cache, shared: bool, passes: int) -> None:
  """A cache made under another model.kv_cache, or per pass for another pass count, is an
  error naming it (the core's scan writes pass p's slot in place: a missing slot would be
  dropped silently)."""
  if CORE not in cache:
    return
  ndim = {x.ndim for x in jax.tree.leaves(cache[CORE])}
  want = 4 if shared else 5
  if ndim != {want}:
    made = 'a per-pass' if ndim == {5} else 'a shared'
    raise ValueError(f'decode_step: the cache has {made} core layout, but model.kv_cache='
                     f'{cfg.kv_cache!r} needs core leaves of {want} dimensions: make the cache '
                     'with init_cache under the same model.kv_cache')
  made = {x.shape[0] for x in jax.tree.leaves(cache[CORE])}
  if not shared and made != {passes}:
    raise ValueError(f'decode_step: the cache holds {sorted(made)[0]} passes\' slots but '
                     f'num_loops={passes}: make it with init_cache(..., num_loops={passes})')


def sample(logits_BV, key, temperature: float):
  """Greedy (temperature 0) or a draw from softmax(logits / temperature) (sampling.Sampling)."""
  return Sampling(temperature).sample(logits_BV, key)


@functools.partial(jax.jit, static_argnames=('cfg', 'steps', 'temperature', 'num_loops',
                                             'runtime', 'top_k', 'top_p'))
def generate(cfg: ModelConfig, params, prompt_BT, steps: int, key, temperature: float = 0.0,
             num_loops: int | None = None, router_bias=None, runtime: Runtime = HERE,
             top_k: int = 0, top_p: float = 1.0):
  """Greedy (temperature 0) or sampled continuation (sampling.Sampling: temperature, top_k,
  top_p) of prompts of one length; returns [B, P + steps] tokens. Step i draws with
  fold_in(key, i), one key for every row. Prompts of different lengths, stop tokens and
  per-prompt keys: batched.generate_batch; loop-draft speculative decoding (batch 1):
  speculative.generate_speculative."""
  if steps < 1:
    raise ValueError(f'steps={steps}: must be >= 1')
  if jnp.issubdtype(prompt_BT.dtype, jnp.floating):
    raise ValueError('prompt tokens must be integer ids')
  batch, plen = prompt_BT.shape
  cache = init_cache(cfg, batch, slots_for(cfg, runtime, plen + steps), num_loops)
  logits, cache = decode_step(cfg, params, cache, prompt_BT, num_loops, router_bias, runtime,
                              empty_cache=True)
  sampling = Sampling(temperature, top_k, top_p)
  first = sampling.sample(logits[:, -1], jax.random.fold_in(key, 0))

  def body(carry, i):
    cache, tok = carry
    logits, cache = decode_step(cfg, params, cache, tok[:, None], num_loops, router_bias,
                                runtime)
    nxt = sampling.sample(logits[:, -1], jax.random.fold_in(key, i))
    return (cache, nxt), tok

  (_, last), toks = jax.lax.scan(body, (cache, first), jnp.arange(1, steps))
  new = jnp.concatenate([toks.T, last[:, None]], axis=1) if steps > 1 else first[:, None]
  return jnp.concatenate([prompt_BT.astype(jnp.int32), new], axis=1)


@functools.partial(jax.jit, static_argnames=('cfg', 'num_loops', 'prefill', 'runtime'))
def decode_nll(cfg: ModelConfig, params, inputs_BT, targets_BT, num_loops: int | None = None,
               router_bias=None, prefill: int = 1, runtime: Runtime = HERE):
  """Per-token negative log-likelihood [B, T] (float32, nats) of `targets_BT` when `inputs_BT`
  is fed through decode_step: its first `prefill` tokens as one chunk, then one token a step
  (teacher forcing). Under model.kv_cache='per_pass' this is the full forward's NLL; under a
  shared layout, what a decoder reading the shared cache predicts (scripts/evaluate.py
  --kv_cache compares the layouts on held-out text)."""
  batch, length = inputs_BT.shape
  if not 1 <= prefill <= length:
    raise ValueError(f'prefill={prefill}: must lie in [1, {length}] (the tokens given)')
  cache = init_cache(cfg, batch, slots_for(cfg, runtime, length), num_loops)
  first_BPV, cache = decode_step(cfg, params, cache, inputs_BT[:, :prefill], num_loops,
                                 router_bias, runtime, empty_cache=True)

  def body(cache, tok_B):
    logits_B1V, cache = decode_step(cfg, params, cache, tok_B[:, None], num_loops, router_bias,
                                    runtime)
    return cache, logits_B1V[:, 0]

  _, rest_TBV = jax.lax.scan(body, cache, inputs_BT[:, prefill:].T)
  logits_BTV = jnp.concatenate([first_BPV, rest_TBV.transpose(1, 0, 2)], axis=1)
  return token_nll_of_logits(logits_BTV, targets_BT.astype(jnp.int32))
