"""Per-token early exit from the looped core (model.exit 'kl' | 'gate', early_exit.py).

Checks against invariants and slow references: a threshold that never fires is the no-exit
model; one that fires after the first pass is the one-pass model; a frozen token keeps its
exit pass's state; the gate's exit distribution sums to 1 and its objective is the expected
loss minus the entropy written with explicit loops; decoding at batch 1 (remaining passes
skipped) is the masked computation of a larger batch; the cache's skipped passes hold the
exit pass's K/V; bad settings fail naming the key. Gate training: the train loss is the
objective over the model run at every pass count (a slow reference), its gradient reaches the
gate and the model, a closed gate gives the last pass's loss, and the trainer moves the gate.
Tiny configs (tests/helpers.py).
"""
from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax import dry_run, sharding
from loopmoe_jax import early_exit
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.decode import decode_step, init_cache, mean_passes
from loopmoe_jax.experiment import build
from loopmoe_jax.model import LoopedMoE, head_matrix
from loopmoe_jax.objective import loss_fn
from loopmoe_jax.pass_range import PassForward, run_front, run_passes, run_readout
from loopmoe_jax.train import depth, depth_eval
from loopmoe_jax.train.evaluation import evaluate_checkpoint
from loopmoe_jax.train.run import RunDir
from loopmoe_jax.train.trainer import train

from helpers import decode_all, make_cfg, make_params, rt, tiny, tokens

BASE = dict(num_loops=3)
REF = rt(dispatch='reference')  # every model here dispatches with the reference


@functools.lru_cache(maxsize=None)
def base_cfg(**kw):
  return make_cfg(**{**BASE, **kw})


def params_with_gate(cfg, bias=0.0, seed=3):
  p = dict(make_params(cfg.replace(exit='none', exit_threshold=0.0)))
  rng = np.random.default_rng(seed)
  p['exit_gate_w'] = jnp.asarray(rng.standard_normal(cfg.d_model) / math.sqrt(cfg.d_model),
                                 jnp.float32)
  p['exit_gate_b'] = jnp.asarray(bias, jnp.float32)
  return p


def make_model(cfg, runtime=REF):
  return LoopedMoE(cfg, runtime=runtime)


def forward(cfg, params, toks, runtime=REF, method='__call__', **kw):
  return make_model(cfg, runtime).apply({'params': params}, toks, method=method, **kw)


def never(rule):
  return dict(exit=rule, exit_threshold=1e-30 if rule == 'kl' else 1.0)


def always(rule):
  return dict(exit=rule, exit_threshold=1e30 if rule == 'kl' else 1e-9)


def params_for(cfg):
  return params_with_gate(cfg) if cfg.exit == 'gate' else make_params(base_cfg())


