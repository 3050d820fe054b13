"""Export / import (loopmoe_jax/export): tiny random looped models unrolled into Hugging Face
Mixtral and run in transformers (CPU, float32) against our logits and greedy tokens; the
safetensors round trip bit-exact; a tiny random MixtralForCausalLM imported; refusals of what
Mixtral cannot express; bad input."""
from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.export import files, mixtral, safetensors_io
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.runtime import HERE

from helpers import RT, make_params, needs_torch, torch, transformers


BASE = dict(vocab_size=37, d_model=16, num_heads=4, expert_width=8, top_k=2,
            prelude_layers=1, prelude_experts=4, core_layers=2, core_experts=4, num_loops=3,
            coda_layers=1, coda_experts=4)
CASES = {
    'tied_attention': dict(),
    'untied_attention': dict(tie_attention=False),
    'inverse_loops': dict(residual_scale='inverse_loops', tie_attention=False),
    'gqa_tied_embed': dict(num_kv_heads=2, tie_embeddings=True, residual_scale='inverse_loops'),
    'no_gain_head_dim': dict(norm_gain=False, head_dim=6, num_kv_heads=1, rope_theta=500.0,
                             norm_eps=1e-5),
}
TOKENS = np.random.default_rng(3).integers(0, 37, (2, 9))


@functools.lru_cache(maxsize=None)
def _forward(cfg, runtime):
  return jax.jit(LoopedMoE(cfg, runtime=runtime).apply)


def ours(cfg, params, toks, runtime=RT):
  """Our logits; `runtime` the model tests' (dispatch_tile 8) unless given."""
  logits, _ = _forward(cfg, runtime)({'params': params}, jnp.asarray(toks))
  return np.asarray(logits)


def our_greedy(cfg, params, prompt, steps):
  """Greedy continuation by full forwards over one fixed-length buffer (causal: the logits at
  position t see tokens <= t only, so the padding after it changes nothing; one program)."""
  prompt = np.asarray(prompt)
  n = prompt.shape[1]
  toks = np.zeros((prompt.shape[0], n + steps), prompt.dtype)
  toks[:, :n] = prompt
  for t in range(n, n + steps):
    toks[:, t] = ours(cfg, params, toks)[:, t - 1].argmax(-1)
  return toks


def export_hf(cfg, params, out):
  config, generation, tensors = mixtral.to_hf(cfg, params)
  with files.output_dir(out) as tmp:
    files.write_hf(tmp, config, generation, tensors)
  return out


def hf_model(path):
  m = transformers.MixtralForCausalLM.from_pretrained(path, dtype=torch.float32)
  return m.eval()


@needs_torch
@pytest.mark.parametrize('name', sorted(CASES))
def test_hf_mixtral_matches_our_logits_and_greedy_tokens(name, tmp_path):
  cfg = ModelConfig(**{**BASE, **CASES[name]})
  params = make_params(cfg)
  model = hf_model(export_hf(cfg, params, str(tmp_path / 'hf')))
  assert model.config.num_hidden_layers == cfg.executed_layers == 8
  with torch.no_grad():
    theirs = model(torch.tensor(TOKENS)).logits.numpy()
  err = float(np.max(np.abs(theirs - ours(cfg, params, TOKENS))))
  print(f'{name}: max abs logit error {err:.2e}')
  assert err < 1e-4
  prompt = TOKENS[:, :4]
  gen = model.generate(torch.tensor(prompt), max_new_tokens=5, do_sample=False,
                       attention_mask=torch.ones_like(torch.tensor(prompt)))
  np.testing.assert_array_equal(gen.numpy(), our_greedy(cfg, params, prompt, 5))


