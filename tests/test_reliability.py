"""Faults a new user meets: damaged checkpoint parts, a full disk, two trainers on one workdir,
silent fallbacks, unchecked sizes, and how the CLIs report errors."""
import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from loopmoe_jax.train.run import RunDir
from loopmoe_jax.data import pipeline, sources
from loopmoe_jax.train import checkpoint, checksums
from loopmoe_jax.train.evaluation import evaluate_checkpoint, sample_text
from loopmoe_jax.train.lock import WorkdirLock, WorkdirLocked
from loopmoe_jax.train.loop import TrainingDiverged
from loopmoe_jax.train.trainer import train
from helpers import logged, losses, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """An uninterrupted 6-step run (checkpoints at 3 and 6), shared by the tests here."""
  work = str(tmp_path_factory.mktemp('straight') / 'run')
  train(tiny(steps=6), work)
  return work


def _routing_keys(work):
  rows = [json.loads(l) for l in open(os.path.join(work, 'routing.jsonl'))]
  return [(r['step'], r['segment'], r['pass'], r['layer']) for r in rows]


@pytest.mark.parametrize('part', ['config', 'data'])
def test_damaged_part_of_the_newest_step_is_set_aside(straight, tmp_path, capsys, caplog,
                                                      part):
  work = str(tmp_path / 'run')
  shutil.copytree(straight, work)
  damaged = os.path.join(work, 'checkpoints', '6', part, 'metadata')
  with open(damaged, 'w') as f:
    f.write('{"broken json')
  capsys.readouterr()
  caplog.clear()
  train(tiny(steps=6), work)                 # resumes from step 3 and redoes 4..6
  out = capsys.readouterr().out
  assert (f'checkpoint step 6 is unreadable: {os.path.join(work, "checkpoints", "6", part)}'
          in logged(caplog))
  assert 'resuming from step 3' in out
  assert os.path.exists(os.path.join(work, 'unreadable_checkpoints', '6', part, 'metadata'))
  assert losses(work) == losses(straight)    # bitwise: the same floats
  assert sorted(_routing_keys(work)) == sorted(_routing_keys(straight))  # no row twice


def test_injected_full_disk_stops_with_one_line(tmp_path, monkeypatch):
  work = str(tmp_path / 'run')
  real_save = checkpoint.ocp.CheckpointManager.save

  def save(self, step, *a, **kw):
    if step == 6:  # the disk fills while step 6 is written
      os.makedirs(os.path.join(str(self.directory), '6.orbax-checkpoint-tmp-17'))
      raise OSError(errno.ENOSPC, 'No space left on device')
    return real_save(self, step, *a, **kw)
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, 'save', save)
  with pytest.raises(checkpoint.CheckpointSaveError) as err:
    train(tiny(steps=9), work)
  message = str(err.value)
  ckpt_dir = os.path.join(work, 'checkpoints')
  assert '\n' not in message and len(message) < 300
  assert message.startswith(f'saving checkpoint step 6 to {ckpt_dir} failed (no space left on '
                            'device; ') and 'MiB free there' in message
  assert os.listdir(ckpt_dir) == ['3']       # the earlier step kept, no temporary left
  assert RunDir(work).load().step == 3


def test_failed_background_save_names_its_step(tmp_path, monkeypatch):
  """An asynchronous save of step 3 that fails in the background (the write of its files
  raises ENOSPC, reported when the save is waited for) stops the run naming step 3."""
  real_wait, failed = checkpoint.ocp.CheckpointManager.wait_until_finished, []

  def wait(self):
    real_wait(self)
    if 3 in self.all_steps() and not failed:
      failed.append(3)
      shutil.rmtree(os.path.join(str(self.directory), '3'))
      raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, 'wait_until_finished', wait)
  with pytest.raises(checkpoint.CheckpointSaveError,
                     match=r'^saving checkpoint step 3 to .* failed \(no space left on device'):
    train(tiny(steps=6, async_save=True), str(tmp_path / 'run'))


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
  monkeypatch.setattr(checkpoint.storage, 'free_bytes', lambda path: 4096)
  work = str(tmp_path / 'run')
  with pytest.raises(checkpoint.CheckpointSaveError,
                     match=r'^checkpoint step 3 not saved: .* has 0\.0 MiB free, the step needs '
                           r'about \d+\.\d MiB; earlier steps are kept$'):
    train(tiny(steps=6), work)
  assert os.listdir(os.path.join(work, 'checkpoints')) == []


