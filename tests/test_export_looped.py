"""The hf-looped export (loopmoe_jax/export/hf_looped.py, looped_io.py): tiny random looped
models written with their loop intact, loaded in transformers with trust_remote_code (CPU,
float32) and compared with our logits at 1, the trained and twice the trained pass count;
greedy generate with transformers' KV cache against generate without it and our decode; each
shared weight stored once; the round trip back into a run directory bit-exact; the byte
tokenizer through AutoTokenizer; refusals and bad input. The per-token exit and the shared KV
layouts: test_export_looped_exit.py."""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.export import files, hf_looped, looped_io, mixtral, safetensors_io
from loopmoe_jax.model import LoopedMoE, bias_shapes, variables

from helpers import make_params, needs_torch, rt, torch, transformers


BASE = dict(vocab_size=37, d_model=16, num_heads=4, expert_width=8, top_k=2,
            prelude_layers=1, prelude_experts=4, core_layers=2, core_experts=4, num_loops=3,
            coda_layers=1, coda_experts=4)
CASES = {  # the README main job's shape (GQA, tied embeddings); Foil (per-pass attention,
  # gain-free norms); SMELT (1/r); the router bias; injection, shared and sigmoid experts
    'main_job': dict(num_kv_heads=2, tie_embeddings=True),
    'foil_untied': dict(tie_attention=False, norm_gain=False, core_experts=8, core_layers=1,
                        num_loops=4),
    'smelt_inverse_loops': dict(residual_scale='inverse_loops', head_dim=6, rope_theta=500.0,
                                norm_eps=1e-5),
    'router_bias_per_pass': dict(router_bias='per_pass', num_kv_heads=1,
                                 residual_scale='inverse_loops', scale_passes='executed'),
    'injection_shared_sigmoid': dict(injection='concat', num_shared_experts=1,
                                     router_score='sigmoid', router_bias='shared',
                                     prelude_experts=0, max_expert_devices=1,
                                     expert_devices=2),
}
RT = rt(dispatch='xla', attention_impl='xla')  # the cheapest to compile; same values
TOKENS = np.random.default_rng(3).integers(0, 37, (2, 9))


def make_bias(cfg, seed=5):
  """A router-bias collection {'bias': {segment: array}} large enough to change choices."""
  rng = np.random.default_rng(seed)
  bias = {s: (0.3 * rng.standard_normal(shape)).astype(np.float32)
          for s, shape in bias_shapes(cfg).items()}
  return {'bias': bias} if bias else None


@functools.lru_cache(maxsize=None)
def _forward(cfg, num_loops):
  return jax.jit(lambda v, t: LoopedMoE(cfg, runtime=RT).apply(v, t, num_loops=num_loops)[0])


def ours(cfg, params, bias, toks, num_loops):
  return np.asarray(_forward(cfg, num_loops)(variables(params, router_bias=bias),
                                             jnp.asarray(toks)))


def export(cfg, params, bias, out):
  config, generation, tensors = looped_io.to_hf(cfg, jax.tree.map(np.asarray, params), bias,
                                                step=7)
  with files.output_dir(out) as tmp:
    files.write_hf(tmp, config, generation, tensors)
    looped_io.write_extras(tmp, cfg, 7)
  return out


def load(path, **kw):
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, trust_remote_code=True, dtype=torch.float32, **kw).eval()


def theirs(model, toks, **kw):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(toks), dtype=torch.long), **kw).logits.numpy()


FAST = ('main_job', 'router_bias_per_pass')  # the others 6-9 s each on 2 cores: slow


