"""A real two-process run (jax.distributed on 127.0.0.1, gloo) on an expert=4 mesh that spans
both processes (2 CPU devices each, so the expert exchange crosses them): each process feeds
only its rows of every global batch; the losses equal a single-process run's and the
checkpoint restores."""
import importlib.util
import json
import os
import socket
import subprocess
import sys

import jax
import pytest

import numpy as np

from loopmoe_jax.train.run import RunDir
from loopmoe_jax.data import pipeline
from loopmoe_jax.experiment import build
from loopmoe_jax.train.trainer import train
from helpers import losses, tiny

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


# per launch (CPU devices per process): mesh spec (and :sample) -> the rows each process feeds,
# its half or all rows (a non-batch axis, tensor, spans the processes: both hold every row)
LAUNCHES = {2: {'data=1,expert=4:sample': 'half', 'data=1,dcn_data=2,expert=2': 'half',
                'data=1,fsdp=2,expert=2': 'half', 'data=1,expert=4:half': 'resumed'},
            1: {'data=1,tensor=2': 'all'}}


def test_two_processes_match_one(tmp_path, capsys):
  """Two launches of two processes (2 CPU devices each, and 1 each), runs one after the other
  in each: expert=4, where the expert
  exchange crosses the processes and the run ends as a user's does (the default
  train.sample_tokens: the end-of-run sample gathers the sharded params on every process,
  process 0 prints it, both exit); dcn_data=2 x expert=2, a hybrid mesh with each process one
  granule (data parallel across them, experts inside); tensor=2 across the processes (each
  process feeds every row: the batch is replicated over tensor); fsdp=2 across them. Each
  equals a one-process run step by step, losses and trained parameters. And a run the two
  processes stopped at step 3 of 6 resumes in this one process (8 devices, its default mesh)
  and ends step-exact with a straight one-process run: the data position and the state are
  the run's, not the process count's."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  procs = {n: [subprocess.Popen([sys.executable, os.path.join(HERE, 'mp_worker.py'), str(p),
                                 str(port), str(tmp_path / f"mp{n}"), str(n), *specs], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for p in range(2)]
           for (n, specs), port in zip(LAUNCHES.items(), (_free_port(), _free_port()))}
  try:
    outs = {n: [p.communicate(timeout=600)[0] for p in ps] for n, ps in procs.items()}
  finally:
    for p in sum(procs.values(), []):
      p.kill()
  checks = []  # (spec, rows split, workdir, the two processes' results)
  for n, specs in LAUNCHES.items():
    for p, out in zip(procs[n], outs[n]):
      assert p.returncode == 0, out[-3000:]
    results = [[json.loads(l[7:]) for l in o.splitlines() if l.startswith('RESULT')]
               for o in outs[n]]
    assert [[r['run'] for r in rs] for rs in results] == [list(range(len(specs)))] * 2
    checks += [(spec, split, tmp_path / f'mp{n}' / str(i), [rs[i] for rs in results])
               for i, (spec, split) in enumerate(specs.items())]
  assert sum(o.count('sample:') for o in outs[2]) == 1 and 'sample:' in outs[2][0]
  exp = build(tiny(steps=4))
  it = pipeline.train_iterator(exp.data, exp.model.vocab_size, 5)
  first = np.asarray(next(it)['inputs'])
  half = first.shape[0] // 2
  single = train(tiny(steps=4), str(tmp_path / 'single'))
  one = losses(tmp_path / 'single')
  one_params = RunDir(str(tmp_path / "single")).load().params
  resumed = [str(work) for spec, split, work, _ in checks if split == 'resumed']
  checks = [c for c in checks if c[1] != 'resumed']
  train(tiny(steps=6), str(tmp_path / 'straight'))
  assert sorted(losses(resumed[0])) == [1, 2, 3]
  capsys.readouterr()
  train(tiny(steps=6), resumed[0])  # steps 4-6, on one process
  assert 'resuming from step 3' in capsys.readouterr().out
  a, b = losses(tmp_path / 'straight'), losses(resumed[0])
  assert sorted(a) == sorted(b) == list(range(1, 7))
  for s in a:
    assert b[s] == pytest.approx(a[s], rel=1e-5), s
  for spec, split, work, per_process in checks:
    assert [r['process'] for r in per_process] == [0, 1]
    for r in per_process:  # each process fed exactly the rows its devices hold
      fed = np.asarray(r['fed'][0])
      p = r['process']
      want = first[p * half:(p + 1) * half] if split == 'half' else first
      np.testing.assert_array_equal(fed, want, err_msg=spec)
    work = str(work)
    two = losses(work)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for s in one:
      assert two[s] == pytest.approx(one[s], rel=1e-5), (spec, s)
    assert per_process[0]['final_window_loss'] == pytest.approx(single['final_window_loss'],
                                                               rel=1e-5)
    loaded = RunDir(work).load()
    params, step = loaded.params, loaded.step
    assert step == 4
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params)):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-3, atol=1e-5, err_msg=spec)


def test_evaluate_and_export_join_a_two_process_run(tmp_path):
  """scripts/evaluate.py, export.py, diagnose.py and lm_eval.py started on two processes
  (--coordinator_address, as a launcher would start them): both join, exit 0, and process 0
  alone prints the result (the one-process result) and writes the export and the scores."""
  work = str(tmp_path / 'run')
  train(tiny(steps=3), work)
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES='1')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  root = os.path.dirname(HERE)

  def both(script, *args):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, f'scripts/{script}.py', *args,
                               f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
                               f'--process_id={p}'], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for p in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
      assert p.returncode == 0, err[-2000:]
    return [o for o, _ in outs]

  alone = subprocess.run([sys.executable, 'scripts/evaluate.py', f'--workdir={work}',
                          '--distributed=off'], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
  assert alone.returncode == 0, alone.stderr[-2000:]
  outs = both('evaluate', f'--workdir={work}')
  result = lambda text: json.loads(text[text.index('{\n'):])  # noqa: E731
  assert result(outs[0]) == result(alone.stdout) and '{' not in outs[1]
  assert outs[0].startswith('process 0 of 2') and outs[1].startswith('process 1 of 2')
  out = str(tmp_path / 'export')
  both('export', f'--workdir={work}', '--format=safetensors', f'--out={out}')
  assert any(n.endswith('.safetensors') for n in os.listdir(out))
  diag = str(tmp_path / 'diag')
  outs = both('diagnose', f'--workdir={work}', f'--out={diag}', '--tokens=512', '--probes=0',
              '--mask_draws=1')
  assert 'wrote' in outs[0] and 'wrote' not in outs[1]
  assert os.path.exists(os.path.join(diag, 'diagnostics.json'))
  if importlib.util.find_spec('lm_eval') is None:
    return  # the lm_eval extra: its adapter's own tests skip alike
  scored = str(tmp_path / 'lm_eval')
  outs = both('lm_eval', f'--workdir={work}', '--tasks=loopmoe_next_line', '--limit=4',
              '--batch_size=4', f'--out={scored}')
  assert 'loopmoe_next_line' in outs[0] and 'loopmoe_next_line' not in outs[1]
  assert json.load(open(os.path.join(scored, 'results.json')))
