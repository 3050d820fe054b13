"""Training stack: schedules, exact resume, continuation, SIGTERM, corrupt checkpoints, NaN."""
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from loopmoe_jax.experiment import build
from loopmoe_jax.train import checkpoint
from loopmoe_jax.config.train import TrainConfig
from loopmoe_jax.train.optimizer import wsd_schedule
from loopmoe_jax.train.loop import TrainingDiverged
from loopmoe_jax.train.run import RunDir
from loopmoe_jax.train.trainer import train
from helpers import logged, losses, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wsd_matches_formula():
  peak, total, warm = 3e-4, 1000, 100
  f = wsd_schedule(peak, total, warm, 0.1, '1-sqrt', 0.05)
  assert float(f(warm - 1)) == pytest.approx(peak)            # warmup end
  assert float(f(warm // 2 - 1)) == pytest.approx(peak / 2)   # linear warmup
  assert float(f(900)) == pytest.approx(peak)                  # decay start
  assert float(f(1000)) == pytest.approx(0.05 * peak)          # end of the schedule
  mid = 950
  assert float(f(mid)) == pytest.approx(peak * (0.05 + 0.95 * (1 - np.sqrt(0.5))))
  lin = wsd_schedule(peak, total, warm, 0.1, 'linear', 0.05)
  assert float(lin(mid)) == pytest.approx(peak * (0.05 + 0.95 * 0.5))
  cos = wsd_schedule(peak, total, warm, 0.1, 'cosine', 0.0)
  assert float(cos(mid)) == pytest.approx(peak * 0.5)


def test_resume_is_bitwise_identical(tmp_path):
  """On the CPU default dispatch (run.dispatch 'auto': 'tiled')."""
  straight = train(tiny('auto', steps=6, final_window=5), str(tmp_path / 'a'))
  train(tiny('auto', steps=3, schedule_steps=6), str(tmp_path / 'b'))   # "killed" after step 3
  resumed = train(tiny('auto', steps=6, final_window=5), str(tmp_path / 'b'))
  a, b = losses(tmp_path / 'a'), losses(tmp_path / 'b')
  assert sorted(a) == list(range(1, 7)) and sorted(b) == list(range(1, 7))
  assert a == b                                               # bitwise: same floats
  # the final window (train.final_window 5, shrunk to the 4 steps after train.warmup 2: steps
  # 3..6) spans the resume and is still exact
  assert straight['final_window_loss'] == resumed['final_window_loss']
  assert straight['final_window'] == 4 and 'train.warmup=2' in straight['final_window_note']
  assert straight['final_window_loss'] == pytest.approx(np.mean([a[s] for s in range(3, 7)]))
  again = train(tiny('auto', steps=6, final_window=5), str(tmp_path / 'b'))   # finished
  assert again == resumed
  # the per-step record of the final window (final_steps.jsonl) spans the resume too, and
  # equals the logged losses
  rec_a, rec_b = RunDir(tmp_path / 'a').final_steps(), RunDir(tmp_path / 'b').final_steps()
  assert rec_a == rec_b == {s: a[s] for s in range(3, 7)}


def test_resume_from_an_earlier_checkpoint_drops_the_lost_rows(tmp_path, caplog):
  """Also when the logs end in a torn line (the disk filled mid-write): the cut line is moved
  to metrics.jsonl.torn (nothing lost, a warning names it) and the resume goes on."""
  work = str(tmp_path / 'r')
  train(tiny(steps=5, schedule_steps=6), work)               # checkpoints at 3 and 5
  shutil.rmtree(os.path.join(work, 'checkpoints', '5'))      # the step-5 save never landed
  path = os.path.join(work, 'metrics.jsonl')
  whole = open(path).read()
  with open(path, 'w') as f:                                 # the last 60 bytes never landed
    f.write(whole[:-60])
  cut = whole[:-60].rsplit('\n', 1)[1]
  train(tiny(steps=6), work)
  steps = [json.loads(l)['step'] for l in open(path)]
  assert steps == list(range(1, 7))
  assert open(path + '.torn').read() == cut + '\n' and cut
  assert 'metrics.jsonl: line ' in logged(caplog)


def test_same_seed_same_batches_across_architectures(tmp_path):
  """Two different models consume the identical batch sequence (data order is model-free)."""
  from loopmoe_jax.data import pipeline
  seen = {}
  for name, loops in (('x', 1), ('y', 4)):
    cfg = tiny()
    cfg.model.num_loops = loops
    exp = build(cfg)
    it = pipeline.train_iterator(exp.data, exp.model.vocab_size, 5)
    seen[name] = [next(it)['inputs'] for _ in range(5)]
  for x, y in zip(seen['x'], seen['y']):
    np.testing.assert_array_equal(x, y)


def test_continuation_with_longer_schedule(tmp_path):
  train(tiny(steps=4, schedule_steps=4, decay_fraction=0.5), str(tmp_path / 'first'))
  cfg = tiny(steps=8, decay_fraction=0.5, init_from=str(tmp_path / 'first'), init_step=3,
             save_every=2)
  train(cfg, str(tmp_path / 'cont'))
  rows = [json.loads(l) for l in open(tmp_path / 'cont' / 'metrics.jsonl')]
  assert rows[0]['step'] == 4                                  # continued after step 3
  f = wsd_schedule(3e-3, 8, 2, 0.5, '1-sqrt', 0.05)
  for r in rows:                                               # the longer schedule's LR
    assert r['lr'] == pytest.approx(float(f(r['step'] - 1)), rel=1e-6)


def _garble(state_dir):
  for root, _, files in os.walk(state_dir):
    for f in files:
      with open(os.path.join(root, f), 'wb') as fh:
        fh.write(b'garbage')


def test_corrupt_latest_step_is_skipped(tmp_path, caplog):
  """A corrupt newest step is skipped; when every step is corrupt the run does not start
  over (which would overwrite its logs): an error, and nothing changed."""
  train(tiny(steps=6), str(tmp_path / 'r'))
  ckpt = tmp_path / 'r' / 'checkpoints'
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [3, 6]
  _garble(ckpt / '6' / 'state')
  loaded = RunDir(str(tmp_path / 'r')).load()
  assert loaded.step == 3
  assert 'step 6' in logged(caplog)
  summary = train(tiny(steps=6), str(tmp_path / 'r'))         # resumes from 3, redoes 4..6
  assert summary['steps'] == 6
  for s in ('3', '6'):
    _garble(ckpt / s / 'state')
  metrics = open(tmp_path / 'r' / 'metrics.jsonl').read()
  with pytest.raises(RuntimeError, match=r'every checkpoint step in .* is unreadable \(step 6: '
                     r'.*/6/state .*; step 3: .*/3/state .*--start_over'):
    train(tiny(steps=8), str(tmp_path / 'r'))
  assert open(tmp_path / 'r' / 'metrics.jsonl').read() == metrics
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [3, 6]
  # starting over is the user's choice: everything of the old run is moved aside, not deleted
  summary = train(tiny(steps=3), str(tmp_path / 'r'), start_over=True)
  assert summary['steps'] == 3
  aside = tmp_path / 'r' / 'unreadable_checkpoints'
  assert (aside / 'metrics.jsonl').read_text() == metrics
  assert (aside / '3').is_dir() and (aside / '6').is_dir()
  assert [json.loads(l)['step'] for l in open(tmp_path / 'r' / 'metrics.jsonl')] == [1, 2, 3]


def test_nan_loss_stops_and_keeps_the_good_checkpoint(tmp_path):
  work = str(tmp_path / 'n')
  train(tiny(steps=3), work)
  before = {p: open(p, 'rb').read() for p in _files(os.path.join(work, 'checkpoints', '3'))}
  with pytest.raises(TrainingDiverged, match='non-finite values'):
    train(tiny(steps=9, lr=1e30, warmup=0, save_every=1), work)
  steps = sorted(int(p) for p in os.listdir(os.path.join(work, 'checkpoints')) if p.isdigit())
  after = {p: open(p, 'rb').read() for p in _files(os.path.join(work, 'checkpoints', '3'))}
  assert before == after
  for s in steps:   # whatever was saved restores to finite params
    params = RunDir(work).load(s).params
    assert all(np.isfinite(np.asarray(x)).all() for x in __import__('jax').tree.leaves(params))


def _files(d):
  return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs)


def test_config_errors_name_the_field():
  cfg = tiny()
  from ml_collections import ConfigDict
  raw = ConfigDict({'model': dict(cfg.model), 'train': {'stepz': 3}, 'data': {}})
  with pytest.raises(ValueError, match=r'train\.stepz.*train\.steps'):
    build(raw)
  with pytest.raises(ValueError, match='train.schedule'):
    TrainConfig(schedule='linear-ish')
  with pytest.raises(ValueError, match='data.batch_size=12 does not split over the 8 batch shards'):
    c = tiny()
    c.data.batch_size = 12
    train(c, '/tmp/never')


def test_cli_typo_lists_near_names():
  out = subprocess.run([sys.executable, 'scripts/train.py', '--workdir=/tmp/x',
                        '--config.train.stepz=3'], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode != 0 and 'did you mean steps' in out.stderr


def test_sigterm_saves_a_restorable_checkpoint(tmp_path):
  work = str(tmp_path / 's')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  cmd = [sys.executable, 'scripts/train.py', f'--workdir={work}', '--config=configs/default.py:smoke',
         '--config.train.steps=100000', '--config.train.log_every=1',
         '--config.train.save_every=100000', '--config.train.sample_tokens=0',
         '--config.train.eval_every=2', '--config.data.batch_size=4', '--config.data.seq_len=32',
         '--config.run.dispatch=xla']
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  metrics = os.path.join(work, 'metrics.jsonl')
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3:
      break
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 143, out  # the signal's status, after the save
  saved = [l for l in out.splitlines() if l.startswith('SIGTERM: saved step ')]
  assert len(saved) == 1 and saved[0].endswith('and stopped (exit 143; re-run to resume)'), out
  assert RunDir(work).load().step == int(saved[0].split()[3]) >= 3
  summary = json.load(open(os.path.join(work, 'summary.json')))
  assert summary['stopped_by'] == 'SIGTERM'
  # the summary's validation loss says which step it was measured at: the last evaluated one
  last = [json.loads(l) for l in open(metrics) if 'val_loss' in l][-1]
  assert summary['val_step'] == last['step'] and summary['val_loss'] == last['val_loss']


def test_resume_with_another_model_is_an_error_and_loses_nothing(tmp_path):
  """A workdir written by another model (or data stream) is not silently restarted: the error
  names each differing field, and the checkpoints and metrics stay as they were. Changed
  train settings (more steps, another lr) resume and are printed."""
  work = str(tmp_path / 'c')
  train(tiny(steps=3), work)
  before = open(os.path.join(work, 'metrics.jsonl')).read()
  changed = tiny(steps=6)
  changed.model.expert_width = 16
  changed.data.seq_len = 8
  with pytest.raises(ValueError, match=r'(?s)model\.expert_width: 32 in the checkpoint, 16 now'
                                       r'.*data\.seq_len: 16 in the checkpoint, 8 now'):
    train(changed, work)
  assert open(os.path.join(work, 'metrics.jsonl')).read() == before
  assert sorted(os.listdir(os.path.join(work, 'checkpoints'))) == ['3']
  with pytest.raises(ValueError, match=r'(?s)intact but its train state.*train\.clip: 1\.0 in'):
    train(tiny(steps=6, clip=0.0), work)  # no clipping: another optimizer state
  resumed = tiny(steps=4, lr=1e-3)  # run settings of the same parameters may change too
  resumed.run.dispatch, resumed.run.remat = 'xla', 'full'
  summary = train(resumed, work)
  assert summary['steps'] == 4


def test_a_run_directory_from_before_the_run_section_loads_and_resumes(tmp_path, capsys, caplog,
                                                                      monkeypatch):
  """tests/data/run_v1 was written (2 steps) by the code before run settings had their own
  section: its config holds model.dispatch='xla' and model.remat='full'. It loads with them
  read into `run` (one note), and a copy resumes to step 4 under other run settings (dispatch
  'tiled', remat 'none': allowed, printed) with the losses of an uninterrupted run of today's
  code (xla, full) to 1e-5 at every step, the fixture's own two included. A resume that
  changes the architecture is refused naming the key; the old key on the command line is
  refused naming the new one."""
  import shutil as sh
  from loopmoe_jax import cli, experiment
  monkeypatch.setattr(experiment, '_NOTED', set())  # the note is once per process
  caplog.set_level(logging.INFO, logger='loopmoe_jax')  # a note: INFO
  fixture = os.path.join(os.path.dirname(__file__), 'data', 'run_v1')
  run = RunDir(fixture).load()
  assert (run.step, run.exp.run.dispatch, run.exp.run.remat) == (2, 'xla', 'full')
  assert run.runtime.run.remat == 'full' and run.exp.model.core_experts == 4
  capsys.readouterr()
  assert 'read as run.*' in logged(caplog, logging.INFO)
  work, straight = str(tmp_path / 'old'), str(tmp_path / 'straight')
  sh.copytree(fixture, work)
  want = tiny(steps=4, save_every=2, eval_every=2, routing_every=2)
  want.run.remat = 'full'
  train(want, straight)
  resumed = tiny('tiled', steps=4, save_every=2, eval_every=2, routing_every=2)
  summary = train(resumed, work)
  out = capsys.readouterr().out
  assert summary['steps'] == 4 and 'run.dispatch' in out and 'run.remat' in out
  got, ref = losses(work), losses(straight)
  assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
  for s in ref:
    assert got[s] == pytest.approx(ref[s], rel=1e-5), s
  changed = tiny(steps=6)
  changed.model.expert_width = 16
  with pytest.raises(ValueError, match=r'model\.expert_width: 32 in the checkpoint, 16 now'):
    train(changed, work)
  with pytest.raises(SystemExit, match=r'--config\.model\.remat: .*use --config\.run\.remat'):
    cli._check_config(['--config.model.remat=full'], 'configs/default.py:smoke')


def test_unreadable_newest_step_is_set_aside_and_written_again(tmp_path, capsys):
  """Resuming past a corrupt newest checkpoint moves it to unreadable_checkpoints/ (nothing
  deleted) and the redone step is saved again, readable, with the uninterrupted run's params."""
  import jax
  work, straight = str(tmp_path / 'w'), str(tmp_path / 's')
  train(tiny(steps=6), straight)
  train(tiny(steps=6), work)
  for f in _files(os.path.join(work, 'checkpoints', '6', 'state')):
    with open(f, 'wb') as fh:
      fh.write(b'garbage')
  train(tiny(steps=6), work)   # resumes from 3, redoes 4..6
  out = capsys.readouterr().out
  assert 'moved the unreadable checkpoint to' in out
  assert os.listdir(os.path.join(work, 'unreadable_checkpoints')) == ['6']
  loaded = RunDir(work).load()
  params, step = loaded.params, loaded.step
  want = RunDir(straight).load().params
  assert step == 6
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_finite_update_is_never_saved(tmp_path):
  """A finite loss with an update that overflows the params (lr 1e38, no clipping) stops
  before saving: every saved step restores to finite params."""
  import jax
  work = str(tmp_path / 'f')
  with pytest.raises(TrainingDiverged, match='non-finite'):
    train(tiny(steps=4, lr=1e38, schedule='constant', warmup=0, clip=0.0, save_every=1), work)
  ckpt = os.path.join(work, 'checkpoints')
  for s in sorted(int(p) for p in os.listdir(ckpt) if p.isdigit()) if os.path.isdir(ckpt) else []:
    params = RunDir(work).load(s).params
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params)), s