def test_safetensors_round_trip_is_bit_exact(tmp_path):
  cfg = ModelConfig(**{**BASE, 'tie_attention': False, 'num_shared_experts': 1,
                       'injection': 'concat', 'param_dtype': 'bfloat16'})
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params(
      cfg.replace(param_dtype='float32')))
  with files.output_dir(str(tmp_path / 'st')) as tmp:
    safetensors_io.save_model(tmp, {'model': cfg.__dict__}, params, step=7)
  cfg2, back, config = safetensors_io.load_model(str(tmp_path / 'st'))
  assert cfg2 == cfg and config['step'] == 7
  flat, flat2 = safetensors_io.flatten(params), safetensors_io.flatten(back)
  assert sorted(flat) == sorted(flat2) and 'core.pass_attn_0.q' in flat
  for n in flat:
    assert flat2[n].dtype == flat[n].dtype
    np.testing.assert_array_equal(flat2[n].view(np.uint16), flat[n].view(np.uint16))


@needs_torch
def test_safetensors_file_reads_in_the_safetensors_package(tmp_path):
  from safetensors.numpy import load_file
  tensors = {'a.b': np.arange(6, dtype=np.float32).reshape(2, 3), 'c': np.ones(3, np.int32),
             'scalar': np.asarray(2.5, np.float32)}
  safetensors_io.write_file(str(tmp_path / 'x.safetensors'), tensors)
  back = load_file(str(tmp_path / 'x.safetensors'))
  for n in tensors:
    assert back[n].shape == tensors[n].shape, n
    np.testing.assert_array_equal(back[n], tensors[n])


def tiny_hf_mixtral(path, tie=False, layers=4):
  torch.manual_seed(0)
  config = transformers.MixtralConfig(
      vocab_size=41, hidden_size=16, intermediate_size=12, num_hidden_layers=layers,
      num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=4,
      num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=tie,
      rope_parameters={'rope_type': 'default', 'rope_theta': 1000.0})
  model = transformers.MixtralForCausalLM(config).eval()
  with torch.no_grad():  # norms away from 1 so a dropped gain shows
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


@needs_torch
@pytest.mark.parametrize('tie', [False, True])
def test_import_tiny_mixtral_matches_its_logits(tie, tmp_path):
  model = tiny_hf_mixtral(str(tmp_path / 'hf'), tie)
  files.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'ours'))
  cfg, params, _ = safetensors_io.load_model(str(tmp_path / 'ours'))
  assert (cfg.core_layers, cfg.num_loops) == (4, 1)
  toks = TOKENS % 41
  with torch.no_grad():
    theirs = model(torch.tensor(toks)).logits.numpy()
  err = float(np.max(np.abs(theirs - ours(cfg, params, toks, HERE))))
  print(f'import (tie={tie}): max abs logit error {err:.2e}')
  assert err < 1e-4


@needs_torch
def test_import_with_loop_span_averages_the_replaced_layers(tmp_path):
  tiny_hf_mixtral(str(tmp_path / 'hf'), layers=6)
  files.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'ours'), span=(1, 5, 2))
  cfg, params, _ = safetensors_io.load_model(str(tmp_path / 'ours'))
  assert (cfg.prelude_layers, cfg.core_layers, cfg.num_loops, cfg.coda_layers) == (1, 2, 2, 1)
  _, t = files.read_hf(str(tmp_path / 'hf'))
  t = mixtral.hub_tensors(t, 6, 4)
  q = lambda i: t[f'model.layers.{i}.self_attn.q_proj.weight'].T.reshape(16, 4, 4)
  np.testing.assert_allclose(params['core']['body']['layer_1']['attn']['q'],
                             (q(2) + q(4)) / 2, rtol=1e-6)
  ours(cfg, params, TOKENS % 41, HERE)  # runs
  # our export of the import is a Mixtral again, and round-trips the L = 1 import exactly
  files.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'flat'))
  cfg1, p1, _ = safetensors_io.load_model(str(tmp_path / 'flat'))
  _, _, back = mixtral.to_hf(cfg1, p1)
  for n, a in back.items():
    np.testing.assert_array_equal(a, t[n])


