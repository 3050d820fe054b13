"""Sweeps from configs: grid points, shared seeds, skip-finished and resume with the trainer,
an interrupted sweep, key typos, and the loss over a short run's final window."""
import json
import os

import pytest
from absl import flags

from loopmoe_jax.accounting import count
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.scaling import read_csv
from loopmoe_jax.scaling import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP_LAWS = os.path.join(ROOT, 'configs', 'loop_laws.py')


def _config(arg='smoke'):
  import importlib.util
  spec = importlib.util.spec_from_file_location('loop_laws_cfg', LOOP_LAWS)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def test_points_set_fields_and_keep_seeds():
  cfg = _config()
  grid = sweep.grid(sweep.parse_sweeps(['model.num_loops=1,2', 'model.num_experts=8,16']))
  assert [sweep.point_name(p) for p in grid] == [
      'num_loops=1,num_experts=8', 'num_loops=1,num_experts=16',
      'num_loops=2,num_experts=8', 'num_loops=2,num_experts=16']
  c = sweep.apply_point(cfg, grid[-1])
  mc = ModelConfig.from_dict(c.model)
  assert (mc.num_loops, mc.prelude_experts, mc.core_experts, mc.coda_experts) == (2, 16, 16, 16)
  assert cfg.model.num_loops == 2 and cfg.model.core_experts == 8  # the base is not mutated
  assert (c.train.seed, c.data.seed) == (cfg.train.seed, cfg.data.seed)
  dense = sweep.apply_point(_config('smoke,experts=0'), {'model.num_loops': '3'})
  assert dense.model.num_loops == 3 and isinstance(dense.model.num_loops, int)
  with pytest.raises(ValueError, match='seeds'):
    sweep.apply_point(cfg, {'data.seed': 1})
  with pytest.raises(ValueError, match='no field'):
    sweep.apply_point(cfg, {'model.num_loop': 1})
  assert sweep.config_sweep(LOOP_LAWS, 'smoke') == {'model.num_loops': [1, 2, 4]}


def test_bad_sweep_values_and_changed_configs_name_the_key(tmp_path):
  """Sweep values that do not convert name their key; a non-integer for an integer field is
  refused (not truncated); every point is validated before any runs; a finished point whose
  base config changed since is an error naming the field, not a silent skip."""
  cfg = _config()
  for point, match in (({'model.num_loops': 'x'}, r"model\.num_loops: 'x' is not a number"),
                       ({'train.lr': 'abc'}, r"train\.lr: 'abc' is not a number"),
                       ({'model.num_loops': '2.5'}, r"num_loops: '2\.5' is not an integer")):
    with pytest.raises(ValueError, match=match):
      sweep.apply_point(cfg, point)
  ran = []
  fake = lambda c, w: ran.append(w) or {'steps': c.train.steps, 'final_window_loss': 1.0}
  with pytest.raises(ValueError, match=r'sweep point seq_len=-4: data\.seq_len=-4'):
    sweep.run_sweep(cfg, {'data.seq_len': [32, -4]}, str(tmp_path), run=fake)
  assert not ran  # the bad point stopped the sweep before the good one trained

  def run(c, workdir):
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump({'steps': c.train.steps, 'final_window_loss': 1.0}, f)
    return {'steps': c.train.steps, 'final_window_loss': 1.0}

  sweep.run_sweep(cfg, {'model.num_loops': [1]}, str(tmp_path), run=run, log=lambda *_: None)
  cfg.train.lr = cfg.train.lr / 2
  with pytest.raises(ValueError, match=r'num_loops=1 .*ran with another config.*train\.lr'):
    sweep.run_sweep(cfg, {'model.num_loops': [1]}, str(tmp_path), run=run)


def test_block_params_is_the_looped_core():
  mc = ModelConfig.from_dict(_config().model)
  one_layer_less = count(mc.replace(core_layers=mc.core_layers - 1))['params_total']
  per_layer = count(mc)['params_total'] - one_layer_less
  assert sweep.block_params(mc) == mc.core_layers * per_layer


