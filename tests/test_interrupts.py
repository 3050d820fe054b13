"""Signals and exit statuses of the real scripts (subprocesses of scripts/train.py and
scripts/sweep.py on the smoke configs): a Ctrl-C in the training loop saves and exits 130; one
while the first step compiles exits at once (130, nothing saved); a second one while a
stopped run saves exits at once; an interrupted sweep exits 130 and says what it wrote."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from loopmoe_jax.train.run import RunDir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ['--config=configs/default.py:smoke', '--config.train.sample_tokens=0',
         '--config.run.dispatch=xla', '--config.data.batch_size=4', '--config.data.seq_len=32',
         '--config.train.log_every=1', '--config.train.save_every=100000',
         '--config.train.eval_every=100000']


class Script:
  """A script started in its own process group (as a terminal's foreground job), its stdout
  and stderr lines collected as they come."""

  def __init__(self, args, env=None):
    self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, text=True,
                                 env=env or dict(os.environ, JAX_PLATFORMS='cpu'),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
    self.out, self.err = [], []
    self.readers = [threading.Thread(target=lambda f=f, to=to: to.extend(f), daemon=True)
                    for f, to in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
    for r in self.readers:
      r.start()

  def wait_for(self, ready, timeout=300):
    deadline = time.time() + timeout
    while not ready() and self.proc.poll() is None and time.time() < deadline:
      time.sleep(0.02)
    assert ready(), ('not ready before the script ended or timed out', self.text())

  def ctrl_c(self, signum=signal.SIGINT):
    """The signal to the process group, as Ctrl-C in a terminal sends it."""
    os.killpg(self.proc.pid, signum)

  def finish(self, timeout=120) -> int:
    try:
      self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        os.killpg(self.proc.pid, signal.SIGKILL)
    for r in self.readers:
      r.join(timeout=10)
    return self.proc.returncode

  def text(self) -> str:
    return ''.join(self.out)[-3000:] + '\n--- stderr ---\n' + ''.join(self.err)[-3000:]


def _rows(path) -> int:
  return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def test_ctrl_c_in_the_loop_saves_its_step_and_exits_130(tmp_path):
  """The stop line names the step and the status; the step is saved and restorable, the
  summary says SIGINT; the status (130) stops `train.py ... && next`."""
  work = str(tmp_path / 'run')
  run = Script(['scripts/train.py', f'--workdir={work}', *SMOKE,
                '--config.train.steps=100000'])
  try:
    run.wait_for(lambda: _rows(os.path.join(work, 'metrics.jsonl')) >= 3)
    run.ctrl_c()
  finally:
    status = run.finish()
  assert status == 130, run.text()
  stops = [l.strip() for l in run.out if ': saved step ' in l]
  assert len(stops) == 1 and stops[0].startswith('SIGINT: saved step '), run.text()
  assert stops[0].endswith('and stopped (exit 130; re-run to resume)'), stops
  step = int(stops[0].split()[3])
  assert step >= 3 and RunDir(work).load().step == step
  summary = json.load(open(os.path.join(work, 'summary.json')))
  assert summary['stopped_by'] == 'SIGINT' and summary['steps'] == step


def test_ctrl_c_while_the_first_step_compiles_exits_at_once(tmp_path):
  """After the run's first line ('model: ...') its first train step traces and compiles (the
  main thread in native code for seconds): a Ctrl-C then exits with one line and 130 without
  waiting for the compile, running a step or saving one. The run is frozen (SIGSTOP) when
  that line appears, so the signal lands before the program is ready; a run past it is tried
  again."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)  # the run's own (empty) cache: a real compile
  for attempt in range(3):
    work = str(tmp_path / f'run{attempt}')
    run = Script(['scripts/train.py', f'--workdir={work}', *SMOKE,
                  '--config.train.steps=50'], env)
    try:
      run.wait_for(lambda: any(l.startswith('model:') for l in run.out))
      run.proc.send_signal(signal.SIGSTOP)
      time.sleep(0.2)  # what it printed before it stopped reaches the readers
      compiled = any('train program 1 ready' in l for l in run.out)
      run.ctrl_c()
      run.proc.send_signal(signal.SIGCONT)
    finally:
      status = run.finish()
    if not compiled:
      break
  assert not compiled, 'the first step compiled before the signal three times'
  assert status == 130, run.text()
  assert run.err[-1].startswith('interrupted (SIGINT): stopped'), run.text()
  assert not any('train program 1 ready' in l or 'saved step' in l for l in run.out), run.text()
  assert not os.path.exists(os.path.join(work, 'summary.json'))
  ckpts = os.path.join(work, 'checkpoints')
  assert not [s for s in os.listdir(ckpts) if s.isdigit()] if os.path.isdir(ckpts) else True


def test_a_second_ctrl_c_while_the_run_saves_exits_at_once(tmp_path):
  """The first Ctrl-C asks the loop to save and stop; a second one a moment later (before
  that save and the summary are written) exits at once with one line and 130."""
  work = str(tmp_path / 'run')
  run = Script(['scripts/train.py', f'--workdir={work}', *SMOKE,
                '--config.train.steps=100000'])
  try:
    run.wait_for(lambda: _rows(os.path.join(work, 'metrics.jsonl')) >= 3)
    run.ctrl_c()
    time.sleep(0.05)
    run.ctrl_c()
  finally:
    status = run.finish()
  assert status == 130, run.text()
  assert run.err[-1].startswith('interrupted (SIGINT)'), run.text()
  assert not os.path.exists(os.path.join(work, 'summary.json')), run.text()


@pytest.mark.slow
def test_an_interrupted_sweep_exits_130_and_says_no_csv_was_written(tmp_path):
  """Ctrl-C while a sweep's first point trains (in its child process): the point saves and
  stops, the sweep writes no CSV (no point finished), says so in its last line and exits 130,
  not 0 after a 'csv:' line for a file never written. Re-running resumes the point."""
  root = str(tmp_path / 'sweep')
  run = Script(['scripts/sweep.py', '--config=configs/loop_laws.py:smoke', f'--root={root}',
                '--sweep', 'model.num_loops=1,2', '--config.train.steps=100000',
                '--config.train.log_every=1', '--config.train.sample_tokens=0',
                '--config.run.dispatch=xla', '--config.data.batch_size=4',
                '--config.data.seq_len=32', '--config.train.save_every=100000',
                '--config.train.eval_every=100000'])
  point = os.path.join(root, 'num_loops=1')
  try:
    run.wait_for(lambda: _rows(os.path.join(point, 'metrics.jsonl')) >= 2)
    run.ctrl_c()
  finally:
    status = run.finish()
  assert status == 130, run.text()
  last = [l.strip() for l in run.out if l.strip()][-1]
  assert last.startswith('SIGINT: the sweep stopped in point num_loops=1'), run.text()
  assert 'no point has finished: no sweep.csv written (exit 130)' in last, last
  assert not any(l.startswith('csv:') for l in run.out), run.text()
  assert not os.path.exists(os.path.join(root, 'sweep.csv'))
  assert RunDir(point).load().step >= 2
  assert not os.path.exists(os.path.join(root, 'num_loops=2'))  # never started
