"""Routing diagnostics (analysis/diagnostics.py) against their definitions (docs/formulas.md, Foil):
property tests, a hand-worked routing record, the record layout of the model, traffic-matched
masking on a tiny model built to make its answers known, and diagnose end to end."""
from __future__ import annotations

import functools
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.runtime import HERE
from loopmoe_jax.train.run import RunDir
from loopmoe_jax.analysis import diagnostics as dg
from loopmoe_jax.analysis import masking, probe_set
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE


def test_b2_is_k_over_e_when_the_same_experts_are_always_chosen():
  n, d, l, k, e = 50, 3, 2, 2, 8
  sel = np.broadcast_to(np.array([5, 1]), (n, d, l, k))
  b = dg.balance(sel, e)
  np.testing.assert_allclose(b['B2_pooled'], k / e)
  np.testing.assert_allclose(b['B2_per_pass'], k / e)
  np.testing.assert_allclose(b['N2'], k)


def test_pooling_hides_per_pass_concentration():
  """E = kL, pass l always uses group l: pooled B2 = 1, per-pass B2 = k/E."""
  n, d, l, k = 20, 2, 3, 2
  e = k * l
  sel = np.empty((n, d, l, k), np.int64)
  for p in range(l):
    sel[:, :, p, :] = np.arange(p * k, p * k + k)
  b = dg.balance(sel, e)
  np.testing.assert_allclose(b['B2_pooled'], 1.0)
  np.testing.assert_allclose(b['B2_per_pass'], k / e)
  assert dg.distinct_experts(sel, e)['normalized'] == pytest.approx(1.0)


@pytest.mark.parametrize('e,l,k', [(8, 3, 2), (4, 4, 2), (16, 2, 1)])
def test_distinct_experts_within_bounds(e, l, k):
  rng = np.random.default_rng(e * l * k)
  n, d = 200, 3
  sel = np.stack([[[rng.choice(e, k, replace=False) for _ in range(l)] for _ in range(d)]
                  for _ in range(n)])
  u = dg.distinct_experts(sel, e)
  assert np.all(u['per_token'] >= k * d) and np.all(u['per_token'] <= d * min(e, k * l))
  assert u['lower_bound'] == k * d and u['upper_bound'] == d * min(e, k * l)
  assert 0 < u['normalized'] <= 1
  b = dg.balance(sel, e)
  assert np.all(b['B2_pooled'] >= k / e - 1e-12) and np.all(b['B2_pooled'] <= 1 + 1e-12)


@pytest.mark.parametrize('e', [8, 7])
def test_mmr_of_affine_logits_is_a_power(e):
  z = np.random.default_rng(e).standard_normal((30, 2, 3, e))
  a, b = 2.5, -4.0
  assert dg.mmr(a * z + b)['mean'] == pytest.approx(dg.mmr(z)['mean'] ** a, rel=1e-10)
  np.testing.assert_allclose(dg.mmr(a * z + b)['mmr'], dg.mmr(z)['mmr'] ** a, rtol=1e-10)
  assert np.all(dg.mmr(z)['mmr'] >= 1.0)


def test_maxvio_is_zero_for_a_balanced_load():
  e, k = 4, 2
  sel = np.array([[[[0, 1]], [[2, 3]]], [[[2, 3]], [[0, 1]]]])  # [N=2, D=2, L=1, k=2]
  sel = np.concatenate([sel, sel[:, :, :, ::-1]], axis=2)       # L=2
  v = dg.maxvio(sel, e, batch_size=2)
  np.testing.assert_allclose(v['global'], 0.0)
  np.testing.assert_allclose(v['per_batch'], 0.0)
  np.testing.assert_allclose(dg.balance(sel, e)['B2_pooled'], 1.0)
  assert k  # two choices per decision, all four experts used equally