def test_second_trainer_on_a_workdir_is_refused_and_a_dead_holder_is_stale(tmp_path, caplog):
  work = str(tmp_path / 'run')
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time\nfrom loopmoe_jax.train.lock import WorkdirLock\n'
       f'with WorkdirLock({work!r}):\n  print("held", flush=True)\n  time.sleep(300)'],
      stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'held'
    with pytest.raises(WorkdirLocked, match=rf'in use by another trainer \(pid {holder.pid} on '
                                            rf'host {os.uname().nodename}'):
      train(tiny(steps=1), work)
    assert not os.path.exists(os.path.join(work, 'metrics.jsonl'))  # nothing touched
  finally:
    holder.send_signal(signal.SIGKILL)      # a crash: the lock file stays, its flock goes
    holder.wait()
  caplog.clear()
  train(tiny(steps=1, save_every=1), work)
  assert f'left by pid {holder.pid}' in logged(caplog)
  with WorkdirLock(work):                    # released on exit
    pass


def test_a_path_with_a_source_that_reads_none_is_an_error():
  with pytest.raises(ValueError, match=r"data\.path='x\.bin' is read only by data\.source in "
                                       r"\('tokens', 'zarr', 'manifest'\), not data\.source='embedded'"):
    pipeline.DataConfig(path='x.bin')
  with pytest.raises(ValueError, match=r"data\.val_path='v\.bin'.*data\.source='synthetic'"):
    pipeline.DataConfig(source='synthetic', val_path='v.bin')


def test_token_file_header_length_is_checked_against_the_file(tmp_path):
  path = str(tmp_path / 'toks.bin')
  sources.write_token_file(path, list(range(100)), 256, 'byte')
  with open(path, 'r+b') as f:
    f.seek(8)
    f.write((2 ** 62).to_bytes(8, 'little'))
  with pytest.raises(ValueError, match=rf"token file '{path}': its header length field says "
                                       rf"{2 ** 62} bytes, but the file has \d+ bytes"):
    sources.TokenFile(path)


def test_pass_counts_past_the_limit_are_refused_before_computing(straight):
  t = time.time()
  with pytest.raises(ValueError, match=r'num_loops=100000 exceeds the limit of 16 passes '
                                       r'\(8 x the trained model\.num_loops=2\)'):
    evaluate_checkpoint(straight, [2, 100000])
  with pytest.raises(ValueError, match=r'num_loops=100000 exceeds the limit'):
    sample_text(straight, 'def ', 5, 0.8, 0, num_loops=100000)
  assert time.time() - t < 30  # the checkpoint read, no forward pass


def test_a_missing_step_lists_the_steps_and_generate_takes_a_step(straight):
  with pytest.raises(FileNotFoundError, match=r'step 7: no such checkpoint .* \(steps there: '
                                              r'\[3, 6\]\)'):
    evaluate_checkpoint(straight, [None], step=7)
  assert RunDir(straight).load(3).step == 3
  text = sample_text(straight, 'def ', 5, 0.0, 0, step=3)
  assert text.startswith('def ') and len(text) >= 5


def test_divergence_before_any_checkpoint_says_so(tmp_path):
  with pytest.raises(TrainingDiverged, match='no checkpoint has been written yet'):
    train(tiny(steps=9, lr=1e30, warmup=0, save_every=9), str(tmp_path / 'run'))


def test_every_logged_step_has_a_throughput_and_saves_are_printed(straight):
  rows = [json.loads(l) for l in open(os.path.join(straight, 'metrics.jsonl'))]
  assert [r['step'] for r in rows] == list(range(1, 7))  # log_every=1, saves at 3 and 6
  assert all(r['tokens_per_s'] > 0 for r in rows)


