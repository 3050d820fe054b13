"""The looped MoE model against a slow reference (tests/reference.py) and its invariants.

Params for most tests are drawn here with numpy over the shapes of `jax.eval_shape(init)`
(norm gains away from 1 so a missing gain shows); only the initialisation test runs the
real init. Configs are tiny; every test compares numbers, never shapes alone.
"""
from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax import accounting
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.decode import generate, init_cache
from loopmoe_jax.model import LoopedMoE, for_init

import reference
from helpers import (B, BASE, T, apply_fn, decode_all, decode_step_fn, make, make_cfg,
                     make_params, param_shapes, rt, tokens)

TOL = dict(rtol=1e-4, atol=1e-4)
def assert_close(actual, desired, **tol):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), **(tol or TOL))


# 1. The model equals the slow reference ---------------------------------------------------

# Shared with the decode, causality and generate tests (so their compiled forwards are reused).
UNTIED = dict(tie_attention=False, residual_scale='inverse_loops', injection='concat',
              num_kv_heads=2)
TIED_GQA = dict(injection='add', num_kv_heads=2, head_dim=6, residual_scale='inverse_loops')

REFERENCE_CONFIGS = {
    'tied_mha': dict(),
    'untied_inverse_loops_concat_gqa': UNTIED,
    'tied_add_gqa_head_dim': TIED_GQA,
    'untied_no_gain_tied_embed_xla': dict(tie_attention=False, norm_gain=False,
                                          tie_embeddings=True, dispatch='xla', num_kv_heads=1),
    'shared_dense_coda_no_renorm': dict(num_shared_experts=2, shared_expert_width=4,
                                        coda_experts=0, renormalize=False, top_k=1,
                                        dispatch='reference'),
    'dense_core_untied_add': dict(core_experts=0, prelude_experts=0, tie_attention=False,
                                  injection='add', num_kv_heads=2),
}


@pytest.mark.parametrize('name', list(REFERENCE_CONFIGS))
def test_forward_matches_reference(name):
  cfg, runtime = make(**REFERENCE_CONFIGS[name])
  params, toks = make_params(cfg), tokens(cfg)
  logits, extras = apply_fn(cfg, runtime=runtime)(params, toks)
  want, visits = reference.forward(cfg, params, toks)
  assert logits.dtype == jnp.float32
  assert_close(logits, want)
  assert visits, 'every config here has at least one MoE layer'
  assert_close(extras['load_balance'], np.mean([v['load_balance'] for v in visits]), rtol=1e-5)
  assert_close(extras['z_loss'], np.mean([v['z_loss'] for v in visits]), rtol=1e-5)


# 2. scan == unrolled Python loop ------------------------------------------------------------

@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
def test_scan_equals_unroll(tie):
  cfg = make_cfg(prelude_layers=0, coda_layers=0, tie_attention=tie, core_experts=3,
                 expert_width=4, injection='concat' if tie else 'add',
                 residual_scale='inverse_loops')
  scan_rt, unroll_rt = (rt(dispatch='reference', loop_impl=impl) for impl in ('scan', 'unroll'))
  params = make_params(cfg)
  assert jax.tree.structure(nn.unbox(jax.eval_shape(
      LoopedMoE(cfg, runtime=unroll_rt).init, jax.random.key(0),
      jnp.zeros((1, 4), jnp.int32))['params'])) == jax.tree.structure(params)
  toks = tokens(cfg)
  r = jax.random.normal(jax.random.key(3), (B, T, cfg.vocab_size))

  def run(runtime):
    def loss(p):
      logits, extras = LoopedMoE(cfg, runtime=runtime).apply({'params': p}, toks)
      return jnp.sum(logits * r) + extras['load_balance'] + extras['z_loss'], (logits, extras)
    return jax.jit(jax.grad(loss, has_aux=True))(params)

  g_scan, (logits_scan, ex_scan) = run(scan_rt)
  g_unroll, (logits_unroll, ex_unroll) = run(unroll_rt)
  assert_close(logits_scan, logits_unroll, rtol=1e-5, atol=1e-5)
  for key in ('load_balance', 'z_loss'):
    assert_close(ex_scan[key], ex_unroll[key], rtol=1e-5, atol=1e-6)
    assert_close(ex_scan['per_visit']['core'][key], ex_unroll['per_visit']['core'][key],
                 rtol=1e-5, atol=1e-6)
  assert ex_scan['per_visit']['core']['load_balance'].shape == (3, 2)
  jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-4, atol=1e-5), g_scan, g_unroll)
  # The gradient reaches the shared core weights (the test would pass vacuously otherwise).
  assert np.abs(g_scan['core']['body']['layer_1']['moe']['gate']).max() > 0