def test_evaluate_and_sample_from_a_workdir(tmp_path, monkeypatch):
  """Without the trainer: the checkpoint's validation loss equals the one the run logged at
  its last step; greedy sampling continues the prompt and is deterministic; the run layer
  (train/run.py) reads the same things once; bad arguments name the flag."""
  from loopmoe_jax.train.evaluation import evaluate_checkpoint, sample_text
  work = str(tmp_path / 'e')
  summary = train(tiny(steps=3), work)
  out = evaluate_checkpoint(work)
  assert out['step'] == 3
  assert out['val_loss']['2'] == pytest.approx(summary['val_loss'], rel=1e-5)
  from loopmoe_jax.train import evaluation
  evaluated = []
  monkeypatch.setattr(evaluation.steps, 'evaluate', lambda *a: evaluated.append(a) or 0.0)
  with pytest.raises(ValueError, match='num_loops=0'):  # a bad count is refused up front
    evaluate_checkpoint(work, (2, 4, 0))
  assert not evaluated
  monkeypatch.undo()
  text = sample_text(work, 'def ', 6, 0.0, 0)
  assert text.startswith('def ') and text == sample_text(work, 'def ', 6, 0.0, 1)
  # the run layer: one read gives the built experiment, the params the checkpoint reader
  # gives (against the trainer's restore of the whole state), and the run's own files; a
  # loaded run answers for its own step only
  from loopmoe_jax.experiment import build
  from loopmoe_jax.job import Job
  from loopmoe_jax.train.run import as_loaded
  run_dir = RunDir(work)
  run = run_dir.load()
  mngr = checkpoint.manager(run_dir.checkpoints, read_only=True, async_save=False)
  step, state, _, _ = checkpoint.restore_latest(mngr, Job.build(run.exp).abstract_state)
  assert run.step == step == 3 and run.exp == build(tiny(steps=3))
  assert run.config == checkpoint.stored_config(mngr)[1]
  for got, want in zip(jax.tree.leaves(run.variables), jax.tree.leaves(state['params'])):
    np.testing.assert_array_equal(got, want)
  assert [r['step'] for r in run_dir.metrics()][-1] == 3
  assert run_dir.summary()['val_loss'] == summary['val_loss']
  assert as_loaded(run) is run and as_loaded(run, 3) is run
  assert sample_text(run, 'def ', 6, 0.0, 0) == text
  with pytest.raises(ValueError, match='step 2 asked of a loaded step 3'):
    as_loaded(run, 2)
  with pytest.raises(ValueError, match='--tokens=0'):
    sample_text(work, 'def ', 0, 0.0, 0)
  with pytest.raises(ValueError, match='--prompt is empty'):
    sample_text(work, '', 4, 0.0, 0)
  with pytest.raises(ValueError, match=r'--tokens=1000000000000: a KV cache of .* GiB'):
    sample_text(work, 'def ', 10**12, 0.0, 0)  # refused before anything is allocated