def test_hand_worked_record():
  """N=2 tokens, D=1 layer, L=2 passes, k=1, E=4. Token 0: expert 0 then 1; token 1: 0 then 0.
  U = (2, 1), mean 1.5, normalised 1.5 / (1 * min(4, 2)) = 0.75. Pooled counts (3, 1, 0, 0):
  q = (3/4, 1/4, 0, 0), sum q^2 = 5/8, N2 = 1.6, B2 = 0.4. Pass 1: q = (1, 0, 0, 0), B2 = 1/4;
  pass 2: q = (1/2, 1/2, 0, 0), B2 = 1/2. MaxVio: load (3, 1, 0, 0), mean 1: 2; pass 1 (2,0,0,0):
  3; pass 2 (1,1,0,0): 1; per batch of 1 token: (1,1,0,0) -> 1, (2,0,0,0) -> 3."""
  sel = np.array([[[[0], [1]]], [[[0], [0]]]])
  assert sel.shape == (2, 1, 2, 1)
  u = dg.distinct_experts(sel, 4)
  np.testing.assert_array_equal(u['per_token'], [2, 1])
  assert (u['mean'], u['normalized']) == (1.5, 0.75)
  b = dg.balance(sel, 4)
  np.testing.assert_allclose(b['share_pooled'], [[0.75, 0.25, 0, 0]])
  np.testing.assert_allclose(b['N2'], [1.6])
  np.testing.assert_allclose(b['B2_pooled'], [0.4])
  np.testing.assert_allclose(b['B2_per_pass'], [[0.25, 0.5]])
  v = dg.maxvio(sel, 4, batch_size=1)
  np.testing.assert_allclose(v['global'], [2.0])
  np.testing.assert_allclose(v['global_per_pass'], [[3.0, 1.0]])
  np.testing.assert_allclose(v['per_batch'], [[1.0], [3.0]])
  # MMR, E=4 (m=2): (3, 1, 0, -2) gap 2; all equal: gap 0 -> aggregate exp(1).
  m = dg.mmr(np.array([[3.0, 1.0, 0.0, -2.0], [0.5, 0.5, 0.5, 0.5]]))
  np.testing.assert_allclose(m['mmr'], [math.exp(2), 1.0])
  assert m['mean'] == pytest.approx(math.e)
  # E=5 (m=3): (0, 1, 2, 3, 4) -> 4 - 2; z=(0,0,0,0,-c,-c,-c,-c) gives 1 (Foil's example).
  np.testing.assert_allclose(dg.mmr(np.array([0.0, 1, 2, 3, 4]))['mmr'], math.exp(2))
  np.testing.assert_allclose(dg.mmr(np.array([0.0] * 4 + [-3.0] * 4))['mmr'], 1.0)
  agg = dg.mmr_aggregates(np.array([3.0, 1.0, 0.0, -2.0]).reshape(1, 1, 1, 4))
  assert agg['overall'] == pytest.approx(math.exp(2))


# A tiny model built so that masking has known answers: zero router weights make every logit
# equal, so top-1 always picks expert 0 (lax.top_k keeps the lowest index on ties); expert 0
# writes nothing (down = 0) and attention writes nothing (o = 0), so the model maps a token to
# its own embedding and predicts it back (targets = inputs); the other experts write large
# random vectors. Experts 2, 3 carry no traffic; expert 0 carries all of it.
CFG = ModelConfig(vocab_size=37, d_model=16, num_heads=2, expert_width=8, top_k=1,
                  prelude_layers=0, core_layers=1, core_experts=4, num_loops=2, coda_layers=0,
                  tie_embeddings=True, renormalize=True)


def random_params(cfg: ModelConfig, masking_model: bool = False):
  """Params of the model's tree drawn with numpy (no compile of the init); with
  `masking_model` the construction above."""
  shapes = nn.unbox(jax.eval_shape(lambda: LoopedMoE(cfg).init(
      jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))['params'])
  rng = np.random.default_rng(0)

  def draw(path, s):
    name = path[-1].key
    x = rng.standard_normal(s.shape) / np.sqrt(s.shape[-2] if len(s.shape) > 1 else 1)
    if name == 'scale':
      x = np.ones(s.shape)
    elif name == 'embed':
      x = rng.standard_normal(s.shape)
    elif masking_model and name in ('router', 'o'):
      x = np.zeros(s.shape)
    elif masking_model and name == 'down':
      x = 10.0 * x
      x[0] = 0.0
    return jnp.asarray(x, s.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.lru_cache(maxsize=None)
def tiny_params():
  return random_params(CFG, masking_model=True)


def tiny_batches():
  tok = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 4, 8)).astype(np.int32)
  return [{'inputs': t, 'targets': t, 'mask': np.ones(t.shape, np.float32)} for t in tok]