# 3. L = 1 equals the non-looped model -------------------------------------------------------

@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
def test_single_pass_equals_flat_stack(tie):
  common = dict(prelude_experts=4, core_experts=4, coda_experts=4, tie_attention=tie,
                residual_scale='inverse_loops')
  looped = make_cfg(prelude_layers=1, core_layers=2, num_loops=1, coda_layers=1, **common)
  flat = make_cfg(prelude_layers=3, core_layers=0, coda_layers=1, **common)
  lp = make_params(looped)
  fp = {k: v for k, v in lp.items() if k != 'core'}
  fp['prelude'] = dict(lp['prelude'])
  for i in range(looped.core_layers):
    layer = dict(lp['core']['body'][f'layer_{i}'])
    if not tie:
      layer['attn'] = jax.tree.map(lambda w: w[0], lp['core'][f'pass_attn_{i}'])
    fp['prelude'][f'layer_{looped.prelude_layers + i}'] = layer
  assert jax.tree.structure(fp) == jax.tree.structure(param_shapes(flat))
  toks = tokens(looped)
  ref = rt(dispatch='reference')
  logits_l, ex_l = apply_fn(looped, runtime=ref)(lp, toks)
  logits_f, ex_f = apply_fn(flat, runtime=ref)(fp, toks)
  assert_close(logits_l, logits_f, rtol=1e-5, atol=1e-5)
  assert_close(ex_l['load_balance'], ex_f['load_balance'], rtol=1e-5)
  assert_close(ex_l['z_loss'], ex_f['z_loss'], rtol=1e-5)


# 4. Param counts --------------------------------------------------------------------------

COUNT_CFG = dict(num_kv_heads=2, head_dim=6, num_shared_experts=1, injection='concat')


def test_tied_param_count_is_independent_of_loops():
  counts = {L: accounting.param_count(param_shapes(make_cfg(num_loops=L, **COUNT_CFG)))
            for L in (1, 2, 4, 8)}
  assert len(set(counts.values())) == 1, counts


def test_untied_param_count_grows_by_one_attention_set_per_extra_pass():
  base = param_shapes(make_cfg(num_loops=1, tie_attention=False, **COUNT_CFG))
  attn_map = accounting.param_count(base['prelude']['layer_0']['attn'])
  d = BASE['core_layers']
  # q, k, v, o with GQA (2 kv heads) and head_dim 6: d*K*(2H + 2G).
  assert attn_map == 16 * 6 * (2 * 4 + 2 * 2)
  for L in (2, 4, 8):
    count = accounting.param_count(param_shapes(make_cfg(num_loops=L, tie_attention=False,
                                                         **COUNT_CFG)))
    assert count - accounting.param_count(base) == (L - 1) * d * attn_map, L


@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
def test_core_experts_are_stored_once(tie):
  one = param_shapes(make_cfg(num_loops=1, tie_attention=tie, **COUNT_CFG))
  eight = param_shapes(make_cfg(num_loops=8, tie_attention=tie, **COUNT_CFG))
  # Everything but the per-pass attention is the same tree with the same shapes.
  body_1, body_8 = one['core']['body'], eight['core']['body']
  assert jax.tree.map(lambda s: s.shape, body_1) == jax.tree.map(lambda s: s.shape, body_8)
  e, d, f = BASE['core_experts'], BASE['d_model'], BASE['expert_width']
  for i in range(BASE['core_layers']):
    moe = body_8[f'layer_{i}']['moe']
    assert moe['gate'].shape == moe['up'].shape == (e, d, f)
    assert moe['down'].shape == (e, f, d)
    assert moe['router'].shape == (d, e)
    assert moe['shared']['gate'].shape == (d, f)
  if not tie:
    assert eight['core']['pass_attn_0']['q'].shape[0] == 8


@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
def test_accounting_total_equals_real_count(tie):
  for kw in (COUNT_CFG, dict(tie_embeddings=True, norm_gain=False, coda_experts=0)):
    cfg = make_cfg(tie_attention=tie, **kw)
    assert accounting.count(cfg)['params_total'] == accounting.param_count(param_shapes(cfg))


# 5. Untied passes get their own initialisation ------------------------------------------------