@pytest.mark.parametrize('rule', ['kl', 'gate'])
def test_threshold_that_never_fires_is_the_no_exit_model(rule):
  cfg = base_cfg()
  toks = tokens(cfg)
  want, _ = forward(cfg, make_params(cfg), toks)
  ecfg = cfg.replace(**never(rule))
  p = params_for(ecfg)
  got, extras = forward(ecfg, p, toks, early_exit=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.all(np.asarray(extras['exit']['passes_BT']) == cfg.num_loops)
  assert float(extras['exit']['mean_passes']) == cfg.num_loops
  dec, cache = decode_all(ecfg, p, toks, runtime=REF)
  np.testing.assert_allclose(np.asarray(dec), np.asarray(want), rtol=1e-4, atol=1e-4)
  assert float(mean_passes(cache)) == cfg.num_loops


@pytest.mark.parametrize('rule', ['kl', 'gate'])
def test_threshold_that_always_fires_is_the_one_pass_model(rule):
  cfg = base_cfg()
  toks = tokens(cfg)
  want, _ = forward(cfg, make_params(cfg), toks, num_loops=1)
  ecfg = cfg.replace(**always(rule))
  p = params_for(ecfg)
  got, extras = forward(ecfg, p, toks, early_exit=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(extras['exit']['mean_passes']) == 1.0
  dec, cache = decode_all(ecfg, p, toks, runtime=REF)
  np.testing.assert_allclose(np.asarray(dec), np.asarray(want), rtol=1e-4, atol=1e-4)
  assert float(mean_passes(cache)) == 1.0


def test_forward_without_early_exit_ignores_the_rule():
  cfg = base_cfg()
  toks = tokens(cfg)
  want, _ = forward(cfg, make_params(cfg), toks)
  got, extras = forward(cfg.replace(**always('kl')), make_params(cfg), toks)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert 'exit' not in extras


def test_frozen_token_keeps_its_exit_pass_state():
  """With no coda, the final hidden state of a token that ran n passes is the n-pass model's,
  for every token whose predecessors all ran at least n passes (what it attended to is then
  the n-pass model's too)."""
  cfg = base_cfg(coda_layers=0, num_loops=4)
  p = make_params(cfg)
  toks = tokens(cfg, batch=4, length=8)
  ecfg = cfg.replace(exit='kl', exit_threshold=0.05)
  hid, extras = forward(ecfg, p, toks, early_exit=True, method='hidden')
  passes = np.asarray(extras['exit']['passes_BT'])
  assert 1 <= passes.min() and passes.min() < cfg.num_loops  # some token exited early
  by_n = {n: np.asarray(forward(cfg, p, toks, num_loops=n, method='hidden')[0])
          for n in range(1, cfg.num_loops + 1)}
  checked_early = 0
  for b in range(passes.shape[0]):
    for t in range(passes.shape[1]):
      n = passes[b, t]
      if np.all(passes[b, :t] >= n):
        np.testing.assert_allclose(np.asarray(hid[b, t]), by_n[n][b, t], rtol=1e-5, atol=1e-5)
        checked_early += n < cfg.num_loops
  assert checked_early > 0


def test_decode_batch_one_skipping_equals_masked_batch_and_fills_skipped_slots():
  """Batch 1 skips the passes after the token's exit; in a batch of 2 the other row keeps the
  passes running (masked for the exited row): the shared row's logits are the same, and the
  cache's slots of a skipped pass hold the exit pass's K/V."""
  cfg = base_cfg(num_loops=4).replace(exit='kl', exit_threshold=0.05)
  p = make_params(base_cfg(num_loops=4))
  toks = tokens(cfg, batch=2, length=8, seed=5)
  one, cache1 = decode_all(cfg, p, toks[:1], runtime=REF)
  two, _ = decode_all(cfg, p, toks, runtime=REF)
  np.testing.assert_allclose(np.asarray(one[0]), np.asarray(two[0]), rtol=1e-4, atol=1e-4)
  assert 1.0 <= float(mean_passes(cache1)) < cfg.num_loops
  core = cache1['core']
  k = jax.tree.leaves(core)[0]  # [L, B, G, S, K]
  # per token: the slots of passes >= its passes run equal those of its last pass
  cache_passes = []
  for t in range(toks.shape[1]):
    same = [bool(np.array_equal(np.asarray(k[l, 0, :, t]), np.asarray(k[l - 1, 0, :, t])))
            for l in range(1, cfg.num_loops)]
    cache_passes.append(1 + next((i for i, s in enumerate(same) if all(same[i:])), len(same)))
  assert min(cache_passes) < cfg.num_loops
  assert math.isclose(np.mean(cache_passes), float(mean_passes(cache1)), rel_tol=1e-6)


def slow_exit_decode(cfg, params, bias, toks):
  """Early-exit decoding, one token a step, as a Python loop over the passes (pass_range's
  halves of the forward): each row's token runs passes until its rule fires (masked while
  another row runs on), the slots of the passes it skipped take its last pass's K/V, the
  coda and head read its state. (logits [B, T, V], final cache, passes run [B, T])."""
  plain = cfg.replace(exit='none', exit_threshold=0.0)
  pf = PassForward.of(plain, params, bias, REF)
  gain = params['final_norm']['scale'] if cfg.norm_gain else None
  r = early_exit.Readout(cfg.exit, cfg.exit_threshold, cfg.norm_eps, gain,
                         head_matrix(cfg, params, jnp.float32, runtime=REF),
                         params.get('exit_gate_w'), params.get('exit_gate_b'))
  (b, length), loops, out, ran = toks.shape, cfg.num_loops, [], []
  cache = init_cache(plain, b, length)
  for t in range(length):
    front = run_front(pf, cache, toks[:, t:t + 1], t, 0)
    x, cache, aux, p = front.h_BTD, front.cache, early_exit.init_aux(r, front.h_BTD), 0
    while p < loops and not bool(aux['exited'].all()):
      y, cache = run_passes(pf, cache, x, front.e_BTD, t, p, p + 1)
      x = jnp.where(aux['exited'][..., None], x, y)
      aux, p = early_exit.update(r, aux, x), p + 1
    n_B = np.asarray(aux['passes'][:, 0])
    for row, n in enumerate(n_B):
      cache['core'] = jax.tree.map(lambda a: a.at[n:, row, :, t].set(a[n - 1, row, :, t]),
                                   cache['core'])
    logits, cache = run_readout(pf, cache, x, t)
    out.append(logits)
    ran.append(n_B)
  return jnp.concatenate(out, axis=1), cache, np.stack(ran, axis=1)


@pytest.mark.parametrize('rule,layout', [('kl', {}), ('gate', {}),
                                         ('kl', dict(tie_attention=False, router_bias='per_pass'))],
                         ids=['kl', 'gate', 'untied_per_pass_bias'])
def test_decoding_with_exits_is_the_slow_pass_loop(rule, layout):
  """decode_step's early exit (a loop over the passes carrying the cache in place, stopping
  once every token exited) gives the logits, the cache and the pass counts of the Python
  loop over the passes, token by token, in a batch of 2 whose rows exit at different passes
  (the exited row masked while the other runs on); with untied attention and a per-pass
  router bias, each pass reads its own."""
  cfg = base_cfg(num_loops=4, **layout).replace(
      exit=rule, exit_threshold=0.05 if rule == 'kl' else 0.5)
  p = params_for(cfg) if not layout else make_params(base_cfg(num_loops=4, **layout))
  bias = None
  if cfg.router_bias != 'none':
    rng = np.random.default_rng(7)
    shapes = {'prelude': (cfg.prelude_layers, cfg.prelude_experts),
              'core': (cfg.num_loops, cfg.core_layers, cfg.core_experts),
              'coda': (cfg.coda_layers, cfg.coda_experts)}
    bias = {'bias': {k: jnp.asarray(rng.normal(size=v), jnp.float32)
                     for k, v in shapes.items()}}
  toks = tokens(cfg, batch=2, length=8, seed=5)
  want, want_cache, ran = slow_exit_decode(cfg, p, bias, toks)
  assert 1 <= ran.min() < ran.max()  # tokens exit at different passes
  assert (ran[0] != ran[1]).any()  # and rows within a step
  step = jax.jit(functools.partial(decode_step, cfg, runtime=REF))
  cache, got = init_cache(cfg, 2, toks.shape[1]), []
  for t in range(toks.shape[1]):
    logits, cache = step(p, cache, toks[:, t:t + 1], router_bias=bias)
    got.append(logits)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(got, 1)), np.asarray(want),
                             rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(cache['core']), jax.tree.leaves(want_cache['core'])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  assert math.isclose(float(mean_passes(cache)), ran.mean(), rel_tol=1e-6)


def slow_objective(nll_LBT, lam_LBT, coef):
  """Expected loss minus coef x entropy with explicit loops over tokens and passes."""
  nll, lam = np.asarray(nll_LBT, np.float64), np.asarray(lam_LBT, np.float64)
  L, B, T = nll.shape
  loss = ent = 0.0
  for b in range(B):
    for t in range(T):
      survive = 1.0
      for p in range(L):
        prob = survive if p == L - 1 else lam[p, b, t] * survive
        survive *= 1.0 - lam[p, b, t]
        loss += prob * nll[p, b, t]
        ent -= prob * math.log(prob) if prob > 0 else 0.0
  return (loss - coef * ent) / (B * T), loss / (B * T), ent / (B * T)


def test_gate_exit_distribution_sums_to_one_and_objective_matches_slow_reference():
  key = jax.random.key(0)
  lam = jax.nn.sigmoid(jax.random.normal(key, (5, 3, 4)) * 2.0)
  nll = jax.random.uniform(jax.random.key(1), (5, 3, 4), minval=0.5, maxval=4.0)
  p = early_exit.exit_distribution(lam)
  np.testing.assert_allclose(np.asarray(p.sum(0)), 1.0, rtol=1e-6)
  assert np.all(np.asarray(p) >= 0)
  got = early_exit.gate_objective(nll, lam, 0.1)
  want = slow_objective(nll, lam, 0.1)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5)