def test_skips_finished_and_reruns_unfinished(tmp_path):
  cfg = _config()
  cfg.train.steps = 7
  calls = []

  def write_summary(workdir, steps, loss):
    s = {'steps': steps, 'final_window_loss': loss, 'stopped_by': None}
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump(s, f)
    return s

  def fake(c, workdir):
    calls.append(os.path.basename(workdir))
    return write_summary(workdir, c.train.steps, 3.0 + c.model.num_loops)

  grid = {'model.num_loops': [1, 2]}
  rows = sweep.run_sweep(cfg, grid, str(tmp_path), run=fake, log=lambda *_: None)
  assert calls == ['num_loops=1', 'num_loops=2']
  sweep.run_sweep(cfg, grid, str(tmp_path), run=fake, log=lambda *_: None)
  assert len(calls) == 2  # both finished: skipped
  # An interrupted point (summary short of the configured steps) is run again.
  write_summary(str(tmp_path / 'num_loops=2'), 3, 9.0)
  sweep.run_sweep(cfg, grid, str(tmp_path), run=fake, log=lambda *_: None)
  assert calls[2:] == ['num_loops=2']
  csv = read_csv(str(tmp_path / 'sweep.csv'))
  assert list(csv['r']) == [1, 2] and list(csv['loss']) == [4.0, 5.0]
  mc = ModelConfig.from_dict(cfg.model)
  assert csv['D'][0] == 7 * cfg.data.batch_size * cfg.data.seq_len
  assert csv['N_stored'][0] == count(mc)['params_total'] == rows[1]['N_stored']  # passes keep params
  assert csv['C'][1] > csv['C'][0]  # a pass costs compute


def test_an_interrupted_sweep_writes_the_finished_points_and_stops_with_the_signal(tmp_path):
  """A point a signal stopped (its summary's stopped_by) stops the sweep: the points that had
  finished -- before it, and after it from an earlier invocation -- go to sweep.csv, the rest
  are not started, one line says what was written, and preempt.Stopped carries the signal's
  exit status (130 SIGINT, 143 SIGTERM). With none finished no CSV is written."""
  from loopmoe_jax.train import preempt
  cfg = _config()
  cfg.train.steps = 7
  summary = lambda c, **kw: {'steps': c.train.steps, 'final_window_loss': 3.0 + c.model.num_loops,
                             'final_window': 5, 'stopped_by': None, **kw}  # noqa: E731
  finished_before = tmp_path / 'num_loops=3'
  finished_before.mkdir()
  c3 = sweep.apply_point(cfg, {'model.num_loops': 3})
  (finished_before / 'summary.json').write_text(json.dumps(summary(c3)))
  calls, lines = [], []

  def fake(c, workdir):
    calls.append(os.path.basename(workdir))
    if c.model.num_loops == 2:  # stopped at step 4 of 7 (it saved)
      return summary(c, steps=4, stopped_by='SIGTERM')
    return summary(c)

  grid = {'model.num_loops': [1, 2, 3, 4]}
  with pytest.raises(preempt.Stopped) as stop:
    sweep.run_sweep(cfg, grid, str(tmp_path), run=fake, log=lines.append)
  assert stop.value.code == 143 and stop.value.signal == 'SIGTERM'
  assert calls == ['num_loops=1', 'num_loops=2']  # num_loops=4 never started
  assert [r['point'] for r in stop.value.rows] == ['num_loops=1', 'num_loops=3']
  csv = read_csv(str(tmp_path / 'sweep.csv'))
  assert list(csv['r']) == [1, 3] and list(csv['loss']) == [4.0, 6.0]
  assert lines[-1] == (f'SIGTERM: the sweep stopped in point num_loops=2 (re-run the sweep to '
                       f'resume it); wrote {tmp_path}/sweep.csv with the 2 of 4 points that '
                       'have finished (exit 143)'), lines
  # the first point stopped by Ctrl-C, nothing finished: no CSV, and it says so
  lines.clear()
  stopped = lambda c, w: summary(c, steps=2, stopped_by='SIGINT')  # noqa: E731
  with pytest.raises(preempt.Stopped) as stop:
    sweep.run_sweep(cfg, {'model.num_loops': [5, 6]}, str(tmp_path / 'none'), run=stopped,
                    log=lines.append)
  assert stop.value.code == 130 and stop.value.rows == [] and stop.value.csv is None
  assert not (tmp_path / 'none' / 'sweep.csv').exists()
  assert lines[-1].endswith('no point has finished: no sweep.csv written (exit 130)'), lines
  # a point's child process that a signal ended before it wrote a summary counts as stopped
  assert [preempt.stop_signal(s) for s in (130, -2, 143, -15, 1, -9, 0)] == [
      'SIGINT', 'SIGINT', 'SIGTERM', 'SIGTERM', None, None, None]