def test_kept_steps_survive_keep(tmp_path):
  """train.keep=2 plus keep_every=4 and keep_steps='3': the newest two, every 4th and step 3."""
  work = str(tmp_path / 'k')
  train(tiny(steps=9, save_every=1, keep=2, keep_every=4, keep_steps='3'), work)
  kept = sorted(int(p) for p in os.listdir(os.path.join(work, 'checkpoints')) if p.isdigit())
  assert kept == [3, 4, 8, 9]
  with pytest.raises(ValueError, match=r"train\.keep_steps='4x'"):
    TrainConfig(keep_steps='4x')


def test_foil_recipe_trains_in_bfloat16_and_keeps_its_continuation_step():
  from loopmoe_jax.experiment import load_config
  exp = build(load_config('configs/foil.py:foil1'))
  assert (exp.model.dtype, exp.model.param_dtype) == ('bfloat16', 'float32')
  assert 45000 in exp.train.kept_steps and exp.train.steps == 50000


def test_profile_steps_trace_exactly_those_steps(tmp_path):
  """train.profile_steps='2:4' writes a jax.profiler trace under RUN/profile whose step marks
  are steps 2 and 3 (the Perfetto trace read back), beside TensorBoard's xplane file; the
  losses are those of the run without it; bad ranges name the key."""
  import gzip
  import glob
  cfg = tiny(steps=4)
  cfg.train.profile_steps = '2:4'
  train(cfg, str(tmp_path / 'p'))
  trace = glob.glob(str(tmp_path / 'p/profile/plugins/profile/*/perfetto_trace.json.gz'))
  assert len(trace) == 1 and glob.glob(str(tmp_path / 'p/profile/plugins/profile/*/*.xplane.pb'))
  events = json.load(gzip.open(trace[0]))
  events = events['traceEvents'] if isinstance(events, dict) else events
  marked = sorted(int(e['args']['step_num']) for e in events if e.get('name') == 'train')
  assert marked == [2, 3]
  train(tiny(steps=4), str(tmp_path / 'plain'))
  assert losses(str(tmp_path / 'p')) == losses(str(tmp_path / 'plain'))
  for bad, needle in (('4:2', '1 <= A < B'), ('2-4', 'expected A:B'), ('9:12', 'train.steps=6')):
    with pytest.raises(ValueError, match=f"train.profile_steps='{bad}'.*{needle}"):
      TrainConfig(profile_steps=bad, steps=6)