def test_untied_passes_initialised_differently():
  cfg = make_cfg(tie_attention=False, num_loops=4, prelude_layers=0, coda_layers=0,
                 core_layers=1, core_experts=0, tie_embeddings=True, d_model=8, num_heads=2,
                 expert_width=4)
  params = nn.unbox(jax.jit(LoopedMoE(cfg).init)(jax.random.key(0),
                                                jnp.zeros((1, 2), jnp.int32))['params'])
  for i in range(cfg.core_layers):
    for name, w in params['core'][f'pass_attn_{i}'].items():
      w = np.asarray(w)
      assert w.shape[0] == cfg.num_loops
      for a in range(cfg.num_loops):
        assert np.std(w[a]) > 0.05, (i, name, a)
        for b in range(a + 1, cfg.num_loops):
          assert np.abs(w[a] - w[b]).max() > 1e-2, (i, name, a, b)


# 6. Causality by gradients ------------------------------------------------------------------

def test_causality_by_gradients():
  cfg = make_cfg(**UNTIED)
  params = make_params(cfg)
  x = jax.random.normal(jax.random.key(5), (B, T, cfg.d_model))
  proj = jax.random.normal(jax.random.key(6), (cfg.vocab_size,))

  def out_0T(x_BTD):
    logits, _ = LoopedMoE(cfg).apply({'params': params}, x_BTD, method='from_embeddings')
    return logits[0] @ proj

  jac = np.asarray(jax.jit(jax.jacrev(out_0T))(x))  # [T, B, T, D]
  for t in range(T):
    assert np.all(jac[t, 0, t + 1:] == 0), f'position {t} sees the future'
    assert np.all(jac[t, 1:] == 0), f'position {t} of row 0 sees another row'
    assert np.abs(jac[t, 0, t]).max() > 0
    if t:
      assert np.abs(jac[t, 0, :t]).max() > 1e-6, f'position {t} ignores its past'


# 7. KV-cache decoding == full forward -------------------------------------------------------

step_fn = decode_step_fn


DECODE_CONFIGS = {'untied_gqa_concat': UNTIED, 'tied_gqa_add': TIED_GQA}


@pytest.mark.parametrize('name', list(DECODE_CONFIGS))
def test_decode_matches_full_forward(name):
  cfg = make_cfg(**DECODE_CONFIGS[name])
  params, toks = make_params(cfg), tokens(cfg)
  full, _ = apply_fn(cfg)(params, toks)
  got, cache = decode_all(cfg, params, toks, prefix=3, max_len=T + 3)
  assert_close(got, full)
  for i in range(cfg.core_layers):
    for kv in ('k', 'v'):
      assert cache['core']['body'][f'layer_{i}']['attention'][kv].shape == (
          cfg.num_loops, B, cfg.kv_heads, T + 3, cfg.resolved_head_dim)  # heads-major
  assert cache['prelude']['layer_0']['attention']['k'].shape == (
      B, cfg.kv_heads, T + 3, cfg.resolved_head_dim)
  assert int(cache['position']) == T


def test_decode_with_more_loops_on_tied_model():
  cfg = make_cfg(num_loops=2, residual_scale='inverse_loops', injection='concat')
  ref = rt(dispatch='reference')
  params, toks = make_params(cfg), tokens(cfg)
  full, _ = apply_fn(cfg, num_loops=4, runtime=ref)(params, toks)
  got, cache = decode_all(cfg, params, toks, prefix=2, max_len=T, num_loops=4, runtime=ref)
  assert_close(got, full)
  assert cache['core']['body']['layer_0']['attention']['k'].shape[0] == 4
  # And it is not the trained-depth forward.
  default, _ = reference.forward(cfg, params, toks)
  assert np.abs(np.asarray(default) - np.asarray(full)).max() > 1e-3


# 8. generate == argmax of repeated full forwards -------------------------------------------

def test_generate_greedy_matches_full_forward_loop():
  cfg = make_cfg(**UNTIED)
  params = make_params(cfg)
  prompt, steps = tokens(cfg, seed=7, length=3), T - 3
  got = generate(cfg, params, prompt, steps=steps, key=jax.random.key(0))
  # Slow loop: full forward over a zero-padded buffer (causal, so padding is never seen).
  buf = np.zeros((B, 3 + steps), np.int32)
  buf[:, :3] = np.asarray(prompt)
  fwd = apply_fn(cfg)
  for t in range(3, 3 + steps):
    logits, _ = fwd(params, jnp.asarray(buf))
    buf[:, t] = np.argmax(np.asarray(logits[:, t - 1]), axis=-1)
  np.testing.assert_array_equal(np.asarray(got), buf)


# 9. Test-time recurrence ----------------------------------------------------------------------

