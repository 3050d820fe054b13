"""KV sharing across passes at decode (model.kv_cache, decode.py): 'per_pass' keeps one cache
slot per executed (pass, layer); 'last_pass' / 'first_pass' keep one per core layer, holding
the last (Huginn, Geiping et al. 2025) or the first (Mixture-of-Recursions, Bae et al. 2025)
pass's K/V.

The library is checked against `SharedKVDecoder`, a slow decoder in plain jax.numpy with
explicit per-slot K/V bookkeeping (Python loops over segments, passes, layers and heads; it
reads the param tree and the config's fields only), which is itself checked against the full
forward of tests/reference.py under 'per_pass'. Tiny configs; every test compares numbers.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.accounting import count
from loopmoe_jax.config import KV_CACHES, ModelConfig, model_config_dict
from loopmoe_jax.decode import (cache_bytes, cache_shapes, decode_nll, decode_step, generate,
                                init_cache)

import reference
from helpers import (B, T, apply_fn, decode_all, decode_step_fn, make_cfg, make_params, rt,
                     tokens)

SHARED = ('last_pass', 'first_pass')
# Tied core of 2 passes with GQA, 'add' injection and SMELT's 1/r: everything decode touches.
TWO_PASSES = dict(num_loops=2, injection='add', num_kv_heads=2, residual_scale='inverse_loops')
REF = rt(dispatch='reference')  # TWO_PASSES's runtime: the reference dispatch


def assert_close(actual, desired, tol=1e-4):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), rtol=tol, atol=tol)


# The slow reference decoder ------------------------------------------------------------------

def rope_at(x_BTK, pos_T, theta):
  """Rotate-half RoPE of one head at the given absolute positions."""
  k = x_BTK.shape[-1]
  half = k // 2
  inv_freq = jnp.array([theta ** (-(2.0 * i) / k) for i in range(half)], jnp.float32)
  angle = jnp.asarray(pos_T, jnp.float32)[:, None] * inv_freq[None, :]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  first, second = x_BTK[..., :half], x_BTK[..., half:]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class SharedKVDecoder:
  """Feeds chunks of tokens like decode_step, keeping K/V lists by hand:

  - prelude and coda: slot (segment, layer); core under 'per_pass': slot (core, pass, layer);
    core under 'last_pass' / 'first_pass': slot (core, layer), shared by the passes.
  - a chunk at positions [s, e): each attention reads its slot's K/V for positions < s and
    its own fresh K/V for [s, e) (causally); then [s, e) of the slot is written with this
    chunk's K/V: its own for a slot of its own, the last or the first pass's for a shared one.
  """

  def __init__(self, cfg: ModelConfig, params, keep: str, num_loops: int | None = None):
    self.cfg, self.p, self.keep = cfg, nn.unbox(params), keep
    self.passes = num_loops or cfg.num_loops
    self.slots: dict[tuple, tuple[jax.Array, jax.Array]] = {}  # slot -> (K, V) [B, s, G, K]
    self.pos = 0

  def _attention(self, x_BTD, w, slot):
    """Returns (attention output, this chunk's K and V [B, T, G, K]); reads slot < pos."""
    b, t, _ = x_BTD.shape
    heads, groups, hk = w['q'].shape[1], w['k'].shape[1], w['q'].shape[2]
    pos = self.pos + np.arange(t)
    ks = [rope_at(x_BTD @ w['k'][:, g, :], pos, self.cfg.rope_theta) for g in range(groups)]
    vs = [x_BTD @ w['v'][:, g, :] for g in range(groups)]
    past_k, past_v = self.slots.get(slot, (jnp.zeros((b, 0, groups, hk)),) * 2)
    assert past_k.shape[1] == self.pos, 'a slot holds every earlier position'
    # key j < pos is an earlier step's (seen by every query); key pos + j is this chunk's
    allowed = np.concatenate([np.ones((t, self.pos), bool), np.tril(np.ones((t, t), bool))], 1)
    out = jnp.zeros(x_BTD.shape, jnp.float32)
    for h in range(heads):
      g = h // (heads // groups)
      q = rope_at(x_BTD @ w['q'][:, h, :], pos, self.cfg.rope_theta)
      keys = jnp.concatenate([past_k[:, :, g], ks[g]], axis=1)
      vals = jnp.concatenate([past_v[:, :, g], vs[g]], axis=1)
      scores = jnp.einsum('bik,bjk->bij', q, keys) / math.sqrt(hk)
      probs = jax.nn.softmax(jnp.where(allowed[None], scores, -jnp.inf), axis=-1)
      out = out + jnp.einsum('bij,bjk->bik', probs, vals) @ w['o'][h]
    return out, jnp.stack(ks, axis=2), jnp.stack(vs, axis=2)

  def _layer(self, x, p, slot, scale, writes):
    c = self.cfg
    gain = lambda name: p[name]['scale'] if c.norm_gain else None
    h, k, v = self._attention(reference.rms_norm(x, gain('attn_norm'), c.norm_eps), p['attn'],
                              slot)
    writes.append((slot, k, v))
    x = x + scale * h
    u = reference.rms_norm(x, gain('mlp_norm'), c.norm_eps)
    ffn = reference.moe(c, u, p['moe'])[0] if 'moe' in p else reference.swiglu(u, p['mlp'])
    return x + scale * ffn

  def feed(self, tokens_BT):
    """Logits [B, T, V] of a chunk, then the slots written."""
    c, p = self.cfg, self.p
    assert c.tie_attention and c.injection in ('none', 'add')
    x = p['embed'][tokens_BT].astype(jnp.float32)
    writes = []  # (slot, K, V) in execution order
    for i in range(c.prelude_layers):
      x = self._layer(x, p['prelude'][f'layer_{i}'], ('prelude', i), 1.0, writes)
    r = self.passes if c.scale_passes == 'executed' else c.num_loops
    scale = 1.0 / r if c.residual_scale == 'inverse_loops' else 1.0
    e = x
    for l in range(self.passes):
      if c.injection == 'add':
        x = x + e
      for i in range(c.core_layers):
        slot = ('core', l, i) if self.keep == 'per_pass' else ('core', i)
        pass_writes = []
        x = self._layer(x, p['core']['body'][f'layer_{i}'], slot, scale, pass_writes)
        keeps = self.keep == 'per_pass' or l == (self.passes - 1 if self.keep == 'last_pass'
                                                 else 0)
        writes += pass_writes if keeps else []
    for i in range(c.coda_layers):
      x = self._layer(x, p['coda'][f'layer_{i}'], ('coda', i), 1.0, writes)
    x = reference.rms_norm(x, p['final_norm']['scale'] if c.norm_gain else None, c.norm_eps)
    logits = x @ (p['embed'].T / math.sqrt(c.d_model) if c.tie_embeddings else p['head'])
    assert len({s for s, _, _ in writes}) == len(writes), 'each slot written once a step'
    for slot, k, v in writes:
      old_k, old_v = self.slots.get(slot, (k[:, :0], v[:, :0]))
      self.slots[slot] = (jnp.concatenate([old_k, k], 1), jnp.concatenate([old_v, v], 1))
    self.pos += tokens_BT.shape[1]
    return logits


def reference_decode(cfg, params, toks, prefix, keep, num_loops=None):
  """Logits of `toks` fed as a chunk of `prefix` tokens, then one token at a time."""
  dec = SharedKVDecoder(cfg, params, keep, num_loops)
  out = [dec.feed(toks[:, :prefix])]
  out += [dec.feed(toks[:, t:t + 1]) for t in range(prefix, toks.shape[1])]
  return jnp.concatenate(out, axis=1), dec


# The library's decoding ----------------------------------------------------------------------

step_fn = decode_step_fn


def core_kv(cache, layer=0):
  """A core layer's cache entries {'k', 'v'} as [..., B, S, G, K], the reference's layout (the
  cache keeps them heads-major, [..., B, G, S, K])."""
  kv = cache['core']['body'][f'layer_{layer}']['attention']
  return {n: jnp.swapaxes(x, -3, -2) for n, x in kv.items()}


# 1. The cache and the accounting ---------------------------------------------------------------

def _entries(cache, segment=None):
  return sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]
             if x.ndim >= 4 and (segment is None or path[0].key == segment))


