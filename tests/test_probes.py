"""Mechanistic probes (analysis/probes.py) against explicit per-pass references, and the Dyck
k-shot evaluation (analysis/evals.py) against a stack reference and model-free predictors.

Tiny models as in tests/test_model.py (numpy-drawn params); the probed forward is compiled
once per config and shared (lru_cache in probes.py).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.analysis import evals, probes
from loopmoe_jax.data import synthetic
from loopmoe_jax.runtime import HERE, Runtime

import reference
from helpers import apply_fn, make_cfg, make_params, tokens

CFG = make_cfg(residual_scale='inverse_loops', num_kv_heads=2)
B, T = 2, 7


def _per_head_qkv(cfg, xn, w):
  """Explicit q [B,T,H,K], k/v [B,T,G,K] after RoPE, one head at a time, and the sink
  [B,H]: mean over queries 1..T-1 of the softmax probability on key 0."""
  h_n, g_n = w['q'].shape[1], w['k'].shape[1]
  q = [reference.rotate_half_rope(xn @ w['q'][:, h, :], cfg.rope_theta) for h in range(h_n)]
  k = [reference.rotate_half_rope(xn @ w['k'][:, g, :], cfg.rope_theta) for g in range(g_n)]
  v = [xn @ w['v'][:, g, :] for g in range(g_n)]
  t = xn.shape[1]
  sinks = []
  for h in range(h_n):
    s = np.asarray(jnp.einsum('bik,bjk->bij', q[h], k[h // (h_n // g_n)]), np.float64)
    s = s / math.sqrt(w['q'].shape[2])
    s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    sinks.append(p[:, 1:, 0].mean(-1))
  st = lambda xs: np.stack([np.asarray(x) for x in xs], axis=2)
  return {'q': st(q), 'k': st(k), 'v': st(v), 'sink': np.stack(sinks, axis=1)}


def reference_probes(cfg, params, toks):
  """Per segment and layer, the attention inputs' q/k/v and sink, pass by pass, with the
  slow reference's layers (tests/reference.py) carrying the residual stream."""
  params = nn.unbox(params)
  x = params['embed'][toks].astype(jnp.float32)
  gain = lambda p, n: p[n]['scale'] if cfg.norm_gain else None
  out = {'prelude': [], 'core': [], 'coda': []}

  def visit(p, x, scale):
    xn = reference.rms_norm(x, gain(p, 'attn_norm'), cfg.norm_eps)
    vals = _per_head_qkv(cfg, xn, p['attn'])
    x, _ = reference.layer(cfg, x, p, p['attn'], scale)
    return x, vals

  for i in range(cfg.prelude_layers):
    x, vals = visit(params['prelude'][f'layer_{i}'], x, 1.0)
    out['prelude'].append(vals)
  per = [[] for _ in range(cfg.core_layers)]
  scale = 1.0 / cfg.num_loops if cfg.residual_scale == 'inverse_loops' else 1.0
  for _ in range(cfg.num_loops):
    for i in range(cfg.core_layers):
      x, vals = visit(params['core']['body'][f'layer_{i}'], x, scale)
      per[i].append(vals)
  out['core'] = [{n: np.stack([v[n] for v in pl]) for n in pl[0]} for pl in per]
  for i in range(cfg.coda_layers):
    x, vals = visit(params['coda'][f'layer_{i}'], x, 1.0)
    out['coda'].append(vals)
  return out


def slow_cosine(x_LBTHK):
  """Mean over every (b, t, h) of the cosine between passes l and m, one vector at a time."""
  x = np.asarray(x_LBTHK, np.float64)
  L, Bn, Tn, Hn, _ = x.shape
  out = np.zeros((L, L))
  for l in range(L):
    for m in range(L):
      vals = [x[l, b, t, h] @ x[m, b, t, h] /
              (np.linalg.norm(x[l, b, t, h]) * np.linalg.norm(x[m, b, t, h]))
              for b in range(Bn) for t in range(Tn) for h in range(Hn)]
      out[l, m] = np.mean(vals)
  return out


@pytest.fixture(scope='module')
def probed():
  params, toks = make_params(CFG), tokens(CFG, batch=B, length=T)
  logits, pr = probes.probe_forward(CFG, params, toks, runtime=HERE)
  return params, toks, logits, pr


