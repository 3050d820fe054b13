"""The hf-looped export's per-token exit and shared KV layouts (loopmoe_jax/export/hf_looped_src/
core_loopmoe.py): tiny models with the gate or the KL exit, and with model.kv_cache
'last_pass' / 'first_pass', loaded in transformers (CPU, float32) and compared with our
forward with the exit at 1, the trained and twice the trained pass count, our decode step by
step and our greedy decode; the settings checked at the forward; the gate's round trip."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.export import files, looped_io, safetensors_io
from loopmoe_jax.model import LoopedMoE, variables

from helpers import make_params, needs_torch, torch, transformers
from test_export_looped import BASE, RT, TOKENS, export, load, ours, theirs


EXITS = {'gate': dict(exit='gate', exit_threshold=0.5, num_kv_heads=2, tie_embeddings=True),
         'kl': dict(exit='kl', exit_threshold=0.05, residual_scale='inverse_loops')}


def exit_model(name):
  """(config, params) of a tiny model with the exit EXITS[name]; the gate's w drawn so that
  tokens leave the core at different passes."""
  cfg = ModelConfig(**{**BASE, **EXITS[name]})
  params = make_params(cfg.replace(exit='none', exit_threshold=0.0))
  if cfg.exit == 'gate':
    w = 0.5 * np.random.default_rng(1).standard_normal(cfg.d_model)
    params = dict(params, exit_gate_w=jnp.asarray(w, jnp.float32),
                  exit_gate_b=jnp.asarray(0.1, jnp.float32))
  return cfg, params


@functools.lru_cache(maxsize=None)
def _exit_forward(cfg, num_loops):
  return jax.jit(lambda p, t: LoopedMoE(cfg, runtime=RT).apply(
      variables(p), t, num_loops=num_loops, early_exit=True))


@needs_torch
@pytest.mark.parametrize('name', ['gate', pytest.param('kl', marks=pytest.mark.slow)])
def test_exit_logits_equal_ours_at_every_pass_count(name, tmp_path):
  """The per-token exit (model.exit): the forward with the exit (early_exit=True) in
  transformers against ours at 1, the trained and twice the trained pass count, and the full
  forward (a forward without a cache runs every pass) at the trained count (the other counts'
  full forward: the tests above); tokens leave at different passes, and the exit changes the
  logits."""
  cfg, params = exit_model(name)
  model = load(export(cfg, params, None, str(tmp_path / 'hf')))
  assert (model.config.exit, model.config.exit_threshold) == (cfg.exit, cfg.exit_threshold)
  full = ours(cfg, params, None, TOKENS, 3)
  err = float(np.max(np.abs(theirs(model, TOKENS) - full)))
  print(f'{name} full forward: max abs logit error {err:.2e}')
  assert err < 1e-4
  for n in (1, 3, 6):
    logits, extras = _exit_forward(cfg, n)(params, jnp.asarray(TOKENS))
    exited = np.asarray(logits)
    err = float(np.max(np.abs(theirs(model, TOKENS, num_loops=n, early_exit=True) - exited)))
    print(f'{name} num_loops={n} with the exit: max abs logit error {err:.2e}')
    assert err < 1e-4
  passes = np.asarray(extras['exit']['passes_BT'])
  assert passes.min() < passes.max()  # tokens leave at different passes
  assert np.max(np.abs(exited - ours(cfg, params, None, TOKENS, 6))) > 1e-2


@needs_torch
@pytest.mark.slow
def test_exit_generate_equals_ours(tmp_path):
  """Greedy generate with the gate exit (applied with transformers' cache, the skipped
  passes' entries holding the last computed pass's K/V) equals our decode at two pass
  counts, under the per-pass and the 'last_pass' KV layout; with early_exit=False it is our
  decode without the exit, and the exit changes the tokens."""
  from loopmoe_jax import decode
  cfg, params = exit_model('gate')
  model = load(export(cfg, params, None, str(tmp_path / 'hf')))
  shared = load(export(cfg.replace(kv_cache='last_pass'), params, None, str(tmp_path / 'kv')))
  prompt = torch.tensor(TOKENS[:, :4])
  changed = False
  for n in (3, 6):
    run = lambda **kw: model.generate(prompt, max_new_tokens=12, do_sample=False,
                                      attention_mask=torch.ones_like(prompt), num_loops=n,
                                      **kw).numpy()
    ref = lambda c: np.asarray(decode.generate(c, params, jnp.asarray(TOKENS[:, :4]), 12,
                                               jax.random.key(0), 0.0, num_loops=n,
                                               runtime=RT))
    with_exit, without = ref(cfg), ref(cfg.replace(exit='none', exit_threshold=0.0))
    np.testing.assert_array_equal(run(), with_exit)
    np.testing.assert_array_equal(run(early_exit=False), without)
    changed |= not np.array_equal(with_exit, without)
    np.testing.assert_array_equal(  # under the shared layout 'last_pass' too
        shared.generate(prompt, max_new_tokens=12, do_sample=False, num_loops=n,
                        attention_mask=torch.ones_like(prompt)).numpy(),
        ref(cfg.replace(kv_cache='last_pass')))
  assert changed


def decode_chunks(cfg, params, toks, n):
  """Our decode's logits [B, T, V] with the cache: the first 5 tokens as one chunk, then one
  token a step."""
  from loopmoe_jax import decode
  cache = decode.init_cache(cfg, toks.shape[0], toks.shape[1], n)
  out = []
  for a, b in [(0, 5)] + [(i, i + 1) for i in range(5, toks.shape[1])]:
    logits, cache = decode.decode_step(cfg, params, cache, jnp.asarray(toks[:, a:b]), n,
                                       runtime=RT)
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)


@needs_torch
@pytest.mark.parametrize('layout,exit_rule', [
    ('last_pass', 'gate'), pytest.param('first_pass', 'none', marks=pytest.mark.slow)])
def test_shared_kv_layouts_decode_as_ours(layout, exit_rule, tmp_path):
  """model.kv_cache 'last_pass' / 'first_pass' (one cache entry per core layer): the logits
  of a prompt chunk and then one token a step through transformers' cache equal our decode's
  at the trained and twice the trained pass count (with the gate exit: the kept pass of a
  token that exited earlier is its last computed one), and differ from the full forward."""
  cfg, params = exit_model('gate')
  cfg = cfg.replace(kv_cache=layout)
  if exit_rule == 'none':
    cfg = cfg.replace(exit='none', exit_threshold=0.0)
    params = {k: v for k, v in params.items() if not k.startswith('exit_gate')}
  model = load(export(cfg, params, None, str(tmp_path / 'hf')))
  assert model.config.num_hidden_layers == 4  # prelude, two core layers, coda
  for n in (3, 6):
    cache = transformers.DynamicCache()
    chunks = [(0, 5)] + [(i, i + 1) for i in range(5, TOKENS.shape[1])]
    got = np.concatenate([theirs(model, TOKENS[:, a:b], cache=cache, num_loops=n)
                          for a, b in chunks], axis=1)
    want = decode_chunks(cfg, params, TOKENS, n)
    err = float(np.max(np.abs(got - want)))
    print(f'{layout} {exit_rule} num_loops={n}: max abs logit error {err:.2e}')
    assert err < 1e-4
    assert np.max(np.abs(want - ours(cfg, params, None, TOKENS, n))) > 1e-2


@needs_torch
def test_exit_settings_are_checked_at_the_forward(tmp_path):
  """exit, exit_threshold and kv_cache set at load: a bad one is a one-line error naming the
  field; a model without a trained gate refuses exit='gate', and early_exit=True without an
  exit rule; 'kl' set at load gives our forward with that exit."""
  cfg, params = exit_model('gate')
  path = export(cfg, params, None, str(tmp_path / 'gate'))
  with pytest.raises(ValueError, match=r"exit_threshold=1.5: exit='gate' needs a threshold in "
                                       r'\(0, 1\]'):
    theirs(load(path, exit_threshold=1.5), TOKENS, early_exit=True)
  plain = ModelConfig(**BASE)
  path = export(plain, make_params(plain), None, str(tmp_path / 'plain'))
  with pytest.raises(ValueError, match="exit='gate': this model has no trained exit gate"):
    theirs(load(path, exit='gate', exit_threshold=0.5), TOKENS)
  with pytest.raises(ValueError, match=r"kv_cache='shared': must be one of \('per_pass'"):
    theirs(load(path, kv_cache='shared'), TOKENS)
  with pytest.raises(ValueError, match=r"exit='bogus': must be one of"):
    theirs(load(path, exit='bogus'), TOKENS, early_exit=True)
  with pytest.raises(ValueError, match="early_exit=True: config.exit='none' has no exit rule"):
    theirs(load(path), TOKENS, early_exit=True)
  kl = load(path, exit='kl', exit_threshold=0.05)
  assert np.max(np.abs(theirs(kl, TOKENS, early_exit=True) - theirs(kl, TOKENS))) > 1e-3
  want, _ = _exit_forward(plain.replace(exit='kl', exit_threshold=0.05), 3)(
      make_params(plain), jnp.asarray(TOKENS))
  assert np.max(np.abs(theirs(kl, TOKENS, early_exit=True) - np.asarray(want))) < 1e-4


@needs_torch
def test_import_gives_back_a_gate_exit_run_exactly(tmp_path):
  """The gate's params (w [D], the scalar b stored as [1]) and model.exit come back
  bit-identical through export and --import=hf-looped."""
  from loopmoe_jax.train.run import RunDir
  cfg, params = exit_model('gate')
  params = jax.tree.map(np.asarray, params)
  config, generation, tensors = looped_io.to_hf(cfg, params, None, step=3)
  assert tensors['model.exit_gate_b'].shape == (1,) and config['exit_gate']
  with files.output_dir(str(tmp_path / 'hf')) as tmp:
    files.write_hf(tmp, config, generation, tensors)
  files.import_looped(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  back = RunDir(str(tmp_path / 'run')).load()
  assert back.model_cfg == cfg
  flat, flat2 = safetensors_io.flatten(params), safetensors_io.flatten(back.params)
  assert sorted(flat) == sorted(flat2) and flat2['exit_gate_b'].shape == ()
  for n in flat:
    np.testing.assert_array_equal(np.asarray(flat2[n]).view(np.uint32), flat[n].view(np.uint32))