REFUSALS = {
    'different expert counts per layer': dict(core_experts=8),
    'dense layers among MoE layers': dict(prelude_experts=0),
    'input injection': dict(injection='add'),
    'non-renormalised routing': dict(renormalize=False),
    'shared experts': dict(num_shared_experts=1),
    'expert capacity': dict(capacity_factor=1.25),
    'sigmoid router scores': dict(router_score='sigmoid'),
    'a router selection bias': dict(router_bias='shared'),
}


@pytest.mark.parametrize('feature', sorted(REFUSALS))
def test_refuses_what_mixtral_cannot_express(feature, tmp_path):
  cfg = ModelConfig(**{**BASE, **REFUSALS[feature]})
  with pytest.raises(ValueError, match=feature) as e:
    mixtral.to_hf(cfg, make_params(cfg))
  if cfg.router_bias == 'none':
    assert '--format safetensors' in str(e.value)
  else:  # no format holds the trained bias: no hint to another one
    assert '--format safetensors' not in str(e.value) and 'not exported' in str(e.value)


def test_all_dense_model_exports_as_one_expert():
  cfg = ModelConfig(**{**BASE, 'prelude_experts': 0, 'core_experts': 0, 'coda_experts': 0})
  config, _, t = mixtral.to_hf(cfg, make_params(cfg))
  assert config['num_local_experts'] == 1 and config['num_experts_per_tok'] == 1


# Bad input ---------------------------------------------------------------------------------

def test_workdir_without_checkpoints(tmp_path):
  (tmp_path / 'run').mkdir()
  with pytest.raises(FileNotFoundError, match='no checkpoint'):
    files.export_workdir(str(tmp_path / 'run'), str(tmp_path / 'out'), 'safetensors')
  assert not os.path.exists(tmp_path / 'out')


@needs_torch
def test_export_of_a_trained_workdir_verifies_in_both_formats(tmp_path):
  """A tiny run trained 2 steps: the chosen step exports in both formats, and --verify finds
  the logits equal to ours (float32, on validation tokens) and the same greedy tokens; a step
  that does not exist is an error listing the steps there, and leaves no directory."""
  from loopmoe_jax.train.trainer import train
  from helpers import tiny
  work = str(tmp_path / 'run')
  train(tiny(steps=2, save_every=1, eval_every=2, routing_every=2), work)
  for fmt in files.FORMATS:
    out = str(tmp_path / fmt)
    summary = files.export_workdir(work, out, fmt, step=1)
    assert summary['step'] == 1 and summary['bytes'] > 0
    check = files.verify_export(work, out, fmt, step=1, tokens=32, greedy=4)
    print(fmt, check)
    assert check['max_abs_logit_error'] < 1e-4 * max(1.0, check['logit_scale'])
    assert check['greedy_equal'] and check['tokens'] == 32
  with pytest.raises(FileNotFoundError, match=r'step 9: no such checkpoint.*\[1, 2\]'):
    files.export_workdir(work, str(tmp_path / 'nine'), 'safetensors', step=9)
  assert not os.path.exists(tmp_path / 'nine')


def test_non_empty_out_refused_and_failed_export_leaves_nothing(tmp_path):
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'keep').write_text('x')
  with pytest.raises(FileExistsError, match='not empty.*--overwrite'):
    with files.output_dir(str(out)):
      pass
  # --overwrite replaces an earlier export only (recognised by its files), not 'keep'
  with pytest.raises(FileExistsError, match='not an earlier export'):
    with files.output_dir(str(out), overwrite=True):
      pass
  (out / 'keep').unlink()
  for name in ('config.json', 'model.safetensors'):
    (out / name).write_text('old')
  with pytest.raises(RuntimeError, match='boom'):
    with files.output_dir(str(out), overwrite=True) as tmp:
      open(os.path.join(tmp, 'half'), 'w').close()
      raise RuntimeError('boom')
  assert os.listdir(tmp_path) == ['out']
  assert sorted(os.listdir(out)) == ['config.json', 'model.safetensors']
  with files.output_dir(str(out), overwrite=True) as tmp:
    open(os.path.join(tmp, 'new'), 'w').close()
  assert os.listdir(out) == ['new']
  run = tmp_path / 'run'  # a training run (or a folder holding one) is never replaced
  (run / 'checkpoints').mkdir(parents=True)
  (run / 'metrics.jsonl').write_text('{}')
  for target in (run, tmp_path):
    with pytest.raises(FileExistsError, match='holds a training run.*choose another --out'):
      with files.output_dir(str(target), overwrite=True):
        pass
  with pytest.raises(FileExistsError, match='lies inside the training run'):  # nor inside one
    with files.output_dir(str(run / 'export' / 'hf')):
      pass
  assert sorted(os.listdir(run)) == ['checkpoints', 'metrics.jsonl']