def test_probing_off_leaves_logits_bit_identical(probed):
  params, toks, logits_on, pr = probed
  # probes read the attention weights, so they run the 'xla' attention whatever
  # run.attention_impl says: bit-identical to that; the default (chunked on CPU) agrees closely
  logits_off, extras = apply_fn(CFG, runtime=Runtime.of(attention_impl='xla'))(params, toks)
  np.testing.assert_array_equal(np.asarray(logits_on), np.asarray(logits_off))
  np.testing.assert_allclose(np.asarray(apply_fn(CFG)(params, toks)[0]), np.asarray(logits_on),
                             rtol=1e-4, atol=1e-5)
  # Without mutable=['intermediates'] nothing is sown: apply returns no state at all.
  out = probes.LoopedMoE(CFG).apply({'params': params}, toks)
  assert isinstance(out, tuple) and len(out) == 2 and set(out[1]) >= {'load_balance'}
  assert 'intermediates' not in out[1]


def test_qkv_and_sink_match_explicit_reference(probed):
  params, toks, _, pr = probed
  ref = reference_probes(CFG, params, toks)
  for seg in ('prelude', 'core', 'coda'):
    for got, want in zip(pr[seg], ref[seg]):
      for n in ('q', 'k', 'v', 'sink'):
        np.testing.assert_allclose(np.asarray(got[n]), want[n], rtol=2e-4, atol=2e-4,
                                   err_msg=f'{seg} {n}')
  sims = probes.qkv_similarity(pr['core'])
  for d, layer_ref in enumerate(ref['core']):
    for n in ('q', 'k', 'v'):
      np.testing.assert_allclose(sims[n][d], slow_cosine(layer_ref[n]), rtol=1e-4, atol=1e-4)
      np.testing.assert_allclose(np.diag(sims[n][d]), 1.0, atol=1e-6)
  sinks = probes.sink_mass(pr)
  assert sinks['core'].shape == (CFG.core_layers, CFG.num_loops)
  for seg in ('prelude', 'core', 'coda'):
    assert np.all((sinks[seg] >= 0) & (sinks[seg] <= 1))
  want_core = np.array([[ref['core'][d]['sink'][l].mean() for l in range(CFG.num_loops)]
                        for d in range(CFG.core_layers)])
  np.testing.assert_allclose(sinks['core'], want_core, rtol=1e-4, atol=1e-5)


def test_cosine_is_one_when_core_is_a_no_op_between_visits():
  """Core writes zeroed (attention output and expert down-projections): every visit sees the
  same residual stream, so q/k/v of a token agree across passes."""
  params = make_params(CFG)

  def zero_core_writes(path, w):
    keys = [getattr(p, 'key', '') for p in path]
    if 'core' in keys and keys[-1] in ('o', 'down'):
      return jnp.zeros_like(w)
    return w
  params = jax.tree_util.tree_map_with_path(zero_core_writes, params)
  _, pr = probes.probe_forward(CFG, params, tokens(CFG, batch=B, length=T), runtime=HERE)
  sims = probes.qkv_similarity(pr['core'])
  for n in ('q', 'k', 'v'):
    np.testing.assert_allclose(sims[n], 1.0, atol=1e-5)
  s = probes.sink_mass(pr)['core']
  np.testing.assert_allclose(s, s[:, :1].repeat(CFG.num_loops, 1), atol=1e-6)


def test_unrolled_loop_gives_the_same_probes(probed):
  params, toks, _, pr = probed
  _, pr_u = probes.probe_forward(CFG, params, toks, runtime=Runtime.of(loop_impl='unroll'))
  for a, b in zip(pr['core'], pr_u['core']):
    for n in ('q', 'v', 'sink'):
      np.testing.assert_allclose(np.asarray(a[n]), np.asarray(b[n]), rtol=1e-5, atol=1e-5)


