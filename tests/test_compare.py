"""Paired comparison (analysis/paired.py, scripts/compare.py) on hand-made run directories:
the statistics against textbook formulas written out with loops, refusals of runs with
different data orders or no shared step, and the CLI's outputs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from loopmoe_jax.analysis import paired

DATA = {'source': 'embedded', 'path': '', 'val_path': '', 'tokenizer': 'byte',
        'val_fraction': 0.02, 'seq_len': 128, 'batch_size': 16, 'seed': 0, 'val_batches': 4,
        'task': 'dyck', 'num_threads': 2, 'prefetch': 4}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_run(path, losses: dict, data=None, model=None, val=None):
  """A run directory as the trainer leaves it: metrics.jsonl and a checkpoint config."""
  os.makedirs(os.path.join(path, 'checkpoints', '100', 'config'))
  cfg = {'model': model or {'num_loops': 1}, 'train': {'seed': 0, 'steps': 100,
                                                         'final_window': 40}, 'data': data or DATA,
         'mesh': {}}
  with open(os.path.join(path, 'checkpoints', '100', 'config', 'metadata'), 'w') as f:
    json.dump(cfg, f)
  with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
    for s, v in losses.items():
      row = {'step': s, 'loss': v}
      if val and s in val:
        row['val_loss'] = val[s]
      f.write(json.dumps(row) + '\n')
  return str(path)


def textbook(d):
  n = len(d)
  m = sum(d) / n
  var = sum((x - m) ** 2 for x in d) / (n - 1)
  rho = sum((d[t] - m) * (d[t + 1] - m) for t in range(n - 1)) / sum((x - m) ** 2 for x in d)
  n_eff = n * (1 - rho) / (1 + rho)
  return m, math.sqrt(var / n), rho, n_eff, math.sqrt(var / n_eff)


def test_paired_difference_equals_textbook_formulas():
  rng = np.random.default_rng(0)
  e = np.zeros(200)
  for t in range(1, 200):  # AR(1) noise, rho ~ 0.6
    e[t] = 0.6 * e[t - 1] + rng.standard_normal()
  b = 2.0 + 0.1 * rng.standard_normal(200)
  a = b + 0.05 + 0.01 * e
  got = paired.paired_difference(a, b)
  m, se, rho, n_eff, se_eff = textbook(list(a - b))
  assert got['n'] == 200
  for k, v in (('mean_diff', m), ('se', se), ('lag1_autocorr', rho), ('n_eff', n_eff),
               ('se_eff', se_eff)):
    assert got[k] == pytest.approx(v, rel=1e-9), k
  assert 0.4 < got['lag1_autocorr'] < 0.8 and got['se_eff'] > got['se']
  with pytest.raises(ValueError, match='at least 2'):
    paired.paired_difference([1.0], [2.0])


def test_negative_autocorrelation_never_raises_n_eff_above_n():
  """Alternating differences (rho ~ -0.5): the AR(1) formula would give n_eff ~ 3n; it is
  capped at n, so SE_eff equals the i.i.d. SE instead of falling below it."""
  rng = np.random.default_rng(1)
  d = np.where(np.arange(100) % 2, 1.0, -1.0) * 0.01 + 0.001 * rng.standard_normal(100)
  got = paired.paired_difference(0.5 + d, np.full(100, 0.5))
  assert got['lag1_autocorr'] < -0.5
  assert got['n_eff'] == 100 and got['se_eff'] == pytest.approx(got['se'], rel=1e-12)


def test_compare_runs_window_and_final_losses(tmp_path):
  steps = range(1, 101)
  la = {s: 3.0 - 0.01 * s + 0.001 * (s % 3) for s in steps}
  lb = {s: 3.0 - 0.01 * s for s in steps if s % 2 == 0}  # logged every other step
  a = make_run(tmp_path / 'a', la, val={50: 2.5, 100: 2.0})
  b = make_run(tmp_path / 'b', lb, model={'num_loops': 3, 'd_model': 64},  # other architecture
               val={50: 2.6, 100: 2.1})
  with pytest.raises(ValueError, match=r'skips 9 steps .*allow_gaps'):  # b logged every other
    paired.compare_runs(a, b, window=0.2)
  res = paired.compare_runs(a, b, window=0.2, allow_gaps=True)
  assert res['skipped_steps'] == 9 and res['window_source'].startswith('metrics.jsonl')
  shared = [s for s in steps if s % 2 == 0]
  win = shared[-10:]
  assert res['shared_steps'] == 50 and res['n'] == 10 and res['window_steps'] == [82, 100]
  assert res['final_window_loss_a'] == pytest.approx(np.mean([la[s] for s in win]))
  assert res['final_window_loss_b'] == pytest.approx(np.mean([lb[s] for s in win]))
  assert res['mean_diff'] == pytest.approx(np.mean([la[s] - lb[s] for s in win]))
  assert res['val_loss'] == {'50': [2.5, 2.6], '100': [2.0, 2.1]}


def test_default_window_is_every_step_of_the_final_window(tmp_path):
  """Foil's protocol: with the per-step record (final_steps.jsonl) the window is every step of
  the runs' final windows, though metrics.jsonl logged every 10th step only."""
  steps = range(1, 101)
  la = {s: 3.0 - 0.01 * s + 0.002 * (s % 7) for s in steps}
  lb = {s: 3.0 - 0.01 * s for s in steps}
  a = make_run(tmp_path / 'a', {s: v for s, v in la.items() if s % 10 == 0})
  b = make_run(tmp_path / 'b', {s: v for s, v in lb.items() if s % 10 == 0})
  for path, full in ((a, la), (b, lb)):
    with open(os.path.join(path, 'final_steps.jsonl'), 'w') as f:
      for s in range(61, 101):  # train.steps 100, final_window 40
        f.write(json.dumps({'step': s, 'loss': full[s]}) + '\n')
  res = paired.compare_runs(a, b)
  assert res['window_steps'] == [61, 100] and res['n'] == 40 and res['skipped_steps'] == 0
  assert res['window_source'].startswith('final_steps.jsonl')
  assert res['mean_diff'] == pytest.approx(np.mean([la[s] - lb[s] for s in range(61, 101)]))
  # a fraction asks for the logged steps: 10 shared, the last 2 of them, 9 steps apart
  with pytest.raises(ValueError, match='skips 9 steps'):
    paired.compare_runs(a, b, window=0.2)