def test_sweep_key_typos_name_the_near_keys_and_root_is_checked_first(tmp_path):
  """A sweep key that names no field is one line with the near keys (the model.num_experts
  alias among them), before any point runs; a --root that is a file is refused first."""
  cfg = _config()
  for key, near in (('model.num_loop', 'did you mean model.num_loops?'),
                    ('model.num_expert', 'did you mean model.num_experts or '),
                    ('num_experts', 'did you mean model.num_experts?'),
                    ('trian.lr', 'did you mean train.lr?')):
    with pytest.raises(ValueError) as e:
      sweep.apply_point(cfg, {key: '2'})
    assert near in str(e.value) and '\n' not in str(e.value), str(e.value)
    assert len(str(e.value)) < 200, str(e.value)  # not the section's every field
  ran = []
  fake = lambda c, w: ran.append(w) or {'steps': c.train.steps, 'final_window_loss': 1.0}  # noqa: E731
  with pytest.raises(ValueError, match=r'model\.num_loop: .*did you mean model\.num_loops'):
    sweep.run_sweep(cfg, {'model.num_loops': [1], 'model.num_loop': [1]}, str(tmp_path / 'a'),
                    run=fake)
  a_file = tmp_path / 'file'
  a_file.write_text('')
  with pytest.raises(ValueError, match=f'--root={a_file} is a file'):
    sweep.run_sweep(cfg, {'model.num_loops': [1]}, str(a_file), run=fake)
  assert not ran


def test_a_short_run_averages_the_steps_after_warmup_and_the_sweep_loss_is_it(tmp_path, caplog):
  """train.final_window 50 in a 5-step run with train.warmup 2: the final-window loss is the
  mean of steps 3..5 (not of the whole run, warmup included), a note says so and the summary
  records it; the sweep's `loss` is that same mean, `loss_steps` its 3 steps. A run that ends
  inside its warmup averages its last half."""
  import logging  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.train.metrics import final_window
  from loopmoe_jax.train.run import RunDir
  from loopmoe_jax.train.trainer import train
  assert final_window(500, 30, 50) == (50, None)
  assert final_window(40, 30, 50)[0] == 10 and final_window(20, 30, 50)[0] == 10
  assert 'last half' in final_window(20, 30, 50)[1]
  cfg = _trainer_config(steps=5, seq_len=16)
  cfg.train.warmup, cfg.train.final_window = 2, 50
  summaries = []
  caplog.set_level(logging.INFO, logger='loopmoe_jax')
  rows = sweep.run_sweep(cfg, {'model.num_loops': [2]}, str(tmp_path),
                         run=lambda c, w: summaries.append(train(c, w)) or summaries[-1],
                         log=lambda *_: None)
  work = str(tmp_path / 'num_loops=2')
  logged = RunDir(work).series('loss')
  assert sorted(logged) == [1, 2, 3, 4, 5]
  s = summaries[0]
  assert s['final_window'] == 3 and s['final_window_loss'] == pytest.approx(
      sum(logged[k] for k in (3, 4, 5)) / 3)
  assert s['final_window_loss'] != pytest.approx(sum(logged.values()) / 5)
  assert 'train.warmup=2' in s['final_window_note']
  assert s['final_window_note'] in [r.getMessage() for r in caplog.records]
  assert rows[0]['loss'] == s['final_window_loss'] and rows[0]['loss_steps'] == 3
  csv = read_csv(str(tmp_path / 'sweep.csv'))
  assert csv['loss'][0] == pytest.approx(s['final_window_loss']) and csv['loss_steps'][0] == 3
  assert sorted(RunDir(work).final_steps()) == [3, 4, 5]  # the paired comparison's window


def _trainer_config(steps: int, seq_len: int):
  """A tiny loop-laws config for sweeps that run the real trainer."""
  flags.FLAGS.mark_as_parsed()
  cfg = _config('smoke,core_layers=1')
  cfg.model.prelude_layers, cfg.model.coda_layers, cfg.run.dispatch = 1, 0, 'xla'
  cfg.train.steps, cfg.train.sample_tokens, cfg.train.log_every = steps, 0, 1
  cfg.train.async_save = False
  cfg.data.batch_size, cfg.data.seq_len, cfg.data.val_batches = 8, seq_len, 1
  return cfg