def test_mechanistic_probes_json_and_ce_gain_buckets(probed):
  params, toks, _, _ = probed
  out = probes.mechanistic_probes(CFG, params, [np.asarray(toks)], runtime=HERE)
  assert np.asarray(out['qkv_cosine']['k']).shape == (CFG.core_layers, 3, 3)
  a = np.arange(24.0).reshape(2, 12) + 1.0
  b = 2 * a
  buckets = probes.ce_gain_by_position(a, b, num_buckets=4)
  assert [x['positions'] for x in buckets] == [[0, 3], [3, 6], [6, 9], [9, 12]]
  for x in buckets:  # b = 2a: relative gain 1/2 everywhere
    assert x['gain'] == pytest.approx(0.5)
    assert x['ce_b'] - x['ce_a'] == pytest.approx(x['diff'])


# ---- Dyck k-shot ----------------------------------------------------------------------------

def stack_closing(word: str) -> str:
  """The sequence closing an unfinished bracket word, by an explicit stack."""
  pairs = {synthetic.BRACKETS[2 * i]: synthetic.BRACKETS[2 * i + 1] for i in range(4)}
  stack = []
  for ch in word:
    if ch in pairs:
      stack.append(ch)
    else:
      assert stack and pairs[stack[-1]] == ch
      stack.pop()
  return ''.join(pairs[c] for c in reversed(stack))


def test_dyck_prompts_close_by_stack_and_shots_are_solved():
  for shots in (0, 1, 4):
    for i in range(20):
      p = evals.dyck_prompt(seed=3, index=i, shots=shots)
      text = bytes(p.tokens.astype(np.uint8)).decode()
      parts = text.split(evals.SEPARATOR)
      assert len(parts) == shots + 1
      for s in parts[:-1]:  # each shot is a complete solved example
        word, ans = s[2:].split('=')
        assert stack_closing(word) == ans and ans
      query = parts[-1]
      word, ans = query[2:].split('=')
      assert ans == p.answer == stack_closing(word)
      assert text[p.answer_start:p.answer_start + len(p.answer)] == p.answer


def test_dyck_oracle_scores_one_constant_scores_zero_and_long_prompts_refused():
  oracle = lambda x_BT: np.concatenate([x_BT[:, 1:], np.zeros_like(x_BT[:, :1])], axis=1)
  constant = lambda x_BT: np.full_like(x_BT, ord(')'))
  res = evals.dyck_accuracy(oracle, shots=(0, 1, 2, 4, 32), examples=16, context=256)
  assert res['0']['accuracy'] == 1.0 and res['4']['accuracy'] == 1.0
  assert 'refused' in res['32'] and 'accuracy' not in res['32']
  res_c = evals.dyck_accuracy(constant, shots=(0, 2), examples=64, context=256)
  # only words whose whole closing is ')' repeated match a constant ')'.
  for s in ('0', '2'):
    assert res_c[s]['accuracy'] < 0.5
  assert res_c['0']['accuracy'] == pytest.approx(np.mean([
      set(evals.dyck_prompt(1234, i, 0).answer) == {')'} for i in range(64)]))


def test_task_accuracy_oracle_and_constant():
  oracle = lambda x_BT: np.concatenate([x_BT[:, 1:], np.zeros_like(x_BT[:, :1])], axis=1)
  for task in ('parity', 'addition', 'induction'):
    assert evals.task_accuracy(oracle, task, examples=16, seq_len=64) == 1.0
    assert evals.task_accuracy(lambda x: np.zeros_like(x), task, examples=16, seq_len=64) == 0.0


def test_ce_gain_by_domain_against_direct_nll(probed):
  params, _, _, _ = probed
  rng = np.random.default_rng(5)
  domains = {'x': rng.integers(0, CFG.vocab_size, 2 * T + 1),
             'y': rng.integers(0, CFG.vocab_size, 3 * T + 4)}
  same = probes.ce_gain_by_domain((CFG, params), (CFG, params), domains, T)
  assert all(g['gain'] == 0.0 and g['tokens'] == n * T for g, n in zip(same.values(), (2, 3)))
  other = make_params(CFG, seed=1)
  got = probes.ce_gain_by_domain((CFG, params), (CFG, other), domains, T)
  x, y = probes.windows(domains['y'], T)
  np.testing.assert_array_equal(x[1], domains['y'][T:2 * T])
  logits, _ = reference.forward(CFG, params, x)
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64), -1)
  nll = -np.take_along_axis(np.asarray(logp), y[..., None], -1).mean()
  assert got['y']['ce_a'] == pytest.approx(nll, rel=1e-4)
