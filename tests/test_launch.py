"""Launching and restarting: which launcher started a process (loopmoe_jax/distributed.py), the
--distributed modes' errors, and the run's persistent compilation cache (a restart loads its
train program instead of compiling it again)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from loopmoe_jax import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_launchers_are_detected_from_their_environment():
  no_tpu = lambda: False  # noqa: E731
  detect = lambda env, tpu=no_tpu, **kw: distributed.detect(env=env, has_tpu=tpu, **kw)  # noqa: E731
  assert detect({}) is None
  assert detect({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '4', 'SLURM_PROCID': '2'}) == \
      distributed.Launch('slurm', 4)
  assert not detect({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '1', 'SLURM_PROCID': '0'}).several
  assert detect({'SLURM_JOB_ID': '7'}) is None  # an allocation, not an srun step
  assert detect({'OMPI_COMM_WORLD_SIZE': '8'}) == distributed.Launch('openmpi', 8)
  assert detect({'TPU_WORKER_HOSTNAMES': 'a,b,c,d'}, lambda: True) == \
      distributed.Launch('gke_tpu', 4)
  tpu_vm = detect({}, lambda: True)
  assert tpu_vm.launcher == 'tpu_vm' and tpu_vm.several  # jax asks the metadata server
  explicit = detect({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '4', 'SLURM_PROCID': '2'},
                    coordinator_address='h:1', num_processes=2, process_id=1)
  assert explicit.launcher == 'explicit' and explicit.processes == 2  # the flags win


def test_distributed_modes_refuse_contradictions_in_one_line():
  with pytest.raises(ValueError, match=r'--distributed=off with --coordinator_address=h:1'):
    distributed.initialize('off', 'h:1', 2, 0)
  with pytest.raises(ValueError, match=r'--coordinator_address=h:1 needs --process_id'):
    distributed.initialize('auto', 'h:1', 2, None)
  with pytest.raises(ValueError, match=r'--distributed=maybe: must be one of auto, on, off'):
    distributed.initialize('maybe')
  if distributed.detect() is None:  # this machine is no cluster
    assert distributed.initialize('auto') is None
    with pytest.raises(ValueError, match=r'--distributed=on: no multi-process launcher found'):
      distributed.initialize('on')


def _ready(out: str) -> dict:
  line = next(l for l in out.splitlines() if l.startswith('train program 1 ready in'))
  phases = dict(re.findall(r'(trace|lower|compile) ([\d.]+) s', line))
  return {'line': line, **{k: float(v) for k, v in phases.items()}}


def test_a_restart_loads_its_train_program_from_the_run_compile_cache(tmp_path):
  """A run in WORK writes its programs to WORK/compile_cache; restarted from its step-2
  checkpoint (its later steps removed, as a kill would leave it), the train program comes from
  that cache: its compile phase is a fraction of the cold one."""
  work = str(tmp_path / 'run')
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  env['JAX_PLATFORMS'] = 'cpu'
  cmd = [sys.executable, 'scripts/train.py', f'--workdir={work}',
         '--config=configs/default.py:smoke', '--config.train.steps=4',
         '--config.train.save_every=2', '--config.train.sample_tokens=0',
         '--config.data.batch_size=4', '--config.data.seq_len=32', '--config.run.dispatch=xla']

  def launch():
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout

  cold = _ready(launch())
  assert os.listdir(os.path.join(work, 'compile_cache'))
  shutil.rmtree(os.path.join(work, 'checkpoints', '4'))
  os.remove(os.path.join(work, 'summary.json'))
  out = launch()
  assert 'resuming from step 2' in out
  warm = _ready(out)
  assert 'from the compile cache' in warm['line'] and 'from the compile cache' not in cold['line']
  print(f"restart compile over cold: {warm['compile'] / cold['compile']:.3f} "
        f"({warm['compile']:.2f} s / {cold['compile']:.2f} s)")
  assert warm['compile'] <= 0.5 * cold['compile'], (cold, warm)


def test_a_run_started_on_some_hosts_only_stops_with_one_line():
  """Process 0 of 2 started alone: after --distributed_timeout it exits with one line naming
  the coordinator and the counts (JAX's own timeout would abort with a C++ stack)."""
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  p = subprocess.run([sys.executable, 'scripts/train.py', '--workdir=/nonexistent-never-made',
                      f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
                      '--process_id=0', '--distributed_timeout=3'],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == 1
  errors = [l for l in p.stderr.splitlines() if l.startswith('error:')]
  assert errors == [f'error: distributed start (explicit): process 0 of 2 waited 3 s at '
                    f'127.0.0.1:{port} and not every process came; start the same command on '
                    'every host'], p.stderr[-2000:]
  assert 'Check failure' not in p.stderr


def test_a_lost_peer_is_one_line_naming_the_last_saved_checkpoint(tmp_path):
  """A collective that fails on a lost process (gloo's closed connection) is recognised, and
  its message names the newest complete checkpoint step of the run directory (a step still
  being written, Orbax's tmp directory, is not one); other errors are not a lost peer. Under
  the CLI, PeerLost is one line and exit status 1 at once: no atexit handler runs (jax's
  shutdown barrier would wait for the lost process, then abort)."""
  gloo = RuntimeError('UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/'
                      'pair.cc:547] Connection closed by peer [127.0.0.1]:56710\nmore')
  assert distributed.lost_peer(gloo) and not distributed.lost_peer(ValueError('bad config'))
  work = tmp_path / 'run'
  assert 'no checkpoint was saved' in distributed.lost_message(gloo, str(work))
  for name in ('20', '40', '60.orbax-checkpoint-tmp-3'):
    (work / 'checkpoints' / name).mkdir(parents=True)
  line = distributed.lost_message(gloo, str(work))
  assert line == ('the run lost a process (UNKNOWN: Gloo all-reduce failed: [external/gloo/'
                  'gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:56710);'
                  f' the last saved checkpoint is step 40 in {work}/checkpoints; start the '
                  'same command on every host to resume')
  script = tmp_path / 'lost.py'
  script.write_text(
      'import atexit\n'
      'from loopmoe_jax import cli, distributed\n'
      'atexit.register(lambda: print("atexit ran", flush=True))\n'
      'def main(argv):\n'
      '  raise distributed.PeerLost("the run lost a process (x); no run directory")\n'
      'cli.run(main)\n')
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 1, proc.stderr
  assert 'atexit ran' not in proc.stdout
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert errors == ['error: the run lost a process (x); no run directory'], proc.stderr