@pytest.mark.parametrize('num_loops', [2, 3])
def test_cache_shrinks_by_the_pass_count_in_the_core_and_accounting_follows(num_loops):
  base = make_cfg(num_loops=num_loops, num_kv_heads=2)
  batch, length = 2, 5
  per_pass = init_cache(base, batch, length)
  itemsize = jnp.dtype(base.dtype).itemsize
  for keep in KV_CACHES:
    cfg = base.replace(kv_cache=keep)
    real = init_cache(cfg, batch, length)
    core_share = _entries(per_pass, 'core') // (1 if keep == 'per_pass' else num_loops)
    assert _entries(real, 'core') == core_share
    for seg in ('prelude', 'coda'):  # their own slots, unchanged
      assert _entries(real, seg) == _entries(per_pass, seg) > 0
    # the accounting is the real cache's entries per token, and cache_bytes its bytes
    assert count(cfg)['kv_per_token'] * batch * length == _entries(real)
    assert cache_bytes(cfg, batch, length) == sum(x.nbytes for x in jax.tree.leaves(real))
    assert (cache_bytes(cfg, batch, 4 * length) - cache_bytes(cfg, batch, length) ==
            3 * length * batch * count(cfg)['kv_per_token'] * itemsize)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), cache_shapes(cfg, batch, length)) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), real)
  saved = count(base)['kv_per_token'] - count(base.replace(kv_cache='last_pass'))['kv_per_token']
  assert saved == base.core_layers * (num_loops - 1) * 2 * base.kv_heads * base.resolved_head_dim