def test_records_are_tokens_layers_passes_and_match_the_model_loads():
  cfg = ModelConfig(vocab_size=37, d_model=16, num_heads=2, expert_width=8, top_k=2,
                    prelude_layers=1, prelude_experts=4, core_layers=2, core_experts=8,
                    num_loops=3, coda_layers=1, coda_experts=4)
  params = random_params(cfg)
  tok = np.random.default_rng(2).integers(0, 37, (2, 5)).astype(np.int32)
  _, extras = jax.jit(lambda p, t: LoopedMoE(cfg).apply({'params': p}, t, return_routing=True))(
      params, tok)
  for seg, e in (('prelude', 4), ('core', 8), ('coda', 4)):
    sel = probe_set.to_NCL(seg, extras['routing'][seg]['experts'])
    logits = probe_set.to_NCL(seg, extras['routing'][seg]['logits'])
    assert sel.shape[0] == 10 and logits.shape[-1] == e
    load = np.asarray(extras['per_visit'][seg]['load'])  # core [L, D, E]; else [D, E]
    want = load.transpose(1, 0, 2) if seg == 'core' else load[:, None, :]
    np.testing.assert_array_equal(dg.counts(sel, e), want)
    top = np.argsort(-logits, axis=-1, kind='stable')[..., :2]
    np.testing.assert_array_equal(np.sort(top, -1), np.sort(sel, -1))
  assert probe_set.to_NCL('core', extras['routing']['core']['experts']).shape[1:3] == (2, 3)


def test_masking_zero_traffic_changes_nothing_and_the_only_used_expert_hurts():
  params, batches = tiny_params(), tiny_batches()
  base = probe_set.run(CFG, params, batches, runtime=HERE)
  sel = base['routing']['core']['experts']
  share = dg.balance(sel, 4)['share_pooled'][0]
  np.testing.assert_allclose(share, [1, 0, 0, 0])
  # the model without the collection and with an all-zero mask give the same loss
  unmasked = masking.masked_loss(CFG, params, batches, None, runtime=HERE)
  assert unmasked == pytest.approx(base['loss'], abs=1e-6)
  cold = masking.traffic_matched(CFG, params, batches, 'core', 0, [2, 3], share, draws=2,
                                 base_loss=base['loss'], runtime=HERE)
  assert cold['traffic'] == 0.0 and abs(cold['delta_loss']) < 1e-6
  hot = masking.traffic_matched(CFG, params, batches, 'core', 0, [0], share, draws=3,
                                base_loss=base['loss'], runtime=HERE)
  assert hot['traffic'] == 1.0 and hot['delta_loss'] > 0.5
  # no other set carries expert 0's traffic: the closest carry none, and removing them is free
  assert hot['random_traffic_mean'] == 0.0 and hot['random_traffic_max_gap'] == 1.0
  assert len(hot['random']) == 3 and abs(hot['random_delta_mean']) < 1e-6
  assert all(0 not in r['experts'] and len(r['experts']) <= 3 for r in hot['random'])
  with pytest.raises(ValueError, match='fewer than top_k'):
    masking.mask_tree(CFG, {('core', 0): [0, 1, 2, 3]})
  with pytest.raises(ValueError, match='no MoE layer'):
    masking.mask_tree(CFG, {('prelude', 0): [0]})