def test_a_wandb_run_offline_logs_the_metrics_rows(tmp_path):
  """train.wandb=PROJECT with W&B's offline mode: the run's local W&B files (WORKDIR/wandb)
  hold the metrics rows the JSONL holds, under a run id that is the workdir's. The run is a
  child process: W&B's service (a process and threads) would otherwise outlive the test in
  the test worker."""
  wandb = pytest.importorskip('wandb', reason='pip install wandb')
  work = str(tmp_path / 'w')
  env = dict(os.environ, JAX_PLATFORMS='cpu', WANDB_MODE='offline', WANDB_SILENT='true')
  out = subprocess.run(
      [sys.executable, 'scripts/train.py', f'--workdir={work}', '--config=configs/default.py:smoke',
       '--config.train.steps=3', '--config.train.log_every=1', '--config.train.sample_tokens=0',
       '--config.data.batch_size=4', '--config.data.seq_len=32', '--config.run.dispatch=xla',
       '--config.train.wandb=loopmoe-test'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  runs = [d for d in os.listdir(os.path.join(work, 'wandb')) if d.startswith('offline-run-')]
  assert len(runs) == 1
  records = os.path.join(work, 'wandb', runs[0])
  data = [f for f in os.listdir(records) if f.endswith('.wandb')]
  assert data, os.listdir(records)
  logged = {}
  from wandb.proto import wandb_internal_pb2
  for raw in _wandb_records(os.path.join(records, data[0])):
    rec = wandb_internal_pb2.Record()
    rec.ParseFromString(raw)
    if rec.WhichOneof('record_type') == 'history':
      items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
      logged[int(items['_step'])] = items.get('loss')
  assert logged == losses(work)
  del wandb


def _wandb_records(path):
  """The records of a W&B run file: a 7-byte header (':W&B', magic, version), then 32 KiB
  blocks of chunks, each with a 7-byte header (crc32, length, type: 1 whole record, 2 first,
  3 middle, 4 last part of one)."""
  data, block, pos, buf = open(path, 'rb').read(), 32768, 7, b''
  assert data[:4] == b':W&B'
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, n, kind = struct.unpack('<IHB', data[pos:pos + 7])
    if n == 0 and kind == 0:  # padding to the end of the block
      pos += left
      continue
    buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
    if kind in (1, 4):
      yield buf
      buf = b''