def test_shared_cache_does_not_grow_with_test_time_passes():
  """Test-time recurrence (a tied core run for more passes than trained) grows a per_pass
  cache with the passes; a shared one stays one slot per layer."""
  cfg = make_cfg(num_loops=2)
  for n in (1, 2, 6):
    grows = cache_bytes(cfg, 1, 8, num_loops=n)
    flat = cache_bytes(cfg.replace(kv_cache='last_pass'), 1, 8, num_loops=n)
    assert flat == cache_bytes(cfg.replace(kv_cache='last_pass'), 1, 8)
    slot = 8 * 2 * cfg.kv_heads * cfg.resolved_head_dim * jnp.dtype(cfg.dtype).itemsize  # one layer's
    assert grows - flat == (n - 1) * cfg.core_layers * slot


@pytest.mark.parametrize('keep', SHARED)
def test_a_shared_decode_step_holds_no_copy_of_the_slot(keep):
  """The core's decode scan carries the one shared slot (each pass writes its rows there,
  'first_pass' lets pass 0 alone write them): a compiled step's temporaries stay under half
  the core's cache, where a slot per pass broadcast for the scan held L = 4 copies of it."""
  cfg = make_cfg(num_loops=4, num_kv_heads=2, kv_cache=keep)
  params, cache = make_params(cfg), init_cache(cfg, 2, 4096)
  step = jax.jit(lambda p, c, t: decode_step(cfg, p, c, t), donate_argnums=1)
  compiled = step.lower(params, cache, jnp.zeros((2, 1), jnp.int32)).compile()
  core = sum(x.nbytes for x in jax.tree.leaves(cache['core']))
  assert compiled.memory_analysis().temp_size_in_bytes < core / 2


# 2. Decoding against the references ------------------------------------------------------------

def test_reference_decoder_per_pass_is_the_full_forward():
  """The slow decoder's bookkeeping, checked where the answer is known: one slot per (pass,
  layer) gives the full forward (tests/reference.py) however the text is cut."""
  cfg = make_cfg(**TWO_PASSES)
  params, toks = make_params(cfg), tokens(cfg)
  want, _ = reference.forward(cfg, params, toks)
  got, _ = reference_decode(cfg, params, toks, prefix=2, keep='per_pass')
  assert_close(got, want)