def test_masked_experts_are_never_chosen_and_nothing_is_nan():
  params, batches = tiny_params(), tiny_batches()
  res = probe_set.run(CFG, params, batches, masking.mask_tree(CFG, {('core', 0): [0, 1]}),
                      runtime=HERE)
  sel = res['routing']['core']['experts']
  assert np.all(sel == 2) and np.isfinite(res['loss'])
  # a router bias that favours the masked experts does not bring them back
  biased = CFG.replace(router_bias='shared')
  tree = {'params': params, 'router_bias': {'bias': {'core': jnp.asarray([[5.0, 5.0, 0, 0]])}}}
  routed = probe_set.run(biased, tree, batches, runtime=HERE)['routing']['core']['experts']
  assert np.all(routed < 2)
  res = probe_set.run(biased, tree, batches, masking.mask_tree(biased, {('core', 0): [0, 1]}),
                      runtime=HERE)
  assert np.all(res['routing']['core']['experts'] == 2) and np.isfinite(res['loss'])


def test_not_applicable_names_what_a_model_lacks():
  from loopmoe_jax.analysis.diagnose import not_applicable
  dense = CFG.replace(core_experts=0)
  assert 'all routing diagnostics' in not_applicable(dense)
  flat = CFG.replace(core_layers=0, prelude_layers=2, prelude_experts=4)
  assert 'no core layers' in ' '.join(not_applicable(flat).values())
  assert not_applicable(CFG) == {}


def test_diagnose_end_to_end_on_a_trained_workdir(tmp_path, monkeypatch):
  """A tiny run trained for 2 steps with a router bias: diagnose writes the JSON (figures
  consistent with the definitions), both heatmaps and the recurrence plot, with the probes
  and recurrence of the same checkpoint, read once (the trained bias routes every analysis:
  without it the model refuses to run); a probe set past the split, a negative option, and a workdir
  without checkpoints are errors naming the problem."""
  from loopmoe_jax.analysis import probe_set as ps
  from loopmoe_jax.analysis.diagnose import diagnose, summary_lines
  from loopmoe_jax.train.trainer import train
  from helpers import tiny
  work, out = str(tmp_path / 'run'), str(tmp_path / 'diag')
  cfg = tiny(steps=2, save_every=2, eval_every=2, routing_every=2, bias_rate=0.01)
  cfg.model.router_bias = 'shared'
  trained = train(cfg, work)
  reads = []  # every checkpoint read (train/run.py: diagnose reads it once for all analyses)
  from loopmoe_jax.train import run as run_lib
  real_read = run_lib._read  # pylint: disable=protected-access
  monkeypatch.setattr(run_lib, '_read', lambda *a, **k: reads.append(a) or real_read(*a, **k))
  r = diagnose(work, out, tokens=40, mask_draws=2, log=lambda *_: None, probes=32,
               recurrence=3, evals=2)
  monkeypatch.undo()
  assert len(reads) == 1, reads
  assert r['probe_set']['tokens'] == 40  # exactly: 3 windows of 16, the last 8 masked out
  assert (r['probe_set']['windows'], r['probe_set']['masked_tail']) == (3, 8)
  assert summary_lines(r)[0].startswith('step 2: probe set 40 tokens, the first of the ')
  assert os.path.getsize(os.path.join(out, 'recurrence.png')) > 1000
  # the trainer's own validation loss at its trained pass count, through the stored bias
  assert r['recurrence']['val_loss']['2'] == pytest.approx(trained['val_loss'], rel=1e-5)
  for sim in r['probes']['qkv_cosine'].values():  # [D][L][L]: a visit is itself, symmetric
    sim = np.asarray(sim)
    np.testing.assert_allclose(np.diagonal(sim, axis1=1, axis2=2), 1.0, atol=1e-5)
    np.testing.assert_allclose(sim, np.swapaxes(sim, 1, 2), atol=1e-6)
  loaded = RunDir(work).load()
  model_cfg, params, config = loaded.model_cfg, loaded.params, loaded.config
  with pytest.raises(ValueError, match='apply needs the trained bias'):
    ps.run(model_cfg, params, ps.probe_batches(config['data'], model_cfg, 16)[0], runtime=HERE)
  with pytest.raises(ValueError, match='--probes=-1: must be >= 0'):
    diagnose(work, out, tokens=40, probes=-1)
  with pytest.raises(ValueError, match=r'--mask_top=3: must be <= model.core_experts - '
                                       r'model.top_k = 2'):
    diagnose(work, out, tokens=40, mask_top=3)
  with open(os.path.join(out, 'diagnostics.json')) as f:
    assert json.load(f)['step'] == 2
  for name in ('expert_load.png', 'mmr.png'):
    assert os.path.getsize(os.path.join(out, name)) > 1000
  core = r['segments']['core']
  assert core['passes'] == 2 and len(core['B2_per_pass'][0]) == 2
  assert core['U_bounds'][0] <= core['U_mean'] <= core['U_bounds'][1]
  assert core['U_normalized'] == pytest.approx(core['U_mean'] / core['U_bounds'][1])
  assert np.sum(core['load_share_pooled']) == pytest.approx(1.0)
  assert set(r['segments']) == {'prelude', 'core'}
  assert len(r['masking']) == 1 and len(r['masking'][0]['random']) == 2
  time_line = next(l for l in summary_lines(r) if l.startswith('time:'))
  # the analyses that ran are timed by name; evals did not run and are not named
  assert all(f'; {name} ' in time_line for name in ('probes', 'evals', 'recurrence'))
  with pytest.raises(ValueError, match='validation split'):
    diagnose(work, out, tokens=10**9)
  with pytest.raises(FileNotFoundError, match='no checkpoint'):
    diagnose(str(tmp_path / 'empty'), out, tokens=40)