def test_safetensors_with_missing_or_extra_tensors(tmp_path):
  cfg = ModelConfig(**BASE)
  flat = safetensors_io.flatten(make_params(cfg))
  for label, change in (('missing tensors', lambda f: f.pop('core.body.layer_1.moe.up')),
                        ('extra tensors', lambda f: f.update(stray=np.zeros(2, np.float32)))):
    d = tmp_path / label.replace(' ', '_')
    d.mkdir()
    bad = dict(flat)
    change(bad)
    safetensors_io.write_file(str(d / 'model.safetensors'), bad)
    (d / 'config.json').write_text(json.dumps({'model': cfg.__dict__}))
    with pytest.raises(ValueError, match=label) as e:
      safetensors_io.load_model(str(d))
    assert ('core.body.layer_1.moe.up' if label.startswith('missing') else 'stray') in str(e.value)


def test_import_of_another_architecture(tmp_path):
  (tmp_path / 'llama').mkdir()
  (tmp_path / 'llama' / 'config.json').write_text(json.dumps(
      {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}))
  with pytest.raises(ValueError, match='LlamaForCausalLM.*is not MixtralForCausalLM'):
    files.import_hf(str(tmp_path / 'llama'), str(tmp_path / 'out'))
  assert not os.path.exists(tmp_path / 'out')


def test_cli_names_missing_and_ignored_flags(tmp_path):
  """scripts/export.py: a flag the mode needs, a flag it would ignore, and a malformed
  --loop_span are one-line errors naming them (nothing is written)."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = f'--out={tmp_path / "x"}'
  cases = {('--import=hf-mixtral', '--verify', '--step=3', out):
               'error: --import needs --src; does not take --step, --verify',
           ('--workdir=/nowhere', out): 'error: export needs --format',
           ('--import=hf-mixtral', f'--src={tmp_path}', '--loop_span=1:x:2', out):
               "error: --loop_span='1:x:2': expected START:STOP:LOOPS (integers)"}
  for args, want in cases.items():
    r = subprocess.run([sys.executable, os.path.join(root, 'scripts', 'export.py'), *args],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == want, r.stderr[-500:]
  assert not os.path.exists(tmp_path / 'x')


def test_verify_without_torch_fails_before_writing(tmp_path, monkeypatch):
  """--verify of hf-mixtral needs torch: without it the export stops before reading the
  checkpoint or writing anything (it used to write the export, then fail)."""
  from loopmoe_jax.export.files import export_workdir
  monkeypatch.setitem(sys.modules, 'torch', None)  # `import torch` raises ImportError
  out = tmp_path / 'hf'
  with pytest.raises(ImportError, match='--verify of hf-mixtral needs torch'):
    export_workdir(str(tmp_path / 'run'), str(out), 'hf-mixtral', verify=True)
  assert not out.exists()


def test_out_is_checked_before_the_checkpoint_is_read(tmp_path):
  """A refused --out is the error even when the checkpoint could not be read (nothing is
  read first): here the run has no readable step at all."""
  run = tmp_path / 'run'
  (run / 'checkpoints').mkdir(parents=True)
  with pytest.raises(FileExistsError, match='lies inside the training run'):
    files.export_workdir(str(run), str(run / 'export'), 'safetensors')