@pytest.mark.parametrize('keep', SHARED)
def test_one_pass_shares_nothing(keep):
  """At one pass (a 1-pass model, or a 3-pass tied model run at num_loops=1) the shared
  layouts are per_pass's computation and cache: 'last_pass' bit for bit, 'first_pass' to
  rounding (its reads sum the slot's earlier positions and the chunk's own as two parts)."""
  for cfg, n in ((make_cfg(num_loops=1, num_kv_heads=2), None),
                 (make_cfg(num_loops=3, num_kv_heads=2), 1)):
    params, toks = make_params(cfg), tokens(cfg)
    want, want_cache = decode_all(cfg, params, toks, prefix=2, num_loops=n)
    got, cache = decode_all(cfg.replace(kv_cache=keep), params, toks, prefix=2, num_loops=n)
    same = (np.testing.assert_array_equal if keep == 'last_pass' else
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5))
    same(np.asarray(got), np.asarray(want))
    for kv in ('k', 'v'):
      same(np.asarray(core_kv(cache)[kv]), np.asarray(core_kv(want_cache)[kv][0]))


@pytest.mark.parametrize('keep', SHARED)
def test_prefill_from_an_empty_cache_is_the_full_forward(keep):
  """Within a step every pass reads its own fresh K/V, so a prefill of the whole text is the
  full forward exactly; the shared slot then holds the named pass's K/V of per_pass's."""
  cfg = make_cfg(**TWO_PASSES, kv_cache=keep)
  params, toks = make_params(cfg), tokens(cfg)
  full, _ = apply_fn(cfg.replace(kv_cache='per_pass'), runtime=REF)(params, toks)
  per_pass = cfg.replace(kv_cache='per_pass')
  _, want_cache = step_fn(per_pass, runtime=REF)(params, init_cache(per_pass, B, T), toks)
  logits, cache = step_fn(cfg, runtime=REF)(params, init_cache(cfg, B, T), toks)
  assert_close(logits, full)
  index = -1 if keep == 'last_pass' else 0
  for i in range(cfg.core_layers):
    for kv in ('k', 'v'):
      assert_close(core_kv(cache, i)[kv], core_kv(want_cache, i)[kv][index])


@pytest.mark.parametrize('keep', SHARED)
def test_token_by_token_decoding_matches_the_slow_reference(keep):
  """2 passes, a prompt of 2 tokens then one token a step: the logits, the shared cache and
  decode_nll equal the slow decoder's; and they are not the full forward's (the earlier
  tokens are seen through one pass's K/V), by more than rounding."""
  cfg = make_cfg(**TWO_PASSES, kv_cache=keep)
  params, toks = make_params(cfg), tokens(cfg)
  want, dec = reference_decode(cfg, params, toks, prefix=2, keep=keep)
  got, cache = decode_all(cfg, params, toks, prefix=2, runtime=REF)
  assert_close(got, want)
  for i in range(cfg.core_layers):
    assert_close(core_kv(cache, i)['k'], dec.slots[('core', i)][0])
    assert_close(core_kv(cache, i)['v'], dec.slots[('core', i)][1])
  targets = jnp.roll(toks, -1, axis=1)
  nll = decode_nll(cfg, params, toks, targets, prefill=2, runtime=REF)
  want_nll = -jnp.take_along_axis(jax.nn.log_softmax(want), targets[..., None], -1)[..., 0]
  assert_close(nll, want_nll)
  full, _ = apply_fn(cfg.replace(kv_cache='per_pass'), runtime=REF)(params, toks)
  assert np.abs(np.asarray(got[:, 2:]) - np.asarray(full[:, 2:])).max() > 1e-3
  assert_close(got[:, :2], full[:, :2])  # the prefill is the full forward's


