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
from test_train import losses, tiny

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.parametrize('mesh', ['data=1,expert=4', 'data=1,dcn_data=2,expert=2'])
def test_two_processes_match_one(tmp_path, mesh):
  """expert=4: the expert exchange crosses the processes; dcn_data=2 x expert=2: a hybrid mesh
  with each process one granule (data parallel across them, experts inside)."""
  work, port = str(tmp_path / 'mp'), str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, 'mp_worker.py'), str(p), port,
                             work, mesh], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for p in range(2)]
  outs = [p.communicate(timeout=400)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  results = [json.loads(next(l for l in o.splitlines() if l.startswith('RESULT'))[7:])
             for o in outs]
  assert [r['process'] for r in results] == [0, 1] and results[0]['devices'] == 4
  exp = build(tiny(steps=4))
  it = pipeline.train_iterator(exp.data, exp.model.vocab_size, 5)
  first = np.asarray(next(it)['inputs'])
  half = first.shape[0] // 2
  for r in results:  # each process fed half of the global batch: its own rows
    fed = np.asarray(r['fed'][0])
    assert fed.shape == (half, first.shape[1])
    np.testing.assert_array_equal(fed, first[r['process'] * half:(r['process'] + 1) * half])
  single = train(tiny(steps=4), str(tmp_path / 'single'))
  two, one = losses(work), losses(tmp_path / 'single')
  assert sorted(two) == sorted(one) == [1, 2, 3, 4]
  for s in one:
    assert two[s] == pytest.approx(one[s], rel=1e-5)
  assert results[0]['final_window_loss'] == pytest.approx(single['final_window_loss'], rel=1e-5)
  _, params, step, _ = checkpoint.load_params(work)
  assert step == 4