def _cli(*args, env_extra=None):
  env = dict(os.environ, **(env_extra or {}))
  return subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'train.py'), *args],
                        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_cli_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
  work = f'--workdir={tmp_path / "w"}'
  missing = _cli('--config=configs/nope.py', work)
  assert missing.returncode == 1 and 'Traceback' not in missing.stderr
  assert missing.stderr.strip().splitlines()[-1] == ("error: --config=configs/nope.py: "
                                                     "FileNotFoundError: no config file "
                                                     "'configs/nope.py'")
  invalid = _cli('--config.model.top_k=99', work)
  assert invalid.returncode == 1 and 'Traceback' not in invalid.stderr
  assert invalid.stderr.strip().splitlines()[-1] == (
      'error: model.top_k=99: exceeds model.prelude_experts=8')
  debug = _cli('--config.model.top_k=99', work, '--debug')
  assert debug.returncode == 1 and 'Traceback' in debug.stderr


def test_preflight_refuses_a_step_that_cannot_fit_before_any_compile(tmp_path):
  """--config.model.num_loops=100000 (the main job: 200,002 executed layers) used to compile
  for minutes and die out of memory: the pre-flight check refuses it within seconds, naming
  the key, and leaves no run behind (here a core of one layer; 10^6 passes: about 229 GB of
  activations by the estimate, past any test machine's memory, where 10^5 passes, 23 GB, fit
  the estimate on an idle 24 GiB machine)."""
  cfg = tiny()
  cfg.model.num_loops = 1000000
  work = str(tmp_path / 'deep')
  t0 = time.time()
  with pytest.raises(ValueError, match=r'model.num_loops=1000000 \(1,000,001 executed layers\)'):
    train(cfg, work)
  assert time.time() - t0 < 30
  assert not os.path.exists(os.path.join(work, 'checkpoints')) or not os.listdir(
      os.path.join(work, 'checkpoints'))
  assert not os.path.exists(os.path.join(work, 'metrics.jsonl'))