def test_first_pass_keeps_per_pass_first_pass_and_last_pass_differs():
  """first_pass: pass 0 only ever reads pass-0 K/V, so its cache is per_pass's pass-0 slots
  after any sequence of steps; last_pass's is not per_pass's last slots once a step reads
  the shared cache (3 passes, one token a step)."""
  cfg = make_cfg(**{**TWO_PASSES, 'num_loops': 3})
  params, toks = make_params(cfg), tokens(cfg)
  _, per_pass = decode_all(cfg, params, toks, prefix=1, runtime=REF)
  _, first = decode_all(cfg.replace(kv_cache='first_pass'), params, toks, prefix=1, runtime=REF)
  _, last = decode_all(cfg.replace(kv_cache='last_pass'), params, toks, prefix=1, runtime=REF)
  for i in range(cfg.core_layers):
    assert_close(core_kv(first, i)['k'], core_kv(per_pass, i)['k'][0])
    assert_close(core_kv(first, i)['v'], core_kv(per_pass, i)['v'][0])
    gap = np.abs(np.asarray(core_kv(last, i)['k'] - core_kv(per_pass, i)['k'][-1]))
    assert gap[:, 0].max() < 1e-5 < gap[:, 1:].max()  # position 0 was a prefill
  assert_close(first['prelude']['layer_0']['attention']['k'],
               per_pass['prelude']['layer_0']['attention']['k'])


def test_per_pass_decode_nll_is_the_full_forward_loss():
  cfg = make_cfg(**TWO_PASSES)
  params, toks = make_params(cfg), tokens(cfg)
  targets = jnp.roll(toks, -1, axis=1)
  full, _ = apply_fn(cfg, runtime=REF)(params, toks)
  want = -jnp.take_along_axis(jax.nn.log_softmax(full), targets[..., None], -1)[..., 0]
  assert_close(decode_nll(cfg, params, toks, targets, runtime=REF), want)


@pytest.mark.parametrize('keep', SHARED)
def test_generate_greedy_with_a_shared_cache_matches_the_reference(keep):
  cfg = make_cfg(**TWO_PASSES, kv_cache=keep)
  params = make_params(cfg)
  prompt, steps = tokens(cfg, seed=7, length=3), 3
  got = generate(cfg, params, prompt, steps=steps, key=jax.random.key(0), runtime=REF)
  dec = SharedKVDecoder(cfg, params, keep)
  want, logits = [np.asarray(prompt)], dec.feed(prompt)
  for _ in range(steps):
    nxt = np.argmax(np.asarray(logits[:, -1]), axis=-1).astype(np.int32)[:, None]
    want.append(nxt)
    logits = dec.feed(jnp.asarray(nxt))
  np.testing.assert_array_equal(np.asarray(got), np.concatenate(want, axis=1))


# 3. Bad input ----------------------------------------------------------------------------------

def test_bad_kv_cache_is_refused_naming_the_key():
  with pytest.raises(ValueError, match=r"model\.kv_cache='last'.*per_pass.*last_pass.*first_pass"):
    make_cfg(kv_cache='last')
  with pytest.raises(ValueError, match=r"model\.kv_cache='last_pass'.*tie_attention.*"
                                       r"model\.kv_cache='per_pass'"):
    make_cfg(tie_attention=False, kv_cache='last_pass')
  with pytest.raises(ValueError, match=r'model\.kv_cache'):  # the config files' path too
    model_config_dict(tie_attention=False, kv_cache='first_pass')
  make_cfg(tie_attention=False, num_loops=1, kv_cache='first_pass')  # one pass: nothing shared
  # a cache made under another layout, before any compute
  cfg = make_cfg(**TWO_PASSES)
  params, toks = make_params(cfg), tokens(cfg)
  with pytest.raises(ValueError, match=r"per-pass core layout.*model\.kv_cache='last_pass'"):
    decode_step(cfg.replace(kv_cache='last_pass'), params, init_cache(cfg, B, T), toks,
                runtime=REF)
  # a per-pass cache made for another pass count (its missing slots would be dropped)
  with pytest.raises(ValueError, match=r"the cache holds 2 passes' slots but num_loops=4: "
                                       r'make it with init_cache\(\.\.\., num_loops=4\)'):
    decode_step(cfg, params, init_cache(cfg, B, T), toks, num_loops=4, runtime=REF)
  decode_step(cfg, params, init_cache(cfg, B, T, num_loops=4), toks, num_loops=4, runtime=REF)
