"""Loop-draft speculative decoding (speculative.py, pass_range.py, sampling.py).

- the forward cut at pass d (prelude + passes < d, then passes >= d + coda + head) is
  decode_step's, logits and cache, under untied attention, injections and a per-pass bias;
- greedy speculative output is plain greedy's token for token at every d < L;
- the acceptance rule's output distribution, computed exactly from a tiny model's own draft
  and target probabilities (temperature, top-k, top-p), is the target's;
- the settings it cannot serve exactly are refused with one line naming them.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax import pass_range as pr
from loopmoe_jax.decode import decode_step, generate, init_cache
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.sampling import Sampling, accept_draft, output_distribution
from loopmoe_jax.speculative import check_speculative, generate_speculative, stats_summary

from helpers import make_cfg, rt

RT = rt()
LOOPS = 3


def _init(cfg, seed=0):
  v = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32)))
  bias = v.get('router_bias')
  if bias is not None:  # a trained-looking bias: not zeros
    bias = jax.tree.map(lambda b: 0.3 * jax.random.normal(jax.random.key(7), b.shape), bias)
  return v['params'], bias


@pytest.fixture(scope='module')
def tiny():
  cfg = make_cfg(num_loops=LOOPS, injection='add', router_bias='per_pass')
  params, bias = _init(cfg)
  return cfg, params, bias


@pytest.mark.parametrize('kw', [dict(tie_attention=False, injection='concat',
                                     residual_scale='inverse_loops'),
                                dict(router_bias='per_pass', injection='add', num_kv_heads=2,
                                     coda_layers=0)])
def test_cut_forward_is_decode_step(kw):
  cfg = make_cfg(**kw)
  params, bias = _init(cfg)
  toks = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
  ref1, ref_cache = decode_step(cfg, params, init_cache(cfg, 2, 9), toks[:, :5],
                                router_bias=bias, runtime=RT)
  ref2, ref_cache = decode_step(cfg, params, ref_cache, toks[:, 5:], router_bias=bias,
                                runtime=RT)
  for d in range(cfg.num_loops):
    got, cache = _cut_decode(cfg, params, bias, toks, jnp.int32(d))
    np.testing.assert_allclose(got[0], ref1, atol=1e-6)
    np.testing.assert_allclose(got[1], ref2, atol=1e-6)
    drop = lambda c: {k: v for k, v in c.items() if k != 'position'}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), drop(cache),
                 drop(ref_cache))


@functools.partial(jax.jit, static_argnames='cfg')
def _cut_decode(cfg, params, bias, toks, d):
  """Two chunks (5 tokens, then 2) fed through the forward cut at pass `d` (traced)."""
  pf = pr.PassForward.of(cfg, params, bias, RT)
  cache, got = init_cache(cfg, 2, 9), []
  for start, chunk in ((0, toks[:, :5]), (5, toks[:, 5:])):
    front = pr.run_front(pf, cache, chunk, start, d)
    logits, cache = pr.run_back(pf, front.cache, front.h_BTD, front.e_BTD, start, d)
    got.append(logits)
  return got, cache


def test_greedy_is_plain_greedy_at_every_draft_depth(tiny):
  cfg, params, bias = tiny
  prompts = jax.random.randint(jax.random.key(3), (3, 1, 5), 0, cfg.vocab_size)
  for prompt in prompts:
    plain = generate(cfg, params, prompt, 20, jax.random.key(0), router_bias=bias, runtime=RT)
    for d in range(LOOPS):
      out = generate_speculative(cfg, params, prompt, 20, jax.random.key(0), draft_loops=d,
                                 lookahead=3, router_bias=bias, runtime=RT)
      np.testing.assert_array_equal(out.tokens, plain, err_msg=f'draft_loops={d}')
      assert int(out.length) == 20
      s = stats_summary(jax.device_get(out.stats), d, 3, LOOPS)
      assert 0 <= s['acceptance'] <= 1 and 1 <= s['tokens_per_round'] <= 4


@functools.partial(jax.jit, static_argnames='cfg')
def _draft_and_target(cfg, params, bias, prompt, d):
  """The draft's logits (d passes + coda + head) and the full model's after `prompt`."""
  target, _ = decode_step(cfg, params, init_cache(cfg, 1, 8), prompt, router_bias=bias,
                          runtime=RT)
  pf = pr.PassForward.of(cfg, params, bias, RT)
  front = pr.run_front(pf, init_cache(cfg, 1, 8), prompt, 0, d)
  draft, _ = pr.run_readout(pf, front.cache, front.h_BTD, 0)
  return draft[0, -1], target[0, -1]


@pytest.fixture(scope='module')
def draft_target(tiny):
  """(q_logits, p_logits) at every draft depth d, after one prompt of the tiny model."""
  cfg, params, bias = tiny
  prompt = jax.random.randint(jax.random.key(5), (1, 4), 0, cfg.vocab_size)
  return [_draft_and_target(cfg, params, bias, prompt, jnp.int32(d)) for d in range(LOOPS)]


SAMPLINGS = [Sampling(1.0), Sampling(0.7, top_k=6), Sampling(1.3, top_p=0.8),
             Sampling(0.9, top_k=10, top_p=0.9)]


@pytest.mark.parametrize('sampling', SAMPLINGS, ids=str)
def test_acceptance_rule_gives_the_target_distribution_exactly(draft_target, sampling):
  """P(emitted = v) = sum_y q(y) a(y) [y = v] + (1 - sum_y q(y) a(y)) r(v), summed over every
  drafted y in closed form (sampling.output_distribution), equals the target p."""
  for q_logits, p_logits in draft_target:
    p, q = sampling.probs(p_logits), sampling.probs(q_logits)
    assert float(jnp.sum(jnp.abs(p - q))) > 1e-3, 'the draft differs from the target'
    np.testing.assert_allclose(output_distribution(p, q), p, atol=2e-6)


def test_accept_draft_draws_by_the_rule(tiny, draft_target):
  """accept_draft (the code the decoder runs) against the target distribution it must give:
  20,000 single-token rounds with drafts drawn from q; total variation under 0.02."""
  cfg = tiny[0]
  sampling = SAMPLINGS[1]
  q_logits, p_logits = draft_target[1]
  p_rows = jnp.stack([p_logits, p_logits])  # the row after the draft is not read on n = 0

  def one(key):
    k_draft, k_acc = jax.random.split(key)
    y = sampling.sample(q_logits, k_draft)
    n, nxt = accept_draft(sampling, p_rows, q_logits[None], y[None], k_acc)
    return jnp.where(n == 1, y, nxt)
  toks = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), 20000))
  freq = np.bincount(np.asarray(toks), minlength=cfg.vocab_size) / toks.size
  assert 0.5 * np.abs(freq - np.asarray(sampling.probs(p_logits))).sum() < 0.02


def test_sampled_speculative_decode_runs_and_stops(tiny):
  cfg, params, bias = tiny
  prompt = jax.random.randint(jax.random.key(3), (1, 5), 0, cfg.vocab_size)
  out = generate_speculative(cfg, params, prompt, 20, jax.random.key(1), draft_loops=1,
                             lookahead=3, sampling=Sampling(0.8, top_k=8), router_bias=bias,
                             runtime=RT)
  new = np.asarray(out.tokens[0, 5:])
  assert int(out.length) == 20 and new.min() >= 0 and new.max() < cfg.vocab_size
  stop = int(new[4])
  out = generate_speculative(cfg, params, prompt, 20, jax.random.key(1), draft_loops=1,
                             lookahead=3, sampling=Sampling(0.8, top_k=8), router_bias=bias,
                             runtime=RT, stop_tokens=[stop])
  assert stop in np.asarray(out.tokens[0, 5:5 + int(out.length)]).tolist()


@pytest.mark.parametrize('kw, args, match', [
    ({}, (3, 2), r'draft_loops=3: must lie in \[0, 3\)'),
    ({}, (1, 0), 'lookahead=0: must be >= 1'),
    (dict(kv_cache='last_pass'), (1, 2), "model.kv_cache='last_pass'"),
    (dict(kv_cache='first_pass'), (1, 2), "model.kv_cache='first_pass'"),
    (dict(exit='kl', exit_threshold=0.1), (1, 2), "model.exit='kl'"),
    (dict(capacity_factor=1.25), (1, 2), 'model.capacity_factor=1.25'),
    (dict(core_layers=0, core_experts=0), (0, 2), 'model.core_layers=0'),
])
def test_refusals_name_the_setting(kw, args, match):
  with pytest.raises(ValueError, match=match):
    check_speculative(make_cfg(**kw), None, *args)
