"""A real two-process run (jax.distributed on 127.0.0.1, gloo) on an expert=4 mesh that spans
both processes (2 CPU devices each, so the expert exchange crosses them): each process feeds
only its rows of every global batch; the losses equal a single-process run's and the
checkpoint restores."""
import json
import os
import socket
import subprocess
import sys

import pytest

import numpy as np

from loopmoe_jax.data import pipeline
from loopmoe_jax.experiment import build
from loopmoe_jax.train import checkpoint
from loopmoe_jax.train.trainer import train
from helpers import losses, tiny

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


SPECS = ('data=1,expert=4:sample', 'data=1,dcn_data=2,expert=2')


def test_two_processes_match_one(tmp_path):
  """Two runs, one after the other in the same two processes: expert=4, where the expert
  exchange crosses the processes and the run ends as a user's does (the default
  train.sample_tokens: the end-of-run sample gathers the sharded params on every process,
  process 0 prints it, both exit); dcn_data=2 x expert=2, a hybrid mesh with each process one
  granule (data parallel across them, experts inside). Each equals a one-process run."""
  root, port = tmp_path / 'mp', str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, 'mp_worker.py'), str(p), port,
                             str(root), *SPECS], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for p in range(2)]
  try:
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert outs[0].count('sample:') == 1 and 'sample:' not in outs[1], outs[0][-2000:]
  results = [[json.loads(l[7:]) for l in o.splitlines() if l.startswith('RESULT')] for o in outs]
  assert [[r['run'] for r in rs] for rs in results] == [[0, 1], [0, 1]]
  exp = build(tiny(steps=4))
  it = pipeline.train_iterator(exp.data, exp.model.vocab_size, 5)
  first = np.asarray(next(it)['inputs'])
  half = first.shape[0] // 2
  single = train(tiny(steps=4), str(tmp_path / 'single'))
  one = losses(tmp_path / 'single')
  for run in (0, 1):
    per_process = [rs[run] for rs in results]
    assert [r['process'] for r in per_process] == [0, 1] and per_process[0]['devices'] == 4
    for r in per_process:  # each process fed half of the global batch: its own rows
      fed = np.asarray(r['fed'][0])
      assert fed.shape == (half, first.shape[1])
      np.testing.assert_array_equal(fed, first[r['process'] * half:(r['process'] + 1) * half])
    work = str(root / str(run))
    two = losses(work)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for s in one:
      assert two[s] == pytest.approx(one[s], rel=1e-5), (SPECS[run], s)
    assert per_process[0]['final_window_loss'] == pytest.approx(single['final_window_loss'],
                                                               rel=1e-5)
    _, params, step, _ = checkpoint.load_params(work)
    assert step == 4