@needs_torch
@pytest.mark.parametrize('name', [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_logits_equal_ours_at_every_pass_count(name, tmp_path):
  cfg = ModelConfig(**{**BASE, **CASES[name]})
  params, bias = make_params(cfg), make_bias(cfg)
  model = load(export(cfg, params, bias, str(tmp_path / 'hf')))
  assert model.config.num_loops == model.config.trained_loops == cfg.num_loops
  for n in looped_io.pass_counts(cfg):
    err = float(np.max(np.abs(theirs(model, TOKENS, num_loops=n) -
                              ours(cfg, params, bias, TOKENS, n))))
    print(f'{name} num_loops={n}: max abs logit error {err:.2e}')
    assert err < 1e-4
  if bias is not None:  # the bias is applied: without it the logits differ
    zero = {'bias': {s: np.zeros_like(b) for s, b in bias['bias'].items()}}
    assert np.max(np.abs(ours(cfg, params, zero, TOKENS, cfg.num_loops) -
                         theirs(model, TOKENS))) > 1e-3


@needs_torch
@pytest.mark.slow
def test_greedy_generate_with_cache_equals_without_and_ours(tmp_path):
  """Greedy tokens with transformers' KV cache (one entry per executed pass and layer) equal
  those without a cache and our cached decode, at the trained and at another pass count;
  at a pass count the config sets at load, the same."""
  from loopmoe_jax import decode
  cfg = ModelConfig(**{**BASE, **CASES['router_bias_per_pass']})
  params, bias = make_params(cfg), make_bias(cfg)
  path = export(cfg, params, bias, str(tmp_path / 'hf'))
  model = load(path)
  prompt = torch.tensor(TOKENS[:, :4])
  mask = torch.ones_like(prompt)
  for n in (3, 5):
    run = lambda **kw: model.generate(prompt, max_new_tokens=6, do_sample=False,
                                      attention_mask=mask, num_loops=n, **kw).numpy()
    cached, uncached = run(), run(use_cache=False)
    ref = np.asarray(decode.generate(cfg, params, jnp.asarray(TOKENS[:, :4]), 6,
                                     jax.random.key(0), 0.0, num_loops=n, router_bias=bias,
                                     runtime=RT))
    np.testing.assert_array_equal(cached, uncached)
    np.testing.assert_array_equal(cached, ref)
  at_five = load(path, num_loops=5)
  np.testing.assert_array_equal(
      at_five.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=mask).numpy(),
      ref)


@needs_torch
def test_shared_weights_are_stored_once(tmp_path):
  """The file holds the parameters and the bias once each (shared core weights once), and is
  smaller than the unrolled Mixtral of the same model."""
  cfg = ModelConfig(**BASE)
  params = make_params(cfg)
  path = export(cfg, params, None, str(tmp_path / 'looped'))
  tensors = files.read_tensors(path)
  param_bytes = sum(a.nbytes for a in safetensors_io.flatten(params).values())
  assert sum(a.nbytes for a in tensors.values()) == param_bytes
  assert 'model.core.body.layer_0.moe.down' in tensors
  config, generation, t = mixtral.to_hf(cfg, params)
  with files.output_dir(str(tmp_path / 'mixtral')) as tmp:
    files.write_hf(tmp, config, generation, t)
  looped = os.path.getsize(os.path.join(path, 'model.safetensors'))
  unrolled = os.path.getsize(tmp_path / 'mixtral' / 'model.safetensors')
  print(f'hf-looped {looped:,} bytes, hf-mixtral {unrolled:,} bytes, params {param_bytes:,}')
  assert looped < param_bytes + (8 << 10) and looped < unrolled  # tensors + a JSON header


@needs_torch
def test_pass_counts_outside_the_range_are_one_line_errors(tmp_path):
  cfg = ModelConfig(**{**BASE, 'tie_attention': False})
  model = load(export(cfg, make_params(cfg), None, str(tmp_path / 'hf')))
  for n, want in ((0, r'num_loops=0: must lie in \[1, 24\]'),
                  (25, r'num_loops=25: must lie in \[1, 24\]'),
                  (4, r'num_loops=4: this model has per-pass attention weights for its 3')):
    with pytest.raises(ValueError, match=want) as e:
      theirs(model, TOKENS, num_loops=n)
    assert '\n' not in str(e.value)
  out = model(torch.tensor(TOKENS), num_loops=2)  # a cache made at 2 passes is refused at 3
  with pytest.raises(ValueError, match='the cache holds 9 tokens run at num_loops=2'):
    model(torch.tensor(TOKENS[:, :1]), cache=out.cache, num_loops=3)


@needs_torch
def test_byte_tokenizer_loads_with_autotokenizer(tmp_path):
  from loopmoe_jax.data.tokenizers import ByteTokenizer
  hf_looped.write_tokenizer(str(tmp_path), 'byte', 128)
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours_tok = ByteTokenizer()
  text = 'def f(x):\n  return x  # é ☃\0 end'
  assert tok(text).input_ids == ours_tok.encode(text).tolist()
  ids = ours_tok.encode('héllo')
  assert tok.decode(ids) == ours_tok.decode(ids) == 'héllo'
  assert tok.eos_token_id == 0


@needs_torch
def test_import_gives_back_the_run_exactly(tmp_path):
  """export -> --import=hf-looped: a run directory whose params and router bias RunDir.load
  reads back bit-identical (bfloat16 params kept as they are), with the run's config."""
  from loopmoe_jax.train.run import RunDir
  from loopmoe_jax.config import model_config_dict
  from loopmoe_jax.experiment import experiment_config
  cfg = ModelConfig(**{**BASE, **CASES['router_bias_per_pass'], 'param_dtype': 'bfloat16'})
  params = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16),
                        make_params(cfg.replace(param_dtype='float32')))
  bias = make_bias(cfg)
  run_config = experiment_config(model_config_dict(**cfg.__dict__)).to_dict()
  config, generation, tensors = looped_io.to_hf(cfg, params, bias, run_config, step=7)
  with files.output_dir(str(tmp_path / 'hf')) as tmp:
    files.write_hf(tmp, config, generation, tensors)
  summary = files.import_looped(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  assert summary['step'] == 7 and summary['num_loops'] == 3
  back = RunDir(str(tmp_path / 'run')).load()
  assert back.model_cfg == cfg and back.step == 7
  flat, flat2 = safetensors_io.flatten(params), safetensors_io.flatten(back.params)
  assert sorted(flat) == sorted(flat2)
  for n in flat:
    assert flat2[n].dtype == flat[n].dtype
    np.testing.assert_array_equal(flat2[n].view(np.uint16), flat[n].view(np.uint16))
  for s, b in bias['bias'].items():
    np.testing.assert_array_equal(np.asarray(back.router_bias['bias'][s]), b)


REFUSALS = {'model.capacity_factor=1.25': dict(capacity_factor=1.25)}


@pytest.mark.parametrize('field', sorted(REFUSALS))
def test_refuses_what_the_modeling_code_does_not_carry(field):
  cfg = ModelConfig(**{**BASE, **REFUSALS[field]})
  with pytest.raises(ValueError, match='hf-looped cannot carry ' + field.replace('.', r'\.')):
    looped_io.to_hf(cfg, {})


def test_import_of_a_mixtral_directory_as_hf_looped_is_refused(tmp_path):
  (tmp_path / 'hf').mkdir()
  (tmp_path / 'hf' / 'config.json').write_text(json.dumps(
      {'architectures': ['MixtralForCausalLM'], 'model_type': 'mixtral'}))
  safetensors_io.write_file(str(tmp_path / 'hf' / 'model.safetensors'),
                            {'x': np.zeros(2, np.float32)})
  with pytest.raises(ValueError, match="model_type 'mixtral'.*is not an hf-looped export"):
    files.import_looped(str(tmp_path / 'hf'), str(tmp_path / 'out'))
  assert not os.path.exists(tmp_path / 'out')


@pytest.mark.slow
def test_cli_refuses_loop_span_with_hf_looped_import(tmp_path):
  """--loop_span belongs to the Mixtral import: with --import=hf-looped it is one line naming
  it, and nothing is written."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, os.path.join(root, 'scripts', 'export.py'),
                      '--import=hf-looped', f'--src={tmp_path}', '--loop_span=1:3:2',
                      f'--out={tmp_path / "x"}'], capture_output=True, text=True, timeout=300,
                     cwd=root)
  assert r.returncode == 1, r.stderr[-500:]
  assert r.stderr.strip().splitlines()[-1] == 'error: --import does not take --loop_span'
  assert not os.path.exists(tmp_path / 'x')


@needs_torch
@pytest.mark.slow
def test_export_benchmark_quick():
  """`benchmark.py export --quick`: the hf-looped weights of the main job are its parameter
  bytes (each shared weight once) and smaller than the unrolled Mixtral's; the transformers
  forward it times gives our logits."""
  from loopmoe_jax.bench import export as bench_export
  res = bench_export.bench_export(quick=True)
  assert res['looped_bytes_over_params'] <= 1.05 < res['mixtral_bytes_over_params']
  assert res['max_abs_logit_error'] < 1e-4
  assert res['transformers_forward_s'] > 0 and res['ours_forward_s'] > 0
