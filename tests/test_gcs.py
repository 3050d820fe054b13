"""gs:// everywhere a path is taken, against a real GCS-protocol server on 127.0.0.1
(gcp-storage-emulator, the test extra; skipped with the install line when absent), reached
through the standard variables: STORAGE_EMULATOR_HOST (gcsfs, google-cloud-storage) and
TENSORSTORE_GCS_HTTP_URL (tensorstore, Orbax's arrays). A run with its workdir and its token
files on gs:// is killed (-9) after a checkpoint, resumed, and its losses equal a local run's
bit for bit; it evaluates and exports to gs://; a second trainer on the workdir is refused."""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from loopmoe_jax import gcs_server, storage
from loopmoe_jax.data import sources
from loopmoe_jax.train import lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = 'loopmoe-test'


def _importable(name):
  try:
    return importlib.util.find_spec(name) is not None
  except ImportError:
    return False


pytestmark = pytest.mark.skipif(
    gcs_server.executable() is None or
    not all(map(_importable, ('gcsfs', 'google.cloud.storage'))),
    reason=f"needs a local GCS server: {gcs_server.INSTALL} (or pip install -e '.[test]')")


@pytest.fixture(scope='module')
def gcs():
  """The server's environment (its variables set in this process too, for the test's own
  reads and writes)."""
  with gcs_server.local_gcs(BUCKET) as env:
    yield env


def _cmd(script, *args):
  return [sys.executable, f'scripts/{script}.py', *args]


def _run(cmd, env, timeout=600):
  p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-2000:])
  return p.stdout


def _losses(workdir):
  rows = [json.loads(l) for l in storage.read_text(storage.join(workdir, 'metrics.jsonl'))
          .splitlines() if l.strip()]
  return {r['step']: r['loss'] for r in rows}