def test_different_data_orders_and_no_shared_steps_refused(tmp_path):
  a = make_run(tmp_path / 'a', {1: 1.0, 2: 1.0})
  b = make_run(tmp_path / 'b', {1: 1.0, 2: 1.0}, data={**DATA, 'seed': 7, 'num_threads': 8})
  with pytest.raises(ValueError) as e:
    paired.compare_runs(a, b)
  msg = str(e.value)
  assert a in msg and b in msg and 'data.seed: 0 vs 7' in msg and 'num_threads' not in msg
  c = make_run(tmp_path / 'c', {1: 1.0, 2: 1.0}, data={**DATA, 'num_threads': 8})
  assert paired.compare_runs(a, c)['n'] == 2  # loader threads do not change the order
  d = make_run(tmp_path / 'd', {5: 1.0, 6: 1.0})
  with pytest.raises(ValueError, match='share no logged step'):
    paired.compare_runs(a, d)
  os.makedirs(tmp_path / 'e')
  with pytest.raises(FileNotFoundError, match='no checkpoint step'):
    paired.compare_runs(a, str(tmp_path / 'e'))


def test_compare_cli_writes_json_and_png(tmp_path):
  rng = np.random.default_rng(1)
  base = {s: 3.0 / math.sqrt(s) + 0.05 * rng.standard_normal() for s in range(1, 61)}
  a = make_run(tmp_path / 'a', {s: v - 0.02 for s, v in base.items()})
  b = make_run(tmp_path / 'b', base)
  out = tmp_path / 'out'
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'compare.py'),
                      f'--runs={a},{b}', f'--out={out}', '--window=0.5'],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  res = json.load(open(out / 'compare.json'))
  assert res['n'] == 30 and res['mean_diff'] == pytest.approx(-0.02, abs=1e-9)
  assert (out / 'compare.png').stat().st_size > 10_000
  bad = make_run(tmp_path / 'bad', base, data={**DATA, 'batch_size': 8})
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'compare.py'),
                      f'--runs={a},{bad}', f'--out={out}'], capture_output=True, text=True,
                     timeout=120)
  # the last line (a CUDA plugin installed on a machine without a GPU logs at jax's import)
  last = r.stderr.strip().splitlines()[-1]
  assert r.returncode == 1 and last.startswith('error: ') and 'data.batch_size' in last


def test_a_torn_last_line_is_skipped_with_a_note_naming_the_file(tmp_path, caplog):
  """What a crash leaves (a last row cut short) does not block the comparison: the rows before
  it are compared and a note names the file and line; the same damage mid-file is an error
  naming both."""
  steps = range(1, 41)
  a = make_run(tmp_path / 'a', {s: 3.0 - 0.01 * s for s in steps})
  b = make_run(tmp_path / 'b', {s: 3.0 - 0.012 * s for s in steps})
  metrics = os.path.join(a, 'metrics.jsonl')
  with open(metrics, 'a') as f:
    f.write('{"step": 41, "loss": 2.5, ')
  with caplog.at_level('INFO', logger='loopmoe_jax'):
    res = paired.compare_runs(a, b, window=0.5)
  assert res['shared_steps'] == 40 and res['window_steps'] == [21, 40]
  assert f'{metrics}: line 41 is not a whole row' in caplog.text
  lines = open(metrics).read().splitlines()
  lines[9] = lines[9][:12]
  with open(metrics, 'w') as f:
    f.write('\n'.join(lines[:40]) + '\n')
  with pytest.raises(ValueError, match=f'{metrics}: line 10 is not a JSON row'):
    paired.compare_runs(a, b, window=0.5)


def test_compare_refuses_a_file_as_out_before_reading_the_runs(tmp_path):
  afile = tmp_path / 'afile'
  afile.write_text('x')
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'compare.py'),
                      f'--runs={tmp_path / "none_a"},{tmp_path / "none_b"}', f'--out={afile}'],
                     capture_output=True, text=True, timeout=120)
  last = r.stderr.strip().splitlines()[-1]
  assert r.returncode == 1 and last == (f'error: --out={afile} is a file: expected a directory '
                                        '(made when missing)')
