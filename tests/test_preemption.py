"""Preemption of a two-process run (jax.distributed on 127.0.0.1, 2 CPU devices per process,
the real CLI): a SIGTERM to one process, or to both two seconds apart, saves the same step on
both, both exit with SIGTERM's status (143, the one that did not catch it too), and the
resumed runs continue bit for bit and exit 0 (train/preempt.py)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from helpers import losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 150


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _launch(work, port):
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES='2')
  return [subprocess.Popen(
      [sys.executable, 'scripts/train.py', f'--workdir={work}', '--config=configs/default.py:smoke',
       f'--config.train.steps={STEPS}', '--config.train.log_every=1',
       '--config.train.save_every=100000', '--config.train.sample_tokens=0',
       '--config.train.eval_every=100000', '--config.data.batch_size=4',
       '--config.data.seq_len=32', '--config.run.dispatch=xla',
       f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', f'--process_id={p}'],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for p in range(2)]


def _logged(work) -> int:
  path = os.path.join(work, 'metrics.jsonl')
  return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def _saved_step(out: str) -> int:
  lines = [l for l in out.splitlines() if ': saved step ' in l]
  assert len(lines) == 1, out[-3000:]
  return int(lines[0].split(': saved step ')[1].split()[0])


def test_a_signal_to_one_or_both_apart_saves_the_same_step_on_both(tmp_path):
  works = {'one': str(tmp_path / 'one'), 'apart': str(tmp_path / 'apart')}
  runs = {k: _launch(w, _free_port()) for k, w in works.items()}
  try:
    deadline = time.time() + 300
    while time.time() < deadline and not all(_logged(w) >= 3 for w in works.values()):
      assert all(p.poll() is None for ps in runs.values() for p in ps), 'a process ended early'
      time.sleep(0.2)
    seen = {k: _logged(w) for k, w in works.items()}
    t0 = time.time()
    runs['one'][1].send_signal(signal.SIGTERM)  # process 1 only
    runs['apart'][0].send_signal(signal.SIGTERM)
    time.sleep(2)
    if runs['apart'][1].poll() is None:
      runs['apart'][1].send_signal(signal.SIGTERM)
    outs = {k: [p.communicate(timeout=120)[0] for p in ps] for k, ps in runs.items()}
    waited = time.time() - t0
  finally:
    for p in sum(runs.values(), []):
      p.kill()
  saved = {}
  for k, ps in runs.items():
    for p, out in zip(ps, outs[k]):
      assert p.returncode == 143, (k, p.returncode, out[-3000:])
    steps = [_saved_step(out) for out in outs[k]]
    assert steps[0] == steps[1], (k, steps)  # the same step on both processes
    assert seen[k] <= steps[0] <= seen[k] + 6, (k, seen[k], steps)  # within a step or two
    saved[k] = steps[0]
    summary = json.load(open(os.path.join(works[k], 'summary.json')))
    assert summary['stopped_by'] == 'SIGTERM' and summary['steps'] == steps[0]
  assert 'caught by another process' in outs['one'][0]
  assert waited < 30 + 2, waited
  # both resume to the end: each run's losses equal the other's, which was not stopped there
  runs = {k: _launch(w, _free_port()) for k, w in works.items()}
  try:
    outs = {k: [p.communicate(timeout=300)[0] for p in ps] for k, ps in runs.items()}
  finally:
    for p in sum(runs.values(), []):
      p.kill()
  for k, ps in runs.items():
    for p, out in zip(ps, outs[k]):
      assert p.returncode == 0 and f'resuming from step {saved[k]}' in out, out[-3000:]
  one, apart = losses(works['one']), losses(works['apart'])
  assert sorted(one) == sorted(apart) == list(range(1, STEPS + 1))
  assert one == apart, [s for s in one if one[s] != apart[s]][:5]


def test_the_vote_is_every_process_flags_maximum_read_a_step_later():
  """Vote's program over a mesh of every device (as a multi-process run uses it): a signal
  posted at one step is the decision the next step returns; a timed save comes from the
  clock after save_every_minutes, and restarts after a save."""
  import jax
  from loopmoe_jax import sharding
  from loopmoe_jax.train import preempt
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1), jax.devices())
  vote = preempt.Vote(mesh, collective=True)
  assert vote(0) == preempt.Decision()  # nothing posted before
  assert vote(signal.SIGTERM) == preempt.Decision()  # the previous step's flags: none
  assert vote(0) == preempt.Decision(stop='SIGTERM')
  assert vote(signal.SIGINT) == preempt.Decision()
  assert vote(0).stop == 'SIGINT'
  now = [0.0]
  timed = preempt.Vote(mesh, save_every_minutes=1, clock=lambda: now[0])
  assert not timed(0).timed_save
  now[0] = 61.0
  assert timed(0) == preempt.Decision(timed_save=True)  # one process: at once
  timed.saved()
  assert not timed(0).timed_save
  # over several processes the clock's flag is read a step late: a save in between voids it
  now[0] = 0.0
  timed = preempt.Vote(mesh, save_every_minutes=1, collective=True, clock=lambda: now[0])
  now[0] = 61.0
  assert timed(0) == preempt.Decision()  # posted: due
  assert timed(0).timed_save  # read: save (and the flag posted now is due too)
  timed.saved()
  now[0] = 62.0
  assert not timed(0).timed_save  # the flag posted before the save is void
  assert not timed(0).timed_save