def test_gate_inference_exits_where_the_cumulative_probability_passes_the_threshold():
  """The passes run per token follow the cdf of exit_distribution over the readout's lambdas
  of the pass states (recomputed from the no-exit model's states at each pass count, valid
  for position 0, which attends only to itself)."""
  cfg = base_cfg(coda_layers=0, num_loops=4)
  ecfg = cfg.replace(exit='gate', exit_threshold=0.6)
  p = params_with_gate(cfg, bias=-0.5)
  toks = tokens(cfg, batch=6, length=3)
  _, extras = forward(ecfg, p, toks, early_exit=True)
  states = [forward(cfg, p, toks, num_loops=n, method='hidden')[0][:, 0]
            for n in range(1, cfg.num_loops + 1)]  # final-normed states at position 0
  lam = np.stack([np.asarray(jax.nn.sigmoid(s @ p['exit_gate_w'] + p['exit_gate_b']))
                  for s in states])  # [L, B]
  cdf = np.cumsum(np.asarray(early_exit.exit_distribution(lam[:, :, None]))[:, :, 0], axis=0)
  want = np.array([1 + next((l for l in range(cfg.num_loops) if cdf[l, b] >= 0.6 - 1e-6),
                            cfg.num_loops - 1) for b in range(lam.shape[1])])
  np.testing.assert_array_equal(np.asarray(extras['exit']['passes_BT'][:, 0]), want)


