"""A slow, obvious reference forward of the looped MoE model, in plain jax.numpy.

Written independently of the library's modules: it reads the param tree (unboxed with
`flax.linen.unbox`) and a ModelConfig, and does every step with explicit Python loops over
layers, passes, heads and experts. Nothing here calls loopmoe_jax code except to read the
config's fields.

    logits_BTV, visits = forward(cfg, params, tokens_BT)

`visits` lists every MoE visit of the unrolled depth in execution order, each a dict with
'segment', 'pass', 'layer', 'logits' [B, T, E], 'experts' [B, T, k], 'load_balance', 'z_loss'.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def rms_norm(x, scale, eps):
  x = x.astype(jnp.float32)
  ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  y = x / jnp.sqrt(ms + eps)
  if scale is not None:
    y = y * scale
  return y


def rotate_half_rope(x_TK, theta):
  """RoPE at positions 0..T-1 on one head, x_TK [B, T, K], rotate-half pairing (i, i + K/2)."""
  t, k = x_TK.shape[-2], x_TK.shape[-1]
  half = k // 2
  inv_freq = jnp.array([theta ** (-(2.0 * i) / k) for i in range(half)], jnp.float32)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, K/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  first, second = x_TK[..., :half], x_TK[..., half:]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(cfg, x_BTD, w):
  """Causal softmax attention, one head at a time; head h reads kv group h // (H / G)."""
  num_heads = w['q'].shape[1]
  num_kv = w['k'].shape[1]
  head_k = w['q'].shape[2]
  group = num_heads // num_kv
  t = x_BTD.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  out = jnp.zeros(x_BTD.shape, jnp.float32)
  for h in range(num_heads):
    g = h // group
    q = rotate_half_rope(x_BTD @ w['q'][:, h, :], cfg.rope_theta)
    k = rotate_half_rope(x_BTD @ w['k'][:, g, :], cfg.rope_theta)
    v = x_BTD @ w['v'][:, g, :]
    scores = jnp.einsum('bik,bjk->bij', q, k) / math.sqrt(head_k)
    scores = jnp.where(causal[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = out + jnp.einsum('bij,bjk->bik', probs, v) @ w['o'][h]
  return out


def swiglu(x, p):
  return (jax.nn.silu(x @ p['gate']) * (x @ p['up'])) @ p['down']


def moe(cfg, x_BTD, p):
  """Router in float32, softmax over all experts, top-k, loop over experts; plus shared."""
  b, t, d = x_BTD.shape
  x_ND = x_BTD.reshape(b * t, d).astype(jnp.float32)
  num_experts = p['router'].shape[1]
  logits = x_ND @ p['router'].astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  chosen = jnp.argsort(-probs, axis=-1, stable=True)[:, :cfg.top_k]           # [N, k]
  weights = jnp.take_along_axis(probs, chosen, axis=-1)
  if cfg.renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  y = jnp.zeros_like(x_ND)
  counts = []
  for e in range(num_experts):
    pe = {n: p[n][e] for n in ('gate', 'up', 'down')}
    w_e = jnp.sum(jnp.where(chosen == e, weights, 0.0), axis=-1)             # [N]
    y = y + w_e[:, None] * swiglu(x_ND, pe)
    counts.append(jnp.sum(chosen == e))
  if 'shared' in p:
    y = y + swiglu(x_ND, p['shared'])
  f = jnp.stack(counts).astype(jnp.float32) / (b * t * cfg.top_k)
  mean_prob = jnp.mean(probs, axis=0)
  stats = dict(load_balance=num_experts * jnp.sum(f * mean_prob),
               z_loss=jnp.mean(jnp.square(jax.scipy.special.logsumexp(logits, axis=-1))),
               experts=chosen.reshape(b, t, -1), logits=logits.reshape(b, t, -1))
  return y.reshape(b, t, d), stats


def layer(cfg, x, p, attn_w, scale):
  """Pre-norm attention and feed-forward; each residual write multiplied by `scale`."""
  gain = lambda name: p[name]['scale'] if cfg.norm_gain else None
  x = x + scale * attention(cfg, rms_norm(x, gain('attn_norm'), cfg.norm_eps), attn_w)
  u = rms_norm(x, gain('mlp_norm'), cfg.norm_eps)
  if 'moe' in p:
    h, stats = moe(cfg, u, p['moe'])
  else:
    h, stats = swiglu(u, p['mlp']), None
  return x + scale * h, stats


def forward(cfg, params, tokens_BT=None, num_loops=None, x_BTD=None):
  """The whole model, one explicit step at a time. Returns (logits_BTV, visits)."""
  params = nn.unbox(params)
  passes = cfg.num_loops if num_loops is None else num_loops
  x = params['embed'][tokens_BT] if x_BTD is None else x_BTD
  x = x.astype(jnp.float32)
  visits = []

  def run_layer(seg, l, i, x, p, attn_w, scale):
    x, stats = layer(cfg, x, p, attn_w, scale)
    if stats is not None:
      visits.append(dict(segment=seg, **{'pass': l}, layer=i, **stats))
    return x

  for i in range(cfg.prelude_layers):
    p = params['prelude'][f'layer_{i}']
    x = run_layer('prelude', 0, i, x, p, p['attn'], 1.0)

  if cfg.core_layers:
    core = params['core']
    body = core['body']
    r = passes if cfg.scale_passes == 'executed' else cfg.num_loops
    scale = 1.0 / r if cfg.residual_scale == 'inverse_loops' else 1.0
    e = x  # the prelude output, injected into every pass
    for l in range(passes):
      if cfg.injection == 'add':
        x = x + e
      elif cfg.injection == 'concat':
        x = x @ body['inject'][0] + e @ body['inject'][1]
      for i in range(cfg.core_layers):
        p = body[f'layer_{i}']
        if cfg.tie_attention:
          attn_w = p['attn']
        else:
          attn_w = {n: core[f'pass_attn_{i}'][n][l] for n in ('q', 'k', 'v', 'o')}
        x = run_layer('core', l, i, x, p, attn_w, scale)

  for i in range(cfg.coda_layers):
    p = params['coda'][f'layer_{i}']
    x = run_layer('coda', 0, i, x, p, p['attn'], 1.0)

  x = rms_norm(x, params['final_norm']['scale'] if cfg.norm_gain else None, cfg.norm_eps)
  if cfg.tie_embeddings:
    logits = x @ params['embed'].T / math.sqrt(cfg.d_model)
  else:
    logits = x @ params['head']
  return logits, visits


def gmm_numpy(lhs, rhs, sizes):
  """Grouped matmul in numpy: rows of group g = lhs rows of g @ rhs[g]; rows past sum(sizes)
  stay zero (jax.lax.ragged_dot semantics)."""
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, n in enumerate(sizes):
    out[start:start + n] = lhs[start:start + n] @ rhs[g]
    start += n
  return out


def cuda_devices():
  """The CUDA devices here ([] on a CPU-only jax)."""
  try:
    return jax.devices('gpu')
  except RuntimeError:
    return []


requires_gpu = pytest.mark.skipif(
    not cuda_devices(),
    reason='needs a CUDA device; tests/conftest.py pins CPU, so run scripts/gpu_check.sh '
           '(pytest --noconftest -m gpu) on a GPU machine')


def as64(a):
  """Any array (bf16 too) as a float64 numpy array."""
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def assert_close(got, want, tol, what=''):
  """max |got - want| <= tol * max |want| (scale floored at 1e-6), shapes equal."""
  got, want = as64(got), as64(want)
  assert got.shape == want.shape, f'{what}: shape {got.shape} != {want.shape}'
  scale = max(np.abs(want).max(initial=0.0), 1e-6)
  err = np.abs(got - want).max(initial=0.0) / scale
  assert err <= tol, f'{what}: max error {err:.3g} of scale {scale:.3g} > {tol}'