def test_preflight_names_the_tokens_when_the_batch_drives_it():
  """The same lower bound against a small budget: a long batch is named by its keys, the
  estimate's terms add up, and a budget that holds it passes."""
  import jax  # pylint: disable=import-outside-toplevel
  from loopmoe_jax import sharding  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.experiment import build  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.model import LoopedMoE  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.train import preflight, step as steps  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.train.optimizer import make_optimizer  # pylint: disable=import-outside-toplevel
  cfg = tiny()
  cfg.data.batch_size, cfg.data.seq_len = 64, 4096
  exp = build(cfg)
  mesh = sharding.make_mesh(exp.mesh, jax.devices()[:1])
  tx, _ = make_optimizer(exp.train)
  model = LoopedMoE(exp.model)
  state_sh, _ = steps.shardings(mesh, model, tx, 16)
  state = steps.abstract_state(model, tx, 16, state_sh)
  est = preflight.estimate(exp, mesh, state)
  # remat none: every executed layer (1 prelude + 1 core layer x 2 passes) keeps its input and
  # norm (2 x 32), q, k, v, out (4 x 2 heads x 16) and top-2 routed rows (2 x (32 + 3 x 32))
  # per token (a whole number of 128-row tiles already), float32; chunked attention
  assert est['activations'] == 3 * 64 * 4096 * (64 + 128 + 256) * 4
  need = est['params'] + est['optimizer'] + est['gradients'] + est['activations']
  assert preflight.check_memory(exp, mesh, state, budget=need) == est
  # one pass of the core would fit just below the need: the passes are named
  with pytest.raises(ValueError, match=r'model.num_loops=2 \(3 executed layers\)'):
    preflight.check_memory(exp, mesh, state, budget=need - 1)
  # far below, fewer passes would not help: the tokens are named
  with pytest.raises(ValueError, match=r'data.batch_size=64 x data.seq_len=4096'):
    preflight.check_memory(exp, mesh, state, budget=need // 4)
  # a run drawing up to 5 passes is sized at 5: 1 prelude + 5 core layers
  cfg.train.loops_sampler, cfg.train.loops_high = 'uniform', 5
  sampled = preflight.estimate(build(cfg), mesh, state)
  assert sampled['activations'] == 6 * 64 * 4096 * (64 + 128 + 256) * 4
  # with truncated backprop through the last 2 of them (counts drawn from 2 up), the backward
  # keeps 2: 1 prelude + 2 core layers
  cfg.train.loops_low, cfg.train.backprop_loops = 2, 2
  truncated = preflight.estimate(build(cfg), mesh, state)
  assert truncated['activations'] == 3 * 64 * 4096 * (64 + 128 + 256) * 4


def _interrupt_before_the_loop(tmp_path, when: str):
  """Starts the smoke run, stops it (SIGSTOP) 1 s in ('import') or as soon as its checkpoint
  directory exists ('setup': the state is being created and compiled), and sends SIGINT if it
  has not printed the 'model:' line that opens the training loop yet. Returns (status, stdout
  lines, stderr lines), or None when the run had already reached the loop."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  work = tmp_path / 'run'
  shutil.rmtree(work, ignore_errors=True)
  cmd = [sys.executable, 'scripts/train.py', f'--workdir={work}',
         '--config=configs/default.py:smoke', '--config.train.sample_tokens=0',
         '--config.run.dispatch=xla']
  proc = subprocess.Popen(cmd, cwd=root, env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  lines = {'out': [], 'err': []}
  readers = [threading.Thread(target=lambda f=f, k=k: lines[k].extend(f), daemon=True)
             for k, f in (('out', proc.stdout), ('err', proc.stderr))]
  for r in readers:
    r.start()
  if when == 'import':
    time.sleep(1.0)
  else:
    deadline = time.time() + 240
    while (not (work / 'checkpoints').is_dir() and proc.poll() is None
           and time.time() < deadline):
      time.sleep(0.01)
  proc.send_signal(signal.SIGSTOP)
  time.sleep(0.2)  # what it printed before it stopped reaches the readers
  in_loop = any(l.startswith('model:') for l in lines['out'])
  proc.send_signal(signal.SIGKILL if in_loop else signal.SIGINT)
  proc.send_signal(signal.SIGCONT)
  proc.wait(timeout=120)
  for r in readers:
    r.join(timeout=10)
  return None if in_loop else (proc.returncode, lines['out'], lines['err'])


@pytest.mark.parametrize('when', ['import', 'setup'])
def test_ctrl_c_before_the_loop_is_one_line_and_status_130(tmp_path, when):
  """SIGINT while the modules import or while the run is set up (its state created and
  compiled): one line, exit status 130, no traceback (it used to print 245 lines, or, during
  an import that swallowed the KeyboardInterrupt, to train on). The run is frozen with SIGSTOP
  to check that it has not reached the loop (where SIGINT saves and stops instead); a run
  that got there first is tried again."""
  for _ in range(3):
    got = _interrupt_before_the_loop(tmp_path, when)
    if got is not None:
      break
  assert got is not None, 'the run reached the training loop before SIGINT three times'
  status, _, err = got
  assert status == 130, err
  assert not any('Traceback' in l for l in err) and 'interrupted (SIGINT)' in err[-1]


def test_silently_corrupted_state_is_detected_by_checksum(straight, tmp_path, capsys, caplog):
  """4 KiB of the embedding zeroed in the newest step's state, in bytes that still decode:
  Orbax restores it without complaint (wrong values); the checksums saved with the step
  catch it, the
  step is set aside naming the array and the file, and the run resumes from step 3 with the
  same losses. Evaluation's reader skips the damaged step too."""
  work = str(tmp_path / 'run')
  shutil.copytree(straight, work)
  # bytes that still decode but to other values: the step's state rewritten with rows 64..95
  # of the embedding zeroed (4 KiB), its data-iterator state and checksums left as they were
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  state_dir = os.path.join(work, 'checkpoints', '6', 'state')
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(state_dir)
    meta = getattr(meta, 'item_metadata', meta)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
    state = ckptr.restore(state_dir, target)
    state['params']['embed'] = state['params']['embed'].at[64:96].set(0.0)
    ckptr.save(str(tmp_path / 'rewritten'), state)
  shutil.rmtree(state_dir)
  shutil.copytree(str(tmp_path / 'rewritten'), state_dir)
  assert RunDir(work).load().step == 3  # the params reader skips the damaged step
  capsys.readouterr()
  caplog.clear()
  train(tiny(steps=6), work)
  out = capsys.readouterr().out
  state_dir = os.path.join(work, 'checkpoints', '6', 'state')
  assert f'checkpoint step 6 is unreadable: {state_dir} (the checksum of' in logged(caplog)
  assert 'resuming from step 3' in out
  assert os.path.isdir(os.path.join(work, 'unreadable_checkpoints', '6'))
  assert losses(work) == losses(straight)


def test_checkpoint_without_checksums_restores_and_says_so_once(straight, tmp_path, capsys,
                                                                caplog):
  """A step written before checksums were recorded (its data-iterator state has none) still
  restores; the trainer says once that it is unverified and goes on."""
  work = str(tmp_path / 'run')
  shutil.copytree(straight, work)
  for step in (3, 6):
    meta = os.path.join(work, 'checkpoints', str(step), 'data', 'metadata')
    data = json.load(open(meta))
    assert checksums.CHECKSUMS in data
    data.pop(checksums.CHECKSUMS)
    json.dump(data, open(meta, 'w'))
  capsys.readouterr()
  caplog.clear()
  train(tiny(steps=7), work)
  out = capsys.readouterr().out
  assert logged(caplog).count('has no checksums') == 1 and 'resuming from step 6' in out


def test_truncated_state_file_is_one_line_not_thousands(straight, tmp_path):
  """Half of each of the newest step's array data files (the state's d/ folders) cut off: the
  resume says so in one line and moves it aside; Orbax's abandoned reads no longer print a
  traceback each (7,611 lines). (Cutting only the largest file once let a run restore step 6
  in a full-suite run: every data file is cut now.)"""
  work = str(tmp_path / 'run')
  shutil.copytree(straight, work)
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(work, 'checkpoints', '6',
                                                                    'state'))
           for f in fs if os.path.basename(d) == 'd']
  assert files
  for f in files:
    os.truncate(f, os.path.getsize(f) // 2)
  code = ('import sys; sys.path.insert(0, "tests"); from helpers import tiny; '
          'from loopmoe_jax.train.trainer import train; '
          f'train(tiny(steps=6), {work!r})')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'), timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  text = out.stdout + out.stderr
  assert 'Exception ignored' not in text and 'Traceback' not in text
  assert sum('checkpoint step 6 is unreadable' in l for l in text.splitlines()) == 1, text
  assert 'resuming from step 3' in text


def test_full_disk_while_logging_is_one_line_and_leaves_no_torn_line(straight, tmp_path,
                                                                   monkeypatch):
  """The disk fills while step 5's metrics row is written (half of it lands): the run stops
  with one line naming metrics.jsonl, the file keeps whole lines only, the checkpoints are
  intact, and the same command then resumes to the same losses."""
  from loopmoe_jax.train import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
  work = str(tmp_path / 'run')
  real_write = os.write

  def write(fd, data):
    if os.readlink(f'/proc/self/fd/{fd}').endswith('metrics.jsonl') and b'"step": 5,' in data:
      return real_write(fd, data[:len(data) // 2])
    return real_write(fd, data)
  monkeypatch.setattr(metrics_lib.os, 'write', write)
  with pytest.raises(OSError) as err:
    train(tiny(steps=6), work)
  message = str(err.value)
  assert '\n' not in message and f'writing {os.path.join(work, "metrics.jsonl")} failed' in message
  text = open(os.path.join(work, 'metrics.jsonl')).read()
  assert text.endswith('\n') and [json.loads(l)['step'] for l in text.splitlines()] == [1, 2, 3, 4]
  monkeypatch.setattr(metrics_lib.os, 'write', real_write)
  train(tiny(steps=6), work)
  assert losses(work) == losses(straight)


def test_workdir_flag_and_zarr_errors_are_one_line(tmp_path):
  """A workdir that is empty or a file, a flag of the wrong type and a path that holds no zarr
  array: one line each, naming the flag or path (with a fix), no raw errno or tensorstore spec."""
  from loopmoe_jax.data import sources  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.train.trainer import check_workdir  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match='--workdir is empty'):
    check_workdir('')
  afile = tmp_path / 'afile'
  afile.write_text('x')
  with pytest.raises(ValueError, match=f'--workdir={afile} is a file'):
    check_workdir(str(afile))
  with pytest.raises(ValueError) as err:
    sources.ZarrTokens(str(tmp_path))
  text = str(err.value)
  assert 'tensorstore_spec' not in text and '{' not in text and str(tmp_path) in text
  out = subprocess.run([sys.executable, 'scripts/train.py', f'--workdir={tmp_path / "r"}',
                        '--force=maybe'], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 1 and 'FATAL' not in out.stderr
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('error: ') and '--force=maybe' in last


def test_data_is_checked_before_the_model_is_built(tmp_path, monkeypatch):
  """A data file that does not exist, or a token file with a bad header, is reported before
  any model is built (the README's promise; it came 67-101 s in, after model init)."""
  from loopmoe_jax.train import trainer  # pylint: disable=import-outside-toplevel

  class NoJob:
    @staticmethod
    def build(*a, **kw):
      raise AssertionError('the model was built before the data was checked')
  monkeypatch.setattr(trainer, 'Job', NoJob)
  bad = tmp_path / 'bad.bin'
  bad.write_bytes(b'not a token file at all')
  for path, match in ((tmp_path / 'missing.bin', 'missing.bin'), (bad, 'bad.bin')):
    cfg = tiny()
    cfg.data.source, cfg.data.path = 'tokens', str(path)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
      train(cfg, str(tmp_path / 'run'))


def test_checksums_equal_numpy_on_any_sharding_without_gathering():
  """The two sums against numpy's (wrapping uint32) on an array split along its second axis:
  the same on one device and on 8, and the sharded program gathers no array (at most each
  device's partial sums, one number per device: the one-pass reduce's combine). Recorded
  checksums of which none names an array of the tree are a mismatch, not a pass."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  x = jax.numpy.asarray(np.random.default_rng(0).standard_normal((16, 64)), jax.numpy.float32)
  u = np.asarray(x).view(np.uint32).reshape(-1).astype(np.uint64)
  w = (np.arange(u.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
  want = [int(u.sum() % 2**32), int((u * w).sum() % 2**32)]
  mesh = jax.make_mesh((8,), ('x',), devices=jax.devices()[:8])
  split = jax.device_put(x, NamedSharding(mesh, P(None, 'x')))
  assert checksums.checksums({'a': x}) == checksums.checksums({'a': split}) == {"['a']": want}
  hlo = checksums.checksum_program().lower({'a': split}).compile().as_text()
  gathered = [math.prod(int(d) for d in dims.split(',') if d) for dims in re.findall(
      r'= \w+\[([\d,]*)\][^ ]* all-gather\(', hlo)]
  assert all(n <= 8 for n in gathered), gathered
  assert checksums.checksum_mismatch({'a': x}, {"['a']": want}) is None
  assert checksums.checksum_mismatch({'a': x}, {"['a']": [want[0], want[1] ^ 1]}) == "['a']"
  assert checksums.checksum_mismatch({'a': x}, {"['b']": want}) is not None


def test_abandoned_orbax_reads_are_quiet_and_other_errors_are_not():
  """The unraisable hook drops the errors of Orbax's abandoned reads, also when asyncio wraps
  the coroutine (the error's frames are Orbax's, the object's code is asyncio's) or a
  TensorStore future (asyncio's frame alone, the driver named), and passes every other error
  on; so does the filter of asyncio's never-retrieved task errors."""
  import os.path
  import types
  from loopmoe_jax.train import checkpoint

  def error_from(filename):
    try:
      exec(compile('raise ValueError("read failed")', filename, 'exec'))  # pylint: disable=exec-used
    except ValueError as e:
      return e
  seen = []
  hook = checkpoint._quiet_abandoned_reads(seen.append)  # pylint: disable=protected-access
  wrapped = lambda e: types.SimpleNamespace(object=object(), exc_value=e,
                                            exc_traceback=e.__traceback__, exc_type=ValueError)
  orbax_file = os.path.join(os.sep, 'site', 'orbax', 'checkpoint', 'serialization.py')
  hook(wrapped(error_from(orbax_file)))
  assert seen == []
  other = wrapped(error_from(os.path.join(os.sep, 'site', 'mine', 'code.py')))
  hook(other)
  assert seen == [other]
  # a TensorStore read's own future wrapped by asyncio: only asyncio's frame, the message
  # names the driver (the never-retrieved task asyncio logs at exit); asyncio's other errors pass
  asyncio_file = os.path.join(os.sep, 'lib', 'asyncio', 'tasks.py')
  tensorstore = ValueError('OUT_OF_RANGE: Error opening "zarr" driver: Error reading "a/.zarray"')
  plain = ValueError('read failed')
  for e in (tensorstore, plain):
    try:
      exec(compile('raise e', asyncio_file, 'exec'))  # pylint: disable=exec-used
    except ValueError as err:
      err.with_traceback(err.__traceback__.tb_next)  # asyncio's frame alone, as in a task
  seen.clear()
  hook(wrapped(tensorstore))
  assert seen == []
  hook(wrapped(plain))
  assert len(seen) == 1
  task_filter = checkpoint._AbandonedOrbaxTasks()  # pylint: disable=protected-access
  record = lambda e: logging.LogRecord('asyncio', logging.ERROR, __file__, 0,
                                       'Task exception was never retrieved', (),
                                       (ValueError, e, e.__traceback__))
  assert not task_filter.filter(record(tensorstore)) and task_filter.filter(record(plain))


def test_importing_the_package_rewires_nothing():
  """Importing every module of loopmoe_jax and pallas_kernels (in a fresh interpreter, as a
  notebook would) leaves sys.excepthook, sys.unraisablehook and the SIGINT and SIGTERM
  handlers as they were, and the package's logger without a handler: the scripts' entry
  (cli.run) and the trainer install theirs."""
  code = '\n'.join([
      'import importlib, logging, pkgutil, signal, sys',
      'def hooks():',
      '  return (sys.excepthook, sys.unraisablehook, signal.getsignal(signal.SIGINT),',
      '          signal.getsignal(signal.SIGTERM))',
      'before = hooks()',
      'import loopmoe_jax, pallas_kernels',
      'for pkg in (loopmoe_jax, pallas_kernels):',
      '  for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):',
      '    importlib.import_module(m.name)',
      'from loopmoe_jax.train import checkpoint',
      'print("SAME", [a is b for a, b in zip(before, hooks())])',
      'print("HANDLERS", logging.getLogger("loopmoe_jax").handlers)',
      'checkpoint.quiet_orbax_errors(); checkpoint.quiet_orbax_errors()',
      'print("QUIET", [a is b for a, b in zip(before, hooks())])'])
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'SAME [True, True, True, True]' in out.stdout, out.stdout
  assert 'HANDLERS []' in out.stdout, out.stdout
  assert 'QUIET [False, False, True, True]' in out.stdout, out.stdout  # installed once, on call


def test_scripts_print_the_library_warnings_and_notes_on_stderr():
  """Under a script's entry (cli.run) the package's warnings print on stderr as `WARNING: ...`
  and its INFO notes as `note: ...`, each once (not again through absl's handler on the root
  logger, nor twice for a second install), DEBUG not at all, nothing on stdout."""
  code = '\n'.join([
      'import logging',
      'from loopmoe_jax import cli',
      'def main(argv):',
      '  log = logging.getLogger("loopmoe_jax.train.lock")',
      '  log.warning("a stale lock %s", 1); log.info("a note"); log.debug("a detail")',
      '  cli.log_to_stderr()',
      '  log.warning("once")',
      'cli.run(main)'])
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-3000:]
  mine = [l for l in out.stderr.splitlines() if l.endswith(('a stale lock 1', 'a note',
                                                            'a detail', 'once'))]
  assert mine == ['WARNING: a stale lock 1', 'note: a note', 'WARNING: once'], out.stderr
  assert out.stdout == '', out.stdout