@pytest.mark.parametrize('kw, key', [
    (dict(exit='kl', exit_threshold=0.0), 'model.exit_threshold'),
    (dict(exit='kl', exit_threshold=-1.0), 'model.exit_threshold'),
    (dict(exit='kl', exit_threshold=float('inf')), 'model.exit_threshold'),
    (dict(exit='gate', exit_threshold=0.0), 'model.exit_threshold'),
    (dict(exit='gate', exit_threshold=1.5), 'model.exit_threshold'),
    (dict(exit='halt'), 'model.exit'),
    (dict(exit='kl', exit_threshold=0.1, exit_entropy=-1.0), 'model.exit_entropy'),
    (dict(exit='kl', exit_threshold=0.1, core_layers=0), 'model.exit'),
])
def test_bad_settings_name_the_key(kw, key):
  with pytest.raises(ValueError, match=key.replace('.', r'\.')):
    ModelConfig(**{**BASE, **kw})


def test_gate_on_a_checkpoint_without_gate_fails_before_compute():
  cfg = base_cfg()
  ecfg = cfg.replace(exit='gate', exit_threshold=0.5)
  p = make_params(cfg)
  with pytest.raises(ValueError, match=r"model\.exit='gate'.*trained without"):
    forward(ecfg, p, tokens(cfg), early_exit=True)
  with pytest.raises(ValueError, match=r"model\.exit='gate'.*trained without"):
    decode_step(ecfg, p, {'position': jnp.zeros((), jnp.int32)}, tokens(cfg)[:, :1],
                runtime=REF)


# Gate training (objective.gate_lm_loss) --------------------------------------------------------

def gate_batch(cfg, seed=5):
  toks = tokens(cfg, seed=seed, batch=3, length=5)
  targets = tokens(cfg, seed=seed + 1, batch=3, length=5)
  mask = jnp.asarray(np.random.default_rng(seed).random((3, 5)) > 0.3, jnp.float32)
  return {'inputs': toks, 'targets': targets, 'mask': mask}


def slow_gate_loss(cfg, p, batch, coef, runtime=REF):
  """The model at num_loops = 1..L: the NLL of its output (through the coda), the gate's lambda
  of its normed core state (the coda-less twin's final-normed state); combined with loops."""
  nocoda = cfg.replace(coda_layers=0, exit='none', exit_threshold=0.0)
  plain = cfg.replace(exit='none', exit_threshold=0.0)
  tg, mask = np.asarray(batch['targets']), np.asarray(batch['mask'], np.float64)
  nll, lam = [], []
  for n in range(1, cfg.num_loops + 1):
    logits = np.asarray(forward(plain, p, batch['inputs'], runtime, num_loops=n)[0],
                        np.float64)
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    nll.append(lse - np.take_along_axis(logits, tg[..., None], -1)[..., 0])
    s = np.asarray(forward(nocoda, p, batch['inputs'], runtime, num_loops=n,
                           method='hidden')[0], np.float64)
    w, b = np.asarray(p['exit_gate_w'], np.float64), float(p['exit_gate_b'])
    lam.append(1.0 / (1.0 + np.exp(-(s @ w + b))))
  L = cfg.num_loops
  obj = exp = ent = passes = 0.0
  for bi in range(tg.shape[0]):
    for ti in range(tg.shape[1]):
      if not mask[bi, ti]:
        continue
      survive = 1.0
      for l in range(L):
        prob = survive if l == L - 1 else lam[l][bi, ti] * survive
        survive *= 1.0 - lam[l][bi, ti]
        exp += prob * nll[l][bi, ti]
        ent -= prob * math.log(prob) if prob > 0 else 0.0
        passes += prob * (l + 1)
  n = mask.sum()
  last = float((nll[-1] * mask).sum() / n)
  return (exp - coef * ent) / n, exp / n, ent / n, passes / n, last