def test_tied_test_time_recurrence_matches_reference():
  cfg = make_cfg(num_loops=2, residual_scale='inverse_loops', injection='concat')
  params, toks = make_params(cfg), tokens(cfg)
  logits, _ = apply_fn(cfg, num_loops=5, runtime=rt(dispatch='reference'))(params, toks)
  want, visits = reference.forward(cfg, params, toks, num_loops=5)
  assert_close(logits, want)
  assert sum(v['segment'] == 'core' for v in visits) == 5 * cfg.core_layers


@pytest.mark.parametrize('scale_passes', ['trained', 'executed'])
def test_scale_by_trained_or_executed_passes(scale_passes):
  """model.scale_passes: 1/r with r the trained passes (default) or the executed ones; with
  'executed', running 5 passes equals a model trained for 5 (tied weights do not depend on r),
  and at the trained count both options agree."""
  cfg = make_cfg(num_loops=2, residual_scale='inverse_loops', scale_passes=scale_passes)
  ref = rt(dispatch='reference')
  params, toks = make_params(cfg), tokens(cfg)
  logits, _ = apply_fn(cfg, num_loops=5, runtime=ref)(params, toks)
  assert_close(logits, reference.forward(cfg, params, toks, num_loops=5)[0])
  as_five, _ = apply_fn(cfg.replace(num_loops=5, scale_passes='trained'), runtime=ref)(params,
                                                                                     toks)
  same = np.abs(np.asarray(logits) - np.asarray(as_five)).max() < 1e-5
  assert same == (scale_passes == 'executed')
  other = cfg.replace(scale_passes='executed' if scale_passes == 'trained' else 'trained')
  assert_close(apply_fn(cfg, runtime=ref)(params, toks)[0],
               apply_fn(other, runtime=ref)(params, toks)[0])


def test_untied_refuses_more_loops_than_trained():
  cfg = make_cfg(tie_attention=False, num_loops=2)
  params, toks = make_params(cfg), tokens(cfg)
  with pytest.raises(ValueError, match='num_loops'):
    LoopedMoE(cfg).apply({'params': params}, toks, num_loops=3)
  with pytest.raises(ValueError, match='num_loops'):
    init_cache(cfg, B, T, num_loops=3)


def test_untied_fewer_loops_uses_first_slices():
  cfg = make_cfg(tie_attention=False, num_loops=3)
  params, toks = make_params(cfg), tokens(cfg)
  logits, _ = apply_fn(cfg, num_loops=2, runtime=rt(dispatch='reference'))(params, toks)
  want, _ = reference.forward(cfg, params, toks, num_loops=2)
  assert_close(logits, want)


# 10. Routing records and the averaged aux loss ------------------------------------------------

def test_routing_records_and_load_balance_average():
  cfg = make_cfg(num_loops=3, prelude_experts=0, coda_experts=4)
  params, toks = make_params(cfg), tokens(cfg)
  logits, extras = apply_fn(cfg, routing=True)(params, toks)
  routing = extras['routing']
  assert set(routing) == {'core', 'coda'}  # the dense prelude records nothing
  L, D, E, k = cfg.num_loops, cfg.core_layers, cfg.core_experts, cfg.top_k
  experts = np.asarray(routing['core']['experts'])
  rec_logits = np.asarray(routing['core']['logits'])
  assert experts.shape == (L, D, B, T, k)
  assert rec_logits.shape == (L, D, B, T, E)
  np.testing.assert_array_equal(experts, np.argsort(-rec_logits, axis=-1, kind='stable')[..., :k])

  # The records are the real routing: they match the reference's visits.
  _, visits = reference.forward(cfg, params, toks)
  for v in visits:
    if v['segment'] == 'core':
      assert_close(rec_logits[v['pass'], v['layer']], v['logits'])
      np.testing.assert_array_equal(experts[v['pass'], v['layer']], v['experts'])

  def switch(experts_NK, logits_NE):
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits_NE), axis=-1))
    counts = np.bincount(experts_NK.reshape(-1), minlength=logits_NE.shape[-1])
    f = counts / experts_NK.size
    return logits_NE.shape[-1] * np.sum(f * probs.mean(axis=0))

  per_visit = []
  core_lb = np.zeros((L, D))
  for l in range(L):
    for i in range(D):
      core_lb[l, i] = switch(experts[l, i].reshape(-1, k), rec_logits[l, i].reshape(-1, E))
  per_visit += list(core_lb.reshape(-1))
  coda = routing['coda']
  for i in range(cfg.coda_layers):
    per_visit.append(switch(np.asarray(coda['experts'][i]).reshape(-1, k),
                            np.asarray(coda['logits'][i]).reshape(-1, E)))
  assert len(per_visit) == L * D + cfg.coda_layers
  if 'load' in extras['per_visit']['core']:  # expert loads per visit, [L, D, E]
    counts = np.stack([np.bincount(experts[l, i].reshape(-1), minlength=E)
                       for l in range(L) for i in range(D)]).reshape(L, D, E)
    np.testing.assert_array_equal(np.asarray(extras['per_visit']['core']['load']), counts)
  assert_close(extras['per_visit']['core']['load_balance'], core_lb, rtol=1e-5)
  assert_close(extras['load_balance'], np.mean(per_visit), rtol=1e-5)
  # Averaged over visits, not summed, and not over layers first then passes.
  assert np.std(per_visit) > 0


