"""Adaptive depth in training (train/depth.py, core.Core): pass counts drawn per step from
(seed, step), one program per count, truncated backprop through the last passes.

Gradients are checked against a reference that runs the same model unrolled (loop_impl
'unroll', full backprop) with the outputs of its first n - k core passes (carry and routing
statistics) passed through jax.lax.stop_gradient, by intercepting those calls: what
truncated backprop means, written without the code under test's split of the scan."""
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.config.train import TrainConfig
from loopmoe_jax.experiment import build, experiment_config
from loopmoe_jax.core import Stack
from loopmoe_jax.model import LoopedMoE, bias_shapes
from loopmoe_jax.objective import loss_fn
from loopmoe_jax.sharding import MeshConfig
from loopmoe_jax.train import depth, step as steps
from loopmoe_jax.train.trainer import train
from loopmoe_jax.config import model_config_dict
from helpers import job_of, losses, make_cfg, make_params, rt, tiny, tokens


# (1) The counts are a pure function of (seed, step): a resumed run draws the same ----------

def _rows(workdir):
  return [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]


def test_resumed_run_draws_the_same_counts_and_losses(tmp_path):
  """Uniform counts over [1, 3] with gradient through the last 2 passes (all of a 1-pass
  draw's, Huginn's rule): a run killed after step 3 and resumed logs the counts and losses (bitwise) of the uninterrupted run; each step's
  count is sample_loops(seed, step), and each run made one program per count it drew."""
  kw = dict(loops_sampler='uniform', loops_low=1, loops_high=3, backprop_loops=2)
  straight = train(tiny(steps=6, **kw), str(tmp_path / 'a'))
  train(tiny(steps=3, schedule_steps=6, **kw), str(tmp_path / 'b'))   # "killed" after step 3
  resumed = train(tiny(steps=6, **kw), str(tmp_path / 'b'))
  a, b = _rows(tmp_path / 'a'), _rows(tmp_path / 'b')
  assert losses(tmp_path / 'a') == losses(tmp_path / 'b')               # bitwise
  counts = {r['step']: r['loops'] for r in a}
  assert counts == {r['step']: r['loops'] for r in b}
  tc = build(tiny(steps=6, **kw)).train
  assert counts == {s: depth.sample_loops(tc, 2, s - 1) for s in range(1, 7)}
  assert len(set(counts.values())) >= 2                                 # the draw varies
  assert straight['compiled_programs'] == len(set(counts.values()))
  assert resumed['compiled_programs'] == len({counts[s] for s in range(4, 7)})


# (2) Truncated backprop equals the stop_gradient reference -----------------------------------

def _reference_loss(model, split):
  """loss_fn of `model` (unrolled, full backprop) with the outputs of its first `split` core
  passes stop_gradient'ed, by intercepting the core's calls of its stack ('body')."""
  def fn(params, batch, num_loops, bias):
    calls = [0]

    def interceptor(next_fun, args, kwargs, context):
      if not (isinstance(context.module, Stack) and context.module.name == 'body'
              and context.method_name == '__call__'):
        return next_fun(*args, **kwargs)
      out = next_fun(*args, **kwargs)
      calls[0] += 1
      return jax.lax.stop_gradient(out) if calls[0] <= split else out

    with nn.intercept_methods(interceptor):
      out = loss_fn(params, model, batch, 0.01, 0.001, num_loops, bias)
    assert calls[0] == num_loops
    return out
  return fn


def _random_bias(cfg, seed=3):
  rng = np.random.default_rng(seed)
  return {'bias': {seg: jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32)
                   for seg, shape in bias_shapes(cfg).items()}} if bias_shapes(cfg) else None


CASES = {  # name: (model fields, passes run, passes with gradient, also loop_impl 'unroll')
    # untied attention and a per-pass bias, at the trained count and below it
    'untied_per_pass_n3_k1': (dict(tie_attention=False, router_bias='per_pass'), 3, 1, True),
    'untied_per_pass_n2_k1': (dict(tie_attention=False, router_bias='per_pass'), 2, 1, False),
    # tied, injected, scaled by the executed count, past the trained count
    'tied_concat_n4_k2': (dict(injection='concat', residual_scale='inverse_loops',
                               scale_passes='executed'), 4, 2, False),
}