def gate_cfg(**kw):
  return base_cfg(**{'exit': 'gate', 'exit_threshold': 0.5, 'exit_entropy': 0.1, **kw})


@pytest.mark.parametrize('kw, run', [(dict(), dict()), (dict(coda_layers=0), dict(loss_chunk=10))])
def test_gate_training_loss_matches_slow_reference(kw, run):
  """The LM term is Ouro's objective over the model's output at every pass count (through the
  coda), per token, with the mask; 'loss' the expected NLL, 'lm_loss_last' the plain model's
  loss; aux losses are the plain forward's. The chunked per-token loss (run.loss_chunk) agrees."""
  cfg, runtime = gate_cfg(**kw), REF.with_run(**run)
  p = params_with_gate(cfg, bias=0.3)
  batch = gate_batch(cfg)
  total, m = loss_fn(p, make_model(cfg, runtime), batch, 0.0, 0.0)
  obj, exp, ent, passes, last = slow_gate_loss(cfg, p, batch, cfg.exit_entropy, runtime)
  np.testing.assert_allclose(float(total), obj, rtol=1e-5)
  np.testing.assert_allclose([float(m[k]) for k in ('loss', 'exit_entropy', 'exit_mean_passes',
                                                   'lm_loss_last')],
                             [exp, ent, passes, last], rtol=1e-5)
  _, plain = loss_fn(p, make_model(cfg.replace(exit='none', exit_threshold=0.0), runtime), batch)
  np.testing.assert_allclose(float(m['lm_loss_last']), float(plain['loss']), rtol=1e-5)
  total2, m2 = loss_fn(p, make_model(cfg, runtime), batch, 0.01, 0.001)
  np.testing.assert_allclose(float(total2 - total), float(0.01 * plain['load_balance'] +
                                                          0.001 * plain['z_loss']), rtol=1e-4)


def test_gate_training_gradient_reaches_the_gate_and_the_model():
  cfg = gate_cfg()
  p = params_with_gate(cfg, bias=0.3)
  grads = jax.grad(lambda q: loss_fn(q, make_model(cfg), gate_batch(cfg))[0])(p)
  norms = {k: float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(v)))
           for k, v in grads.items()}
  for k in ('exit_gate_w', 'exit_gate_b', 'core', 'coda', 'prelude', 'head', 'final_norm',
            'embed'):
    assert norms[k] > 0 and math.isfinite(norms[k]), (k, norms)


def test_gate_training_without_entropy_and_a_closed_gate_is_the_last_pass_loss():
  cfg = gate_cfg(exit_entropy=0.0)
  p = params_with_gate(cfg, bias=-40.0)   # lambda ~ 4e-18 at every pass
  total, m = loss_fn(p, make_model(cfg), gate_batch(cfg), 0.0, 0.0)
  np.testing.assert_allclose(float(total), float(m['lm_loss_last']), rtol=1e-6)
  np.testing.assert_allclose(float(m['exit_mean_passes']), cfg.num_loops, rtol=1e-6)


def test_gate_training_refuses_truncated_backprop():
  cfg = gate_cfg()
  with pytest.raises(ValueError, match='gate training'):
    loss_fn(params_with_gate(cfg), make_model(cfg), gate_batch(cfg), backprop_loops=1)