def test_decode_past_the_cache_length_is_an_error():
  from loopmoe_jax.decode import decode_step, init_cache
  cfg = ModelConfig(vocab_size=37, d_model=16, num_heads=4, expert_width=8)
  runtime = rt(dispatch='reference')
  toks = jax.random.randint(jax.random.key(1), (1, 5), 0, 37)
  params = jax.jit(LoopedMoE(cfg, runtime=runtime).init)(jax.random.key(0), toks)['params']
  jitted = jax.jit(lambda c, t: decode_step(cfg, params, c, t, runtime=runtime))
  _, cache = jitted(init_cache(cfg, 1, max_len=4), toks[:, :4])  # fills all 4 slots
  with pytest.raises(ValueError, match='max_len=4'):  # concrete position: raises up front
    decode_step(cfg, params, cache, toks[:, 4:], runtime=runtime)
  assert np.isnan(np.asarray(jitted(cache, toks[:, 4:])[0])).all()  # traced: NaN logits


@pytest.mark.parametrize('fields', [
    dict(prelude_experts=4, core_experts=6, coda_experts=3, num_shared_experts=1),
    dict(tie_attention=False, num_loops=3, injection='concat', tie_embeddings=True),
    dict(prelude_experts=0, coda_experts=0, norm_gain=False, injection='add'),
], ids=['experts_shared', 'untied_concat', 'dense_ends'])
def test_every_parameter_dimension_has_a_logical_axis(fields):
  """What sharding rules (expert parallelism) will rely on: every dimension of every parameter
  is named from layers.LOGICAL_AXES, an 'experts' dimension is as long as its segment's expert
  count, a 'loops' one as long as the passes."""
  from loopmoe_jax.layers import LOGICAL_AXES, param  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(**fields)
  boxed = jax.eval_shape(lambda: LoopedMoE(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  leaves = jax.tree_util.tree_flatten_with_path(boxed['params'], is_leaf=is_box)[0]
  experts = {'prelude': cfg.prelude_experts, 'core': cfg.core_experts, 'coda': cfg.coda_experts}
  seen = set()
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path)
    assert is_box(leaf), where
    assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= set(LOGICAL_AXES), where
    for name, size in zip(leaf.names, leaf.value.shape):
      if name == 'experts':
        assert size == experts[path[0].key], where
      if name == 'loops':
        assert size == cfg.num_loops, where
    seen |= set(leaf.names)
  assert 'experts' in seen

  class Bad(nn.Module):
    @nn.compact
    def __call__(self):
      return param(self, 'w', (2, 3), ('embed', 'expert'), nn.initializers.zeros, jnp.float32)
  with pytest.raises(ValueError, match=r"w: axis names \['expert'\]"):
    Bad().init(jax.random.key(0))


@pytest.mark.parametrize('dispatch,impl', [('tiled', 'chunked'), ('reference', 'xla')])
def test_init_is_the_same_under_every_dispatch_and_attention(dispatch, impl):
  """for_init (what the trainer, the accounting, decode and export initialise with) gives the
  params, router bias and cache that the model's own settings give, bit for bit."""
  cfg = make_cfg(router_bias='per_pass', num_kv_heads=2)
  runtime = rt(dispatch=dispatch, attention_impl=impl, attention_block=4)
  toks = tokens(cfg)
  for model in (LoopedMoE(cfg, runtime=runtime), LoopedMoE(cfg, decode=True, runtime=runtime)):
    want = jax.jit(model.init)(jax.random.key(3), toks)
    got = jax.jit(for_init(model).init)(jax.random.key(3), toks)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert {'params', 'router_bias'} <= set(want) and ('cache' in want) == model.decode
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