def test_probe_set_default_is_foils_at_gpu_scale_and_the_small_one_at_cpu():
  """Foil measures expert use "over 255,500 probe tokens" (Sec. 2.3): the gpu-scale default,
  exactly that many tokens of the validation split (here the Foil smoke config's: 2,000 windows
  of 128 read, the tail past 255,500 masked out); the cpu default stays 16,384."""
  from loopmoe_jax.experiment import load_config
  from loopmoe_jax.replicate.foil import PAPER
  assert probe_set.setting(None, 'gpu')[0] == 255_500 == PAPER['probe_tokens']
  assert probe_set.setting(None, 'cpu')[0] == 16_384
  assert probe_set.setting(100, 'gpu') == (100, 'given (--tokens)')
  with pytest.raises(ValueError, match="--scale='tpu': must be one of"):
    probe_set.setting(None, 'tpu')
  cfg = load_config('configs/foil.py:base,smoke')
  batches, info = probe_set.probe_batches(cfg.data.to_dict(), ModelConfig.from_dict(cfg.model),
                                          probe_set.setting(None, 'gpu')[0])
  assert sum(float(b['mask'].sum()) for b in batches) == info['tokens'] == 255_500
  assert (info['windows'], info['windows_read']) == (math.ceil(255_500 / 128), 2000)
  assert 'embedded corpus (validation)' in probe_set.describe(info)


def test_probe_set_records_and_loss_cover_exactly_the_requested_tokens():
  """40 tokens in windows of 16: the records are those of the first 40 positions and the loss
  their mean NLL, computed here from the model's logits over the three windows."""
  from helpers import tiny
  cfg = CFG.replace(vocab_size=256)
  params = random_params(cfg)
  batches, info = probe_set.probe_batches(tiny().data.to_dict(), cfg, 40)
  assert len(batches) == 1 and batches[0]['inputs'].shape == (3, 16) and info['tokens'] == 40
  res = probe_set.run(cfg, params, batches, tokens=info['tokens'], runtime=HERE)
  full = probe_set.run(cfg, params, [dict(batches[0], mask=np.ones((3, 16), np.float32))],
                       runtime=HERE)
  for n in ('experts', 'logits'):
    np.testing.assert_array_equal(res['routing']['core'][n], full['routing']['core'][n][:40])
  logits, _ = LoopedMoE(cfg).apply({'params': params}, jnp.asarray(batches[0]['inputs']))
  nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32))),
                            batches[0]['targets'][..., None], -1)[..., 0]
  assert res['loss'] == pytest.approx(float(nll.reshape(-1)[:40].mean()), rel=1e-5)