def test_gate_training_run_trains_the_gate(tmp_path):
  """The trainer with model.exit='gate' (tests/helpers' tiny run): the gate's params (made
  zero at init) move, and the metrics carry the gate's statistics."""
  cfg = tiny(steps=3)
  cfg.model.exit, cfg.model.exit_threshold, cfg.model.exit_entropy = 'gate', 0.5, 0.05
  train(cfg, str(tmp_path))
  params = RunDir(str(tmp_path)).load().params
  p = params.get('params', params)
  assert float(jnp.sum(jnp.abs(p['exit_gate_w']))) > 0 and float(p['exit_gate_b']) != 0
  rows = [json.loads(l) for l in open(os.path.join(str(tmp_path), 'metrics.jsonl'))]
  row = [r for r in rows if 'exit_mean_passes' in r][-1]
  assert 1.0 <= row['exit_mean_passes'] <= 2.0 and math.isfinite(row['lm_loss_last'])
  # scripts/evaluate.py --exit on the run: a threshold that never fires (cdf >= 1 before the
  # last pass) gives the no-exit loss and every pass; one that always fires after pass 1
  # gives the one-pass model's validation loss (evaluate_checkpoint) and one pass
  got = depth_eval.exit_tradeoff(str(tmp_path), 'gate', ['1.0', '1e-9'])
  none, never, always = got['passes']['2']
  assert never['loss'] == none['loss'] and never['mean_passes'] == none['mean_passes'] == 2.0
  one = evaluate_checkpoint(str(tmp_path), [1])['val_loss']['1']
  assert always['mean_passes'] == 1.0 and abs(always['loss'] - one) < 1e-5, (always, one)
  # --kv_cache: at one pass the shared layouts hold what the per-pass one holds; at two the
  # shared one reads other K/V (the losses differ)
  kv = depth_eval.kv_cache_losses(str(tmp_path), ['per_pass', 'last_pass'], [1, 2])
  assert abs(kv['1']['decode']['last_pass'] - kv['1']['decode']['per_pass']) < 1e-6, kv
  assert abs(kv['2']['decode']['last_pass'] - kv['2']['decode']['per_pass']) > 1e-4, kv


def test_gate_training_flops_are_counted_by_the_dry_run():
  """accounting's gate_train_flops_per_token (the early passes' readouts through the coda
  and head, and the gate) is what the gate adds to the lowered train step's matmul FLOPs
  (dry_run.step_flops, read from the HLO), within 5%; the gate's params are counted."""
  got = {}
  for rule in ('none', 'gate'):
    cfg = tiny()
    cfg.model.update(coda_layers=1, coda_experts=4, num_loops=3, exit=rule, exit_threshold=0.5)
    exp = build(cfg.to_dict())
    mesh = sharding.make_mesh(exp.mesh)
    got[rule] = (dry_run.step_flops(cfg.to_dict()), dry_run.analytic_flops(exp, mesh))
    # the trainer's FLOPs per token (its MFU) agree with the dry run's (per device)
    per_token = depth.step_flops_per_token(exp.model, exp.data.seq_len, exp.model.num_loops)
    assert per_token * exp.data.batch_size * exp.data.seq_len / mesh.size == pytest.approx(
        got[rule][1], rel=1e-6)
  compiled = got['gate'][0] - got['none'][0]
  analytic = got['gate'][1] - got['none'][1]
  assert compiled > 0 and abs(compiled / analytic - 1) < 0.05, (compiled, analytic)


@pytest.mark.parametrize('tile,minor,slots,start', [
    (0, False, 12, 4), (0, False, 12, (0, 5, 9)), (4, True, 12, 4), (4, True, 12, 3),
    (4, True, 12, 10), (8, True, 12, 6), (4, False, 12, 3), (4, False, 12, 9),
    (4, True, 12, (0, 5, 9)), (4, False, 12, (3, 10, 6))],
    ids=['one_start', 'start_per_row', 'tiles', 'tiles_across', 'tiles_at_end', 'wide_tile',
         'row_tiles', 'row_tiles_at_end', 'tiles_per_row', 'row_tiles_per_row'])
def test_fill_skipped_matches_a_loop(tile, minor, slots, start):
  """Slots of the passes a token skipped hold its last computed pass's K/V, at each row's own
  positions; every other slot is untouched (a plain loop over rows, tokens and passes). With
  `tile` (the TPU kernels' layouts, slots-minor or not) the window is whole tiles around the
  step's slots: within a tile, across two, clamped at the cache's end, wider than the cache,
  and a window per row."""
  rng = np.random.default_rng(0)
  L, B, T = 4, 3, 2
  x = rng.normal(size=(L, B, 2, slots, 3)).astype(np.float32)  # [L, B, G, S, K]
  passes_BT = rng.integers(1, L + 1, (B, T))
  got = early_exit.fill_skipped({'k': jnp.asarray(x)}, jnp.asarray(passes_BT),
                                jnp.asarray(start), tile, minor)['k']
  want = x.copy()
  for b in range(B):
    s = int(np.broadcast_to(start, (B,))[b])
    for t in range(T):
      n = passes_BT[b, t]
      want[n:, b, :, s + t] = x[n - 1, b, :, s + t]
  assert not np.array_equal(want, x)  # something was filled
  np.testing.assert_array_equal(np.asarray(got), want)