def test_a_run_on_gs_is_killed_resumed_evaluated_and_exported(gcs, tmp_path):
  rng = np.random.default_rng(0)
  data = f'gs://{BUCKET}/data'
  for split, n in (('train', 40_000), ('val', 8_000)):
    sources.write_token_file(f'{data}/{split}.bin', rng.integers(0, 256, n), 256, 'byte')
  env = dict(os.environ, JAX_PLATFORMS='cpu', **gcs)
  env.pop('JAX_COMPILATION_CACHE_DIR', None)  # the run's own cache, on gs:// too
  flags = ['--config=configs/default.py:smoke', '--config.train.steps=8',
           '--config.train.save_every=2', '--config.train.sample_tokens=0',
           '--config.train.log_every=1', '--config.train.eval_every=4',
           '--config.data.batch_size=4', '--config.data.seq_len=32',
           '--config.run.dispatch=xla', '--config.data.source=tokens',
           f'--config.data.path={data}/train.bin', f'--config.data.val_path={data}/val.bin']
  work = f'gs://{BUCKET}/runs/a'
  local = str(tmp_path / 'local')
  _run(_cmd('train', f'--workdir={local}', *flags), env)  # the reference, on local disk

  proc = subprocess.Popen(_cmd('train', f'--workdir={work}', *flags), cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if storage.exists(f'{work}/checkpoints/2/commit_success.txt'):  # a finished step
      break
    time.sleep(0.3)
  assert proc.poll() is None, proc.communicate()[0][-3000:]
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  assert not storage.exists(f'{work}/summary.json')
  assert not os.path.exists(os.path.join(ROOT, 'gs:'))  # nothing on local disk

  out = _run(_cmd('train', f'--workdir={work}', *flags), env)
  assert 'resuming from step' in out, out[-2000:]
  assert _losses(work) == _losses(local)  # bit for bit, steps 1..8
  assert storage.listdir(f'{work}/compile_cache')
  summary = json.loads(storage.read_text(f'{work}/summary.json'))
  assert summary['steps'] == 8

  ev_gs = _run(_cmd('evaluate', f'--workdir={work}'), env)
  ev_local = _run(_cmd('evaluate', f'--workdir={local}'), env)
  assert ev_gs.strip().splitlines()[-1] == ev_local.strip().splitlines()[-1]

  out = f'gs://{BUCKET}/exports/a'
  text = _run(_cmd('export', f'--workdir={work}', '--format=safetensors', f'--out={out}'), env)
  exported = json.loads(text[text.index('{\n'):])  # after the notes: the summary
  assert exported['step'] == 8 and exported['out'] == out
  local_out = str(tmp_path / 'export')
  _run(_cmd('export', f'--workdir={local}', '--format=safetensors', f'--out={local_out}'), env)
  assert sorted(storage.listdir(out)) == sorted(os.listdir(local_out))
  for name in os.listdir(local_out):
    assert storage.read_bytes(f'{out}/{name}') == open(os.path.join(local_out, name), 'rb').read()


def test_a_second_trainer_on_a_gs_workdir_is_refused_and_a_dead_holder_is_stale(gcs):
  work = f'gs://{BUCKET}/runs/locked'
  with lock.WorkdirLock(work):
    with pytest.raises(lock.WorkdirLocked, match=r'runs/locked is in use by another trainer'):
      with lock.WorkdirLock(work):
        pass
  with lock.WorkdirLock(work):  # released on exit: free again
    pass
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()  # a trainer of this host that was killed: its lease is stale at once
  storage.write_text(f'{work}/.lock', json.dumps({
      'pid': dead.pid, 'host': socket.gethostname(), 'token': 'x', 'expires': time.time() + 600}))
  with lock.WorkdirLock(work):
    pass
  storage.write_text(f'{work}/.lock', json.dumps({  # another host's live lease holds
      'pid': 1, 'host': 'elsewhere', 'token': 'y', 'expires': time.time() + 600}))
  with pytest.raises(lock.WorkdirLocked, match=r'pid 1 on host elsewhere'):
    with lock.WorkdirLock(work):
      pass


def test_bad_gs_paths_are_one_line(gcs):
  from loopmoe_jax.train.trainer import check_workdir
  with pytest.raises(ValueError, match=r"--workdir=gs://no-such-bucket/run: bucket "
                                       r"'no-such-bucket' does not exist"):
    check_workdir('gs://no-such-bucket/run')
  with pytest.raises(ValueError, match=r"--workdir=gs://b/run: 'b' is not a GCS bucket name"):
    check_workdir('gs://b/run')
  with pytest.raises(FileNotFoundError, match=r"token file 'gs://loopmoe-test/none.bin' does not"):
    sources.TokenFile(f'gs://{BUCKET}/none.bin')
  with pytest.raises(ValueError, match=r'unknown URL scheme nosuch://'):
    storage.exists('nosuch://x/y')


def test_a_corpus_prepared_to_gs_reads_as_the_local_one(gcs, tmp_path):
  """scripts/prepare_data.py's preparation with --output=gs://: the shards are made on local
  disk and uploaded whole; the pipeline reads the same tokens from the bucket as from a
  local copy (ranged reads of each shard)."""
  from loopmoe_jax.data import manifest
  from loopmoe_jax.data.prepare import prepare
  url = f'gs://{BUCKET}/corpus'
  info = prepare(['embedded'], url, shard_tokens=1 << 16, val_fraction=0.1, progress=False)
  assert info['manifest'] == f'{url}/manifest.json' and info['shards']['train'] > 1
  prepare(['embedded'], str(tmp_path / 'c'), shard_tokens=1 << 16, val_fraction=0.1,
          progress=False)
  remote = manifest.ManifestTokens(url, 'train')
  local = manifest.ManifestTokens(str(tmp_path / 'c'), 'train')
  assert len(remote) == len(local)
  for start in (0, len(local) // 3, len(local) - 1000):
    np.testing.assert_array_equal(remote.read(start, start + 1000), local.read(start, start + 1000))


def test_a_sweep_on_gs_collects_resumes_and_skips_as_a_local_one(gcs, tmp_path):
  """scripts/sweep.py with --root=gs://: each point's workdir, config and checkpoints and the
  sweep's CSV are on the bucket (nothing on local disk), the losses are the local sweep's,
  a second run skips every finished point, and the CSV reads from the bucket."""
  from loopmoe_jax.scaling import read_csv
  env = dict(os.environ, JAX_PLATFORMS='cpu', **gcs)
  flags = ['--config=configs/loop_laws.py:smoke,core_layers=1', '--sweep=model.num_loops=1,2',
           '--config.train.steps=2', '--config.train.sample_tokens=0',
           '--config.data.batch_size=8', '--config.data.seq_len=16',
           '--config.data.val_batches=1', '--config.run.dispatch=xla']
  local, root = str(tmp_path / 'sweep'), f'gs://{BUCKET}/sweeps/a'
  _run(_cmd('sweep', f'--root={local}', *flags), env)
  out = _run(_cmd('sweep', f'--root={root}', *flags), env)
  assert out.count('running in gs://') == 2, out[-2000:]
  assert not os.path.exists(os.path.join(ROOT, 'gs:'))
  remote, here = read_csv(f'{root}/sweep.csv'), read_csv(f'{local}/sweep.csv')
  np.testing.assert_array_equal(remote['loss'], here['loss'])
  assert storage.exists(f'{root}/num_loops=2/checkpoints/2/commit_success.txt')
  again = _run(_cmd('sweep', f'--root={root}', *flags), env)
  assert again.count('skipped') == 2 and 'running in' not in again, again[-2000:]
