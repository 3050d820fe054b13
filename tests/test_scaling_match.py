"""SMELT three-budget matching: ratios within tolerance and a model that builds with that count."""
import ast
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from loopmoe_jax.accounting import count, init_param_count
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.scaling.matching import match

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _smelt(arg):
  spec = importlib.util.spec_from_file_location('smelt_cfg', os.path.join(ROOT, 'configs',
                                                                           'smelt.py'))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def test_matches_smelt_baseline_within_4_percent():
  cfg = _smelt('200m,baseline')
  base = ModelConfig.from_dict(cfg.model)
  assert (base.executed_layers, base.d_model, base.core_experts) == (12, 1280, 192)
  m = match(base, span=0.5, loops=2, context=cfg.data.seq_len, tol=0.04)
  c = m.config
  # Middle 6 of 12 layers looped twice, 1/r residual scaling.
  assert (c.prelude_layers, c.core_layers, c.coda_layers, c.num_loops) == (3, 6, 3, 2)
  assert c.residual_scale == 'inverse_loops'
  for name in ('flops_ratio', 'params_ratio', 'kv_ratio'):
    assert abs(m.ratios[name] - 1) <= 0.04, m.ratios
  # The ratios are the accounting's, and the real model has the predicted parameter count.
  b, t = count(base, cfg.data.seq_len), count(c, cfg.data.seq_len)
  assert m.ratios['params_ratio'] == t['params_total'] / b['params_total']
  assert m.ratios['kv_ratio'] == t['kv_per_token'] / b['kv_per_token']
  assert init_param_count(c) == t['params_total']


def test_match_budgets_cli_writes_json(tmp_path):
  out = tmp_path / 'match.json'
  cmd = [sys.executable, os.path.join(ROOT, 'scripts', 'match_budgets.py'),
         f'--baseline={os.path.join(ROOT, "configs", "smelt.py")}:smoke,baseline',
         f'--json={out}']
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-2000:]
  got = json.loads(out.read_text())
  for name in ('flops_ratio', 'params_ratio', 'kv_ratio'):
    assert abs(got[name] - 1) <= 0.04
  cfg = ModelConfig(**got['model'])
  assert count(cfg, got['context'])['params_total'] == got['matched']['params_total']


def test_match_refuses_a_looped_baseline():
  base = ModelConfig.from_dict(_smelt('200m,looped').model)
  with pytest.raises(ValueError, match='unlooped'):
    match(base)


def test_fixed_to_smelts_width_and_pool_finds_the_published_twin():
  """SMELT's worked example: width 1056 and 288 experts held (10 heads), the search finds
  top-7, head size 88 and expert width 368, within 4% of every budget (the paper reports
  1.029 FLOPs, 1.004 params, 1.031 KV; ours at context 2048 is in the closing assertion)."""
  base = ModelConfig.from_dict(_smelt('200m,baseline').model)
  m = match(base, context=2048, fixed={'d_model': 1056, 'core_experts': 288, 'num_heads': 10},
            head_step=8)
  c = m.config
  assert (c.d_model, c.core_experts, c.num_heads) == (1056, 288, 10)
  assert (c.top_k, c.head_dim, c.expert_width) == (7, 88, 368)
  assert m.ratios['kv_ratio'] == pytest.approx(1.031, abs=1e-3)
  assert m.max_deviation <= 0.04


def test_constraints_are_honoured():
  base = ModelConfig.from_dict(_smelt('200m,baseline').model)
  m = match(base, context=2048, fixed={'top_k': 6}, d_step=32, width_step=32, head_step=16)
  c = m.config
  assert c.top_k == 6
  assert c.d_model % 32 == 0 and c.expert_width % 32 == 0 and c.resolved_head_dim % 16 == 0
  with pytest.raises(ValueError, match=r"cannot hold \['vocab_size'\] fixed"):
    match(base, fixed={'vocab_size': 10})


def _match_cli(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'match_budgets.py'), *args],
                     capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
  return r.returncode, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else '', r.stdout


def test_match_budgets_cli_names_the_fix_for_a_looped_baseline_and_a_miss():
  status, last, _ = _match_cli('--baseline=configs/smelt.py:200m,looped')
  assert status == 1 and last == (
      'error: --baseline=configs/smelt.py:200m,looped has model.num_loops=2: the baseline '
      'must be unlooped; add --baseline.model.num_loops=1 (or give its unlooped variant)')
  miss = ('--baseline=configs/smelt.py:smoke,baseline', '--span=0.25', '--loops=4')
  status, last, _ = _match_cli(*miss)
  assert status == 1 and last.startswith('error: no looped twin within 4%')
  assert last.endswith('5.4% off (flops 1.054 of the baseline): add --search_expert_width (the '
                       'expert width is searched too, 0.5x to 1.25x)')
  status, last, out = _match_cli(*miss, '--search_expert_width')
  assert status == 0 and 'train it:' in out, last


def test_the_printed_train_command_builds_the_matched_twin(tmp_path):
  """The twin's `train.py --config=... --config.X=...` line, overrides of the baseline
  carried, read back through --config gives the matched model."""
  from loopmoe_jax.cli import _check_config  # pylint: disable=protected-access
  from loopmoe_jax.experiment import build, load_config
  out = tmp_path / 'm.json'
  status, last, text = _match_cli(
      '--baseline=configs/default.py', '--baseline.model.num_loops=1',
      '--baseline.model.prelude_experts=4', '--baseline.model.coda_experts=4',
      '--baseline.train.steps=250', '--search_expert_width', f'--json={out}')
  assert status == 0, last
  command = text.split('train it:\n', 1)[1].strip()
  words = command.split()
  assert words[:3] == ['python', 'scripts/train.py', '--config=configs/default.py']
  assert words[-1] == '--workdir=RUN_DIR' and '--config.train.steps=250' in words
  cfg = load_config('configs/default.py')
  _check_config(words[2:-1], 'configs/default.py')  # every key names a field
  for word in words[3:-1]:
    key, value = word[len('--config.'):].split('=', 1)
    section, field = key.split('.')
    old = cfg[section][field]
    cfg[section][field] = value if isinstance(old, str) else type(old)(ast.literal_eval(value))
  assert dataclasses.asdict(build(cfg).model) == json.loads(out.read_text())['model']
  assert cfg.train.steps == 250