def test_sweep_with_the_trainer_skips_and_resumes(tmp_path, capsys):
  cfg = _trainer_config(steps=3, seq_len=32)
  from loopmoe_jax.train.trainer import train
  calls = []

  def counted(c, workdir):
    calls.append(os.path.basename(workdir))
    return train(c, workdir)

  # One real point (the multi-point bookkeeping is tested above with a fake runner).
  grid = {'model.num_loops': [2]}
  rows = sweep.run_sweep(cfg, grid, str(tmp_path), run=counted)
  assert calls == ['num_loops=2'] and rows[0]['steps'] == 3 and rows[0]['r'] == 2
  sweep.run_sweep(cfg, grid, str(tmp_path), run=counted)
  assert len(calls) == 1  # finished: skipped
  # Extending the run resumes the point from its checkpoint rather than restarting it.
  cfg.train.steps = 5
  capsys.readouterr()
  rows = sweep.run_sweep(cfg, grid, str(tmp_path), run=counted)
  assert 'resuming from step 3' in capsys.readouterr().out
  assert calls == ['num_loops=2'] * 2 and rows[0]['steps'] == 5
  assert rows[0]['D'] == 5 * cfg.data.batch_size * cfg.data.seq_len


def test_a_sweep_holds_one_point_of_programs_and_arrays(tmp_path):
  """Six real points of different shapes in one process: what the process holds after a
  point (live compiled programs and device arrays) does not grow with the points run, since
  each point's programs belong to its Job, dropped when the point ends."""
  import jax  # pylint: disable=import-outside-toplevel
  cfg = _trainer_config(steps=2, seq_len=16)
  from loopmoe_jax.train.trainer import train
  client, held = jax.devices()[0].client, []

  def measured(c, workdir):
    held.append((len(client.live_executables()), len(jax.live_arrays())))
    return train(c, workdir)

  grid = {'model.num_loops': [1, 2, 3], 'model.core_experts': [2, 4]}
  base = (len(client.live_executables()), len(jax.live_arrays()))
  rows = sweep.run_sweep(cfg, grid, str(tmp_path), run=measured)
  held.append((len(client.live_executables()), len(jax.live_arrays())))
  assert len(rows) == 6 and len(held) == 7
  # after the first point: nothing of it kept but what every point shares
  assert all(h <= held[1] for h in held[2:]), held
  print('held before the sweep and before each point, then after:', base, held)
  assert held[1][0] <= base[0] + 2, (base, held)  # a point compiles dozens; none outlive it


def test_points_in_child_processes_train_as_in_process(tmp_path):
  """A one-process sweep trains each point in a child process (the default): the same losses
  as training in-process, and the sweep's own process compiles nothing of any point."""
  import jax  # pylint: disable=import-outside-toplevel
  cfg = _trainer_config(steps=2, seq_len=16)
  grid = {'model.num_loops': [1, 2]}
  here = sweep.run_sweep(cfg, grid, str(tmp_path / 'here'), isolate=False, log=lambda *_: None)
  client = jax.devices()[0].client
  before = len(client.live_executables())
  lines = []
  apart = sweep.run_sweep(cfg, grid, str(tmp_path / 'apart'), log=lines.append)
  assert len(client.live_executables()) == before
  assert [r['loss'] for r in apart] == [r['loss'] for r in here]
  assert any("point's process peak" in line for line in lines), lines
  with pytest.raises(ValueError, match='isolate'):
    sweep.run_sweep(cfg, grid, str(tmp_path / 'x'), run=lambda c, w: {}, isolate=True)


def test_points_share_the_sweeps_compile_cache_unless_one_is_named(tmp_path):
  seen = []

  def fake(c, workdir):
    seen.append(c.train.compile_cache)
    return {'steps': c.train.steps, 'final_window_loss': 1.0, 'stopped_by': None}

  cfg = _config()
  sweep.run_sweep(cfg, {'model.num_loops': [1, 2]}, str(tmp_path / 'a'), run=fake,
                  log=lambda *_: None)
  assert seen == [str(tmp_path / 'a' / 'compile_cache')] * 2
  cfg.train.compile_cache = 'off'
  sweep.run_sweep(cfg, {'model.num_loops': [1]}, str(tmp_path / 'b'), run=fake,
                  log=lambda *_: None)
  assert seen[-1] == 'off'
