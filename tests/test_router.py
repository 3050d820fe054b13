"""Router options: sigmoid scores and the aux-loss-free router bias (model.router_score,
model.router_bias, train.bias_rate), against numpy references and invariants.

- `route` with sigmoid scores and a bias == numpy (choice on scores + bias, weights the
  unbiased scores of the chosen, normalised over k).
- The bias gets no gradient and never changes the combine weights: a bias equal for every
  expert (same choices) gives the unbiased model's logits exactly; a bias that makes one expert
  win everywhere makes every token pick it (per pass with 'per_pass').
- The update moves an overloaded expert's bias down and an idle one's up by exactly bias_rate,
  from the loads the step's own forward measured.
- Every dispatch backend (the Pallas routing kernel in interpret mode included) and the
  expert-parallel path on a data2 x expert4 mesh give the same outputs with the bias on.
- Training with the bias resumes exactly (biases and losses); bad input names the key and fix.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax import sharding
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE, bias_shapes, variables
from loopmoe_jax.moe import MoE, route_for
from loopmoe_jax.sharding import MeshConfig
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.train import step as steps
from loopmoe_jax.train.run import read_router_bias
from loopmoe_jax.train.step import update_router_bias
from loopmoe_jax.config.train import TrainConfig
from loopmoe_jax.train.optimizer import make_optimizer

TINY = dict(vocab_size=64, d_model=32, num_heads=2, head_dim=16, expert_width=32, top_k=2,
            prelude_layers=1, prelude_experts=4, core_layers=1, core_experts=4, num_loops=2,
            coda_layers=0)
XLA = Runtime.of(dispatch='xla')  # the tiny model's run settings


def route_numpy(logits, k, bias, score, renormalize=True):
  z = np.asarray(logits, np.float64)
  if score == 'sigmoid':
    p = 1.0 / (1.0 + np.exp(-z))
  else:
    p = np.exp(z - z.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
  sel = p + np.asarray(bias, np.float64)
  experts = np.stack([np.argsort(-row, kind='stable')[:k] for row in sel])
  w = np.take_along_axis(p, experts, -1)
  if renormalize or score == 'sigmoid':
    w = w / w.sum(-1, keepdims=True)
  return experts, w, p


@pytest.mark.parametrize('score', ['sigmoid', 'softmax'])
@pytest.mark.parametrize('backend', ['xla', 'pallas'])
def test_route_with_bias_matches_numpy(score, backend):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(37, 8)).astype(np.float32)
  bias = (0.3 * rng.normal(size=8)).astype(np.float32)
  experts, weights, probs, _ = route_for(backend, jnp.asarray(logits), 3, False,
                                         jnp.asarray(bias), score, runtime=HERE)
  e_np, w_np, p_np = route_numpy(logits, 3, bias, score, renormalize=False)
  np.testing.assert_array_equal(np.asarray(experts), e_np)
  np.testing.assert_allclose(np.asarray(weights), w_np, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(probs), p_np, rtol=1e-5, atol=1e-7)
  if score == 'sigmoid':  # DeepSeek-V3: the weights sum to one over the k chosen
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


def test_bias_gets_no_gradient_and_weights_are_the_unbiased_scores():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(16, 4)).astype(np.float32))
  bias = jnp.asarray(rng.normal(size=4).astype(np.float32))
  for backend in ('xla', 'pallas'):
    def f(z, b):
      _, w, p, _ = route_for(backend, z, 2, True, b, 'sigmoid', runtime=HERE)
      return jnp.sum(w * jnp.arange(2.0)) + jnp.sum(p ** 2)
    gz, gb = jax.grad(f, argnums=(0, 1))(logits, bias)
    assert np.all(np.asarray(gb) == 0.0) and np.any(np.asarray(gz) != 0.0)
    experts, weights, probs, _ = route_for(backend, logits, 2, True, bias, 'sigmoid', runtime=HERE)
    raw = np.take_along_axis(np.asarray(probs), np.asarray(experts), -1)
    np.testing.assert_allclose(np.asarray(weights), raw / raw.sum(-1, keepdims=True),
                               rtol=1e-6)


@pytest.fixture(scope='module')
def tiny_models():
  """Shared params of the tiny model under every bias layout (same param tree)."""
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (4, 12)), jnp.int32)
  params = LoopedMoE(ModelConfig(**TINY), runtime=XLA).init(jax.random.key(0), tokens)['params']
  return tokens, params


def _bias(cfg, fill):
  return {'bias': {seg: jnp.full(shape, fill, jnp.float32)
                   for seg, shape in bias_shapes(cfg).items()}}


@pytest.mark.parametrize('layout', ['shared', 'per_pass'])
def test_uniform_bias_changes_nothing_and_the_bias_gets_no_gradient(tiny_models, layout):
  tokens, params = tiny_models
  plain = ModelConfig(**TINY)
  cfg = plain.replace(router_bias=layout)
  want, _ = LoopedMoE(plain, runtime=XLA).apply({'params': params}, tokens)
  bias = _bias(cfg, 3.0)  # the same for every expert: the same choices, hence the same output
  got, _ = LoopedMoE(cfg, runtime=XLA).apply({'params': params, 'router_bias': bias}, tokens)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  def loss(b):
    logits, extras = LoopedMoE(cfg, runtime=XLA).apply({'params': params, 'router_bias': b},
                                                       tokens)
    return jnp.mean(logits ** 2) + extras['load_balance'] + extras['z_loss']
  rng = np.random.default_rng(3)
  noisy = jax.tree.map(lambda b: b + jnp.asarray(rng.normal(size=b.shape), jnp.float32), bias)
  for g in jax.tree.leaves(jax.grad(loss)(noisy)):
    assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize('layout', ['shared', 'per_pass'])
def test_a_winning_bias_makes_every_token_pick_its_expert(tiny_models, layout):
  tokens, params = tiny_models
  cfg = ModelConfig(**TINY, router_bias=layout)
  bias = _bias(cfg, 0.0)
  win = {}
  for seg, b in bias['bias'].items():  # expert 1; per pass: expert = pass index + 1
    if b.ndim == 3:
      idx = np.arange(b.shape[0]) + 1
      bias['bias'][seg] = b.at[np.arange(b.shape[0]), :, idx].set(10.0)
      win[seg] = idx[:, None, None, None, None]
    else:
      bias['bias'][seg] = b.at[:, 1].set(10.0)
      win[seg] = np.ones((1,), int)
  _, extras = LoopedMoE(cfg, runtime=XLA).apply({'params': params, 'router_bias': bias}, tokens,
                                                         return_routing=True)
  for seg, r in extras['routing'].items():  # experts: [(L,) D, B, T, k]
    first = np.asarray(r['experts'])[..., 0]
    assert np.all(first == np.asarray(win[seg])[..., 0]), seg


def test_update_moves_by_exactly_bias_rate():
  rate = 0.125
  bias = {'bias': {'prelude': jnp.zeros((1, 4)), 'core': jnp.full((2, 4), 0.5)}}
  loads = {'prelude': jnp.asarray([[10.0, 2.0, 4.0, 0.0]]),       # mean 4
           'core': jnp.asarray([[[3.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]],
                                [[3.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])}
  new = update_router_bias(bias, loads, rate)['bias']
  np.testing.assert_array_equal(np.asarray(new['prelude']), [[-rate, rate, 0.0, rate]])
  # shared core bias: the loads of both passes ([6, 1, 1, 0], mean 2; [2, 2, 2, 2] balanced)
  np.testing.assert_array_equal(np.asarray(new['core']),
                                [[0.5 - rate, 0.5 + rate, 0.5 + rate, 0.5 + rate],
                                 [0.5, 0.5, 0.5, 0.5]])
  per_pass = {'bias': {'core': jnp.zeros((2, 2, 4))}}
  new = update_router_bias(per_pass, {'core': loads['core']}, rate)['bias']['core']
  np.testing.assert_array_equal(np.asarray(new[1, 0]), [-rate, rate, 0.0, rate])


def test_train_step_updates_from_its_own_loads_outside_the_optimizer(tiny_models):
  """The bias after one train step == before + rate * sign(mean - load) with the loads of
  the same forward (model.apply with the old params and bias); the optimizer's state holds
  no bias."""
  tokens, _ = tiny_models
  cfg = ModelConfig(**TINY, router_bias='per_pass')
  model, rate = LoopedMoE(cfg, runtime=XLA), 0.01
  tx, schedule = make_optimizer(TrainConfig(lr=1e-2, warmup=0))
  mesh = sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])
  state_sh, batch_sh = steps.shardings(mesh, model, tx, 12)
  state = steps.create_state(model, tx, 0, 12, state_sh)
  state['router_bias'] = jax.tree.map(lambda b: b + jnp.linspace(0.0, 0.01, b.shape[-1]),
                                      state['router_bias'])
  before = jax.device_get(state)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  batch = steps.put_batch(jax.device_get(batch), batch_sh)
  _, extras = model.apply(variables(before['params'], router_bias=before['router_bias']),
                          batch['inputs'])
  train_step = steps.make_train_step(model, tx, schedule, state_sh, batch_sh,
                                     steps.StepSettings(lb_coef=0.0, bias_rate=rate))
  new, metrics = train_step(state, batch)
  for seg, b in before['router_bias']['bias'].items():
    load = np.asarray(extras['per_visit'][seg]['load'])
    want = b + rate * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_array_equal(np.asarray(new['router_bias']['bias'][seg]), want)
    mean = load.mean(-1)
    assert float(metrics[f'max_vio_{seg}']) == pytest.approx(
        np.mean((load.max(-1) - mean) / mean))
  # the optimizer's state is that of the params alone
  assert (jax.tree.structure(new['opt_state']) ==
          jax.tree.structure(jax.eval_shape(tx.init, before['params'])))


@pytest.mark.parametrize('score', ['softmax', 'sigmoid'])
def test_every_dispatch_and_expert_parallel_agree_with_the_bias(score):
  """MoE layer with a router bias: reference, xla, tiled, pallas (interpret) and the
  expert-parallel path on a data2 x expert4 mesh give the same outputs and loads."""
  cfg = ModelConfig(**{**TINY, 'router_score': score, 'router_bias': 'shared'})
  run = lambda backend: Runtime.of(dispatch=backend, dispatch_tile=16)
  x = jax.random.normal(jax.random.key(4), (8, 8, cfg.d_model), jnp.float32)
  bias = jnp.asarray([0.3, -0.2, 0.0, 0.1], jnp.float32)
  params = MoE(cfg, 4, runtime=run('xla')).init(jax.random.key(5), x)['params']
  out = {}
  for backend in ('reference', 'xla', 'tiled', 'pallas'):
    moe = MoE(cfg, 4, runtime=run(backend))
    out[backend] = jax.jit(lambda p, x, b: moe.apply({'params': p}, x, b))(params, x, bias)
  moe = MoE(cfg, 4, runtime=run('tiled'))
  mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
  with jax.set_mesh(mesh):
    out['expert_parallel'] = jax.device_get(
        jax.jit(lambda p, x, b: moe.apply({'params': p}, x, b))(params, x, bias))
  unbiased, _ = MoE(cfg, 4, runtime=run('reference')).apply({'params': params}, x)
  want_y, want_stats = out['reference']
  assert not np.allclose(np.asarray(unbiased), np.asarray(want_y))  # the bias steers
  for name, (y, stats) in out.items():
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=2e-5, atol=2e-6,
                               err_msg=name)
    np.testing.assert_array_equal(np.asarray(stats['load']), np.asarray(want_stats['load']),
                                  err_msg=name)


def test_config_errors_name_the_key_and_the_fix():
  with pytest.raises(ValueError, match=r"model\.router_bias='shared': the model has no MoE "
                                       r".*model\.router_bias='none'"):
    ModelConfig(**{**TINY, 'prelude_experts': 0, 'core_experts': 0, 'router_bias': 'shared'})
  with pytest.raises(ValueError, match=r"model\.router_bias='per_pass': needs a looped MoE core"
                                       r".*use model\.router_bias='shared'"):
    ModelConfig(**{**TINY, 'num_loops': 1, 'router_bias': 'per_pass'})
  with pytest.raises(ValueError, match=r'model\.router_score'):
    ModelConfig(**TINY, router_score='tanh')
  for rate in (-0.1, float('nan'), float('inf')):
    with pytest.raises(ValueError, match=r'train\.bias_rate=.*must be finite and >= 0'):
      TrainConfig(bias_rate=rate)
  cfg = ModelConfig(**TINY, router_bias='shared')
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = LoopedMoE(cfg, runtime=XLA).init(jax.random.key(0), tokens)['params']
  with pytest.raises(ValueError, match=r"model\.router_bias='shared': apply needs the trained"):
    LoopedMoE(cfg, runtime=XLA).apply({'params': params}, tokens)


def test_resume_gives_the_same_biases_and_losses_and_another_layout_is_refused(tmp_path):
  """An interrupted run (stopped after step 3, as a SIGTERM at that step leaves it) resumed to
  step 6 has the uninterrupted run's losses and biases, bit for bit; evaluation from the
  checkpoint uses the bias (its val loss is the logged one); resuming with another bias layout
  is an error naming model.router_bias."""
  from helpers import losses, tiny  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.train.evaluation import evaluate_checkpoint
  from loopmoe_jax.train.trainer import train

  def cfg(layout='shared', **kw):
    c = tiny(bias_rate=0.01, lb_coef=0.0, **kw)
    c.model.router_bias = layout
    return c
  a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
  straight = train(cfg(steps=6), a)
  train(cfg(steps=3, schedule_steps=6), b)
  resumed = train(cfg(steps=6), b)
  assert losses(a) == losses(b) and sorted(losses(a)) == list(range(1, 7))
  assert straight['final_window_loss'] == resumed['final_window_loss']
  bias_a, bias_b = read_router_bias(a, 6), read_router_bias(b, 6)
  for x, y in zip(jax.tree.leaves(bias_a), jax.tree.leaves(bias_b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(bias_a))  # it moved
  assert evaluate_checkpoint(a)['val_loss']['2'] == pytest.approx(straight['val_loss'],
                                                                  rel=1e-5)
  rows = open(os.path.join(a, 'routing.jsonl')).read()
  assert '"max_vio"' in rows
  with pytest.raises(ValueError, match=r"(?s)model\.router_bias: 'shared' in the checkpoint, "
                                       r"'per_pass' now.*Use a new workdir"):
    train(cfg('per_pass', steps=9), a)


# Device-limited routing (model.max_expert_devices) -------------------------------------------

def _limited_reference(logits, k, m, g, bias, score):
  """DeepSeek-V3's node-limited rule, token by token in numpy: a group's score is the sum of
  its ceil(k/m) best selection scores; the top-k is taken within the m best groups."""
  z = logits.astype(np.float64)
  probs = 1 / (1 + np.exp(-z)) if score == 'sigmoid' else np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  sel = probs + (0 if bias is None else bias)
  e_loc, best = logits.shape[1] // g, -(-k // m)
  experts = []
  for row in sel:
    groups = row.reshape(g, e_loc)
    gscore = np.sort(groups, axis=1)[:, ::-1][:, :best].sum(1)
    allowed = np.argsort(-gscore, kind='stable')[:m]
    cand = [e for e in range(len(row)) if e // e_loc in allowed]
    experts.append(sorted(cand, key=lambda e: -row[e])[:k])
  return np.array(experts), probs


@pytest.mark.parametrize('score,biased', [('softmax', False), ('sigmoid', True)])
@pytest.mark.parametrize('m', [1, 2])
def test_device_limited_routing_keeps_each_token_within_its_best_groups(score, biased, m):
  """model.max_expert_devices=M of expert_devices=G: the chosen experts are the numpy rule's
  (same sets, same weights), each token's experts lie in at most M groups, and M = G changes
  nothing."""
  from loopmoe_jax.moe import route
  rng = np.random.default_rng(7)
  logits = rng.standard_normal((64, 16)).astype(np.float32) * 2
  bias = rng.standard_normal(16).astype(np.float32) * 0.1 if biased else None
  k, g = 3, 4
  experts, weights, _ = route(jnp.asarray(logits), k, True, bias, score, (m, g))
  want, probs = _limited_reference(logits, k, m, g, bias, score)
  experts = np.asarray(experts)
  assert all(len(set(row // (16 // g))) <= m for row in experts)
  np.testing.assert_array_equal(np.sort(experts, 1), np.sort(want, 1))
  chosen = np.take_along_axis(probs, experts, 1)
  np.testing.assert_allclose(weights, chosen / chosen.sum(1, keepdims=True), rtol=1e-5)
  same = route(jnp.asarray(logits), k, True, bias, score, (g, g))
  plain = route(jnp.asarray(logits), k, True, bias, score)
  for a, b in zip(same, plain):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('fields, pattern', [
    (dict(max_expert_devices=2), r'model.expert_devices=0: .*needs the number of device groups'),
    (dict(max_expert_devices=5, expert_devices=4), r'model.max_expert_devices=5: exceeds'),
    (dict(max_expert_devices=-1, expert_devices=4), r'model.max_expert_devices=-1: must be'),
    (dict(max_expert_devices=1, expert_devices=3), r'model.expert_devices=3: does not divide'),
    (dict(max_expert_devices=1, expert_devices=8, top_k=2), r'leaves 1 x 1 experts'),
])
def test_device_limit_errors_name_the_key(fields, pattern):
  with pytest.raises(ValueError, match=pattern):
    ModelConfig(**{**dict(prelude_experts=8, core_experts=8, coda_experts=8), **fields})


def test_device_limited_tokens_touch_at_most_m_devices():
  """The token-row exchange under the limit: top-4 of 16 experts on 4 devices, M = 1 sends
  each token's row to one device (T pairs, not up to 4T)."""
  from loopmoe_jax import token_exchange
  from loopmoe_jax.moe import route
  rng = np.random.default_rng(8)
  logits = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  for m, most in ((1, 32), (4, 32 * 4)):
    experts, weights, _ = route(logits, 4, True, None, 'softmax', (m, 4))
    p = token_exchange.pairs(x, experts, weights, jnp.ones(experts.shape, bool), 4, 4, 32)
    assert int(p.counts_n.sum()) <= most
    if m == 1:
      assert int(p.counts_n.sum()) == 32


def test_device_limit_beyond_the_expert_axis_is_refused():
  """A mesh whose expert axis is smaller than model.max_expert_devices is refused naming the
  key; one device runs the model."""
  from loopmoe_jax.experiment import build, load_config
  from loopmoe_jax.job import Job
  cfg = load_config('configs/default.py:smoke')
  cfg.model.core_experts, cfg.model.prelude_experts, cfg.model.coda_experts = 8, 8, 8
  cfg.model.max_expert_devices, cfg.model.expert_devices = 4, 4
  cfg.mesh.data, cfg.mesh.expert = 4, 2
  with pytest.raises(ValueError, match=r'model.max_expert_devices=4 exceeds mesh.expert=2'):
    Job.build(build(cfg))
  cfg.mesh.data, cfg.mesh.expert = 1, 1
  Job.build(build(cfg), jax.devices()[:1])