@pytest.mark.parametrize('name', sorted(CASES))
def test_truncated_backprop_equals_the_stop_gradient_reference(name):
  fields, n, k, unroll = CASES[name]
  cfg, xla = make_cfg(**fields), rt(dispatch='xla')
  unrolled_rt = xla.with_run(loop_impl='unroll')
  params, bias = make_params(cfg), _random_bias(cfg)
  t = tokens(cfg, seed=4, batch=2, length=6)
  batch = {'inputs': t, 'targets': jnp.roll(t, -1, axis=1)}
  grad = lambda f: jax.jit(jax.value_and_grad(f, has_aux=True))
  got_m, got = jax.jit(lambda p: steps.loss_and_grads(
      p, LoopedMoE(cfg, runtime=xla), batch,
      steps.StepSettings(num_loops=n, backprop_loops=k), bias))(params)
  ref = _reference_loss(LoopedMoE(cfg, runtime=unrolled_rt), n - k)
  (_, ref_m), want = grad(lambda p: ref(p, batch, n, bias))(params)
  (_, full_m), full = grad(lambda p: loss_fn(p, LoopedMoE(cfg, runtime=xla), batch, 0.01,
                                             0.001, n, bias))(params)
  for key in ('loss', 'load_balance', 'z_loss', 'objective'):  # the forward is unchanged
    np.testing.assert_allclose(got_m[key], full_m[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(ref_m[key], full_m[key], rtol=1e-6, err_msg=key)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * scale,
                               err_msg=jax.tree_util.keystr(path))
  differs = max(float(jnp.max(jnp.abs(g - f))) for g, f in
                zip(jax.tree.leaves(got), jax.tree.leaves(full)))
  assert differs > 1e-3 * scale          # truncation changes the gradient
  if not cfg.tie_attention:              # the early passes' own attention gets none
    for i in range(cfg.core_layers):
      for w in jax.tree.leaves(got['core'][f'pass_attn_{i}']):
        assert not np.any(np.asarray(w[:n - k])) and np.any(np.asarray(w[n - k:n]))
  if not unroll:
    return
  # the unrolled loop under test agrees too
  _, unrolled = jax.jit(lambda p: steps.loss_and_grads(
      p, LoopedMoE(cfg, runtime=unrolled_rt), batch,
      steps.StepSettings(num_loops=n, backprop_loops=k), bias))(params)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(unrolled), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_a_draw_below_k_backpropagates_through_all_its_passes():
  """Huginn's rule, train.backprop_loops = k with sampled counts: a step drawing r passes
  has the gradient of the last min(k, r): r <= k gives exactly the full-backprop gradient
  (backprop_loops=0 at that r), r > k the truncated one; k above loops_low is accepted."""
  exp = build(_exp(None, loops_sampler='uniform', loops_low=1, loops_high=3, backprop_loops=2))
  tc, cfg = exp.train, make_cfg()
  model = LoopedMoE(cfg, runtime=rt(dispatch='xla'))
  params = make_params(cfg)
  t = tokens(cfg, seed=5, batch=2, length=6)
  batch = {'inputs': t, 'targets': jnp.roll(t, -1, axis=1)}
  grads = jax.jit(lambda p, n, k: steps.loss_and_grads(
      p, model, batch, steps.StepSettings(num_loops=n, backprop_loops=k))[1],
                  static_argnums=(1, 2))
  for r in (1, 2, 3):
    got, full = grads(params, r, depth.backprop(tc, r)), grads(params, r, 0)
    gap = max(float(jnp.max(jnp.abs(g - f))) for g, f in
              zip(jax.tree.leaves(got), jax.tree.leaves(full)))
    scale = max(float(jnp.max(jnp.abs(f))) for f in jax.tree.leaves(full))
    if r <= tc.backprop_loops:
      assert gap == 0.0, r
    else:
      assert gap > 1e-3 * scale, r
      want = grads(params, r, tc.backprop_loops)       # the truncated program's gradient
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_aux_losses_average_over_the_passes_run():
  """At 2 of 3 trained passes the aux losses are the mean over the visits run: prelude 1 +
  core 2 passes x 2 layers + coda 1 = 6 visits."""
  cfg = make_cfg()
  model = LoopedMoE(cfg, runtime=rt(dispatch='xla'))
  t = tokens(cfg)
  _, ex = jax.jit(lambda p: model.apply({'params': p}, t, num_loops=2))(make_params(cfg))
  visits = [np.ravel(ex['per_visit'][seg]['load_balance']) for seg in ('prelude', 'core', 'coda')]
  assert [v.size for v in visits] == [1, 4, 1]
  np.testing.assert_allclose(ex['load_balance'], np.mean(np.concatenate(visits)), rtol=1e-6)
  # the core's expert loads: one row per (pass run, layer), each routing every token k times
  load = np.asarray(ex['per_visit']['core']['load'])
  assert load.shape[:2] == (2, cfg.core_layers)
  np.testing.assert_array_equal(load.sum(-1), t.size * cfg.top_k)


def test_per_pass_bias_update_leaves_the_passes_not_run():
  """A step of 2 passes moves the per-pass bias of passes 1 and 2 only (of 3 trained)."""
  b = jnp.zeros((3, 2, 4))
  load = jnp.asarray(np.random.default_rng(0).random((2, 2, 4)), jnp.float32)
  new = steps.update_router_bias({'bias': {'core': b}}, {'core': load}, 0.1)['bias']['core']
  want = 0.1 * np.sign(np.mean(np.asarray(load), -1, keepdims=True) - np.asarray(load))
  np.testing.assert_array_equal(new[:2], want)
  np.testing.assert_array_equal(new[2], 0.0)


# (3) Sampled counts on a mesh equal one device -----------------------------------------------

MESH_MODEL = dict(vocab_size=256, d_model=32, num_heads=2, head_dim=16, expert_width=32,
                  top_k=2, prelude_layers=1, prelude_experts=4, core_layers=2, core_experts=4,
                  num_loops=2, coda_layers=1, coda_experts=4, injection='concat')


def _mesh_run(devices, mesh_cfg, tc, num_steps, batches):
  job = job_of(make_cfg(**MESH_MODEL), rt(dispatch='xla'), tc, batches.shape[-1] - 1,
               batches.shape[1], mesh_cfg, devices)
  state = job.create_state()
  out = []
  for s in range(num_steps):
    n, fn = depth.train_step_at(job, s)
    b = {'inputs': batches[s, :, :-1], 'targets': batches[s, :, 1:]}
    state, m = fn(state, steps.put_batch(b, job.batch_sh))
    out.append((n, float(m['loss']), float(m['load_balance']), float(m['grad_norm'])))
  return out, job.train_programs


def test_sampled_counts_on_a_mesh_equal_one_device():
  """uniform [1, 4] with gradient through the last pass: a data2 x expert4 run (the core's
  collectives once, both scans) draws the counts of the one-device run and matches its
  losses and gradient norms step by step (tolerance: tests/test_sharding.py's)."""
  tc = TrainConfig(lr=1e-2, warmup=0, loops_sampler='uniform', loops_low=1, loops_high=4,
                   backprop_loops=1, seed=3)   # counts 3, 3, 2, 2: both truncated
  num_steps = 4
  batches = np.random.default_rng(0).integers(0, 256, (num_steps, 8, 17), dtype=np.int32)
  one, n_one = _mesh_run(jax.devices()[:1], MeshConfig(data=1), tc, num_steps, batches)
  ep, n_ep = _mesh_run(None, MeshConfig(data=2, expert=4), tc, num_steps, batches)
  assert [r[0] for r in ep] == [r[0] for r in one] == [
      depth.sample_loops(tc, 2, s) for s in range(num_steps)]
  assert n_one == n_ep == len({r[0] for r in one}) >= 2
  np.testing.assert_allclose([r[1:] for r in ep], [r[1:] for r in one], rtol=2e-5)


# (4) Bad input: errors naming the key and the fix, before any compute ----------------------

def _exp(model=None, **train_kw):
  fields = dict(vocab_size=64, d_model=16, num_heads=2, expert_width=16, num_loops=2)
  fields.update(model or {})
  return experiment_config(model_config_dict(**fields), train=train_kw)


@pytest.mark.parametrize('model,train_kw,needles', [
    (dict(tie_attention=False), dict(loops_sampler='uniform', loops_high=3),
     ('train.loops_high=3', 'model.tie_attention', 'at most 2')),
    (dict(router_bias='per_pass'), dict(loops_sampler='uniform', loops_high=3),
     ('train.loops_high=3', "router_bias='per_pass'", 'loops_high=2')),
    (None, dict(loops_sampler='uniform', loops_high=17),
     ('train.loops_high=17', 'model.num_loops=2', 'at most 16')),
    (None, dict(loops_sampler='uniform', loops_low=3),
     ('train.loops_low=3', 'train.loops_high=0 (model.num_loops=2)', 'at least 3')),
    (None, dict(backprop_loops=3), ('train.backprop_loops=3', 'model.num_loops=2', 'at most 2')),
    (None, dict(loops_sampler='uniform', loops_low=1, loops_high=3, backprop_loops=4),
     ('train.backprop_loops=4', 'train.loops_high=3', 'at most 3')),
    (None, dict(loops_sampler='uniform', backprop_loops=3),
     ('train.backprop_loops=3', 'train.loops_high=0 (model.num_loops=2)', 'at most 2')),
    (None, dict(loops_low=0), ('train.loops_low=0', '>= 1')),
    (None, dict(loops_low=3, loops_high=2), ('train.loops_low=3', 'train.loops_high=2')),
    (None, dict(loops_sampler='poisson_lognormal'), ('train.loops_mean=0.0', 'loops_mean=4')),
    (None, dict(loops_sampler='poisson_lognormal', loops_mean=-1.0),
     ('train.loops_mean=-1.0', '> 0')),
    (None, dict(loops_sampler='gaussian'), ("train.loops_sampler='gaussian'", 'uniform')),
    (dict(exit='gate', exit_threshold=0.5), dict(backprop_loops=1),
     ('train.backprop_loops=1', "model.exit='gate'", 'backprop_loops=0')),
    (dict(core_layers=0, num_loops=1), dict(loops_sampler='uniform'),
     ('train.loops_sampler', 'model.core_layers')),
])
def test_bad_adaptive_depth_settings_name_the_key(model, train_kw, needles):
  with pytest.raises(ValueError) as err:
    build(_exp(model, **train_kw))
  for needle in needles:
    assert needle in str(err.value), (needle, str(err.value))


def test_bad_settings_are_refused_before_the_trainer_starts(tmp_path):
  work = tmp_path / 'run'
  with pytest.raises(ValueError, match='model.tie_attention'):
    train(_exp(dict(tie_attention=False), loops_sampler='uniform', loops_high=3), str(work))
  assert not work.exists()
  cfg = make_cfg()
  with pytest.raises(ValueError, match=r'backprop_loops=4: must lie in \[0, 3\]'):
    LoopedMoE(cfg).apply({'params': make_params(cfg)}, tokens(cfg), backprop_loops=4,
                         method='hidden')


# (5) The samplers' distributions ----------------------------------------------------------------

def test_uniform_counts_cover_the_range_evenly_and_depend_on_seed_and_step_only():
  tc = TrainConfig(loops_sampler='uniform', loops_low=2, loops_high=5, seed=7)
  draws = np.array([depth.sample_loops(tc, 3, s) for s in range(4000)])
  assert set(draws) == {2, 3, 4, 5}
  # each of 4 counts has frequency 1/4, SE sqrt(p (1 - p) / N) = 0.0068: 4.5 SE
  for v in range(2, 6):
    assert abs(np.mean(draws == v) - 0.25) < 0.031, v
  assert [depth.sample_loops(tc, 3, s) for s in (10, 3, 10)] == list(draws[[10, 3, 10]])
  other = TrainConfig(loops_sampler='uniform', loops_low=2, loops_high=5, seed=8)
  assert [depth.sample_loops(other, 3, s) for s in range(50)] != list(draws[:50])
  fixed = TrainConfig(loops_low=2, loops_high=5, seed=7)
  assert {depth.sample_loops(fixed, 3, s) for s in range(20)} == {3}


def test_poisson_lognormal_mean_before_the_clip_and_the_clip():
  """Huginn's r = Poisson(exp(tau)) + 1, tau ~ N(log m - sigma^2/2, sigma): E[r - 1] = m and
  Var[r] = m + m^2 (exp(sigma^2) - 1) (sigma 1/2; m = 4: 8.54). With N = 20,000 draws the
  sample mean's SE is sqrt(8.54 / N) = 0.021; the tolerance is 4.5 SE. The sample variance's
  SE (heavier tails) is a few percent of it: 15% tolerance."""
  m, n = 4.0, 20000
  rng = np.random.default_rng(0)
  r = np.array([depth.poisson_lognormal(rng, m) for _ in range(n)])
  var = m + m ** 2 * (np.exp(0.25) - 1)
  assert abs(np.mean(r - 1) - m) < 4.5 * np.sqrt(var / n)
  assert abs(np.var(r) / var - 1) < 0.15
  assert r.min() >= 1 and r.max() > 12                 # the long right tail
  tc = TrainConfig(loops_sampler='poisson_lognormal', loops_mean=m, loops_low=2, loops_high=6)
  clipped = np.array([depth.sample_loops(tc, 3, s) for s in range(2000)])
  assert clipped.min() == 2 and clipped.max() == 6      # both bounds reached, none passed
  assert np.mean(clipped) < m + 1                       # the clip cuts the right tail
