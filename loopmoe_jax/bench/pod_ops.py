"""The `data` benchmark's pod-operation figures (scripts/benchmark.py data):

preempt_agreement_step_overhead: seconds per train step of the main job (the default config,
one device) with the per-step stop agreement (train/preempt.py's Vote, its program forced on:
one all-reduce of two int32 dispatched per step, read a step later) over without; median of
`trials` alternating timings of `steps` steps each (target <= 1.02).

gcs_tokens_per_s_over_local: tokens/s of the training data reader (pipeline.Windows over a
token file; random windows as the shuffled batches read them) with the file on a local
GCS-protocol server (gcp-storage-emulator on 127.0.0.1, ranged reads) over the same file on
local disk; `gcs_data_wait_fraction`: the trainer's own time waiting for data over its wall
time (goodput's time_data_s over the run's time, compile excluded) in a main-job run reading
its tokens from that server (target <= 0.02). Skipped (None) without the emulator.

restart_compile_over_cold: the XLA compile of the main job's train program when a restart
finds it in the run's compile cache (WORKDIR/compile_cache) over the cold compile;
restart_ready_over_cold: the same for the whole time until the program is ready (tracing and
lowering included, which no cache skips). From the trainer's own 'train program 1 ready in'
lines of two launches of scripts/train.py (target <= 0.2).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from loopmoe_jax import DEFAULT_CONFIG, gcs_server, sharding, storage
from loopmoe_jax.data import pipeline, sources
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.job import Job
from loopmoe_jax.train import preempt, step as steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main_job_step(exp, host_batch):
  """(train step, its state, the batch on the device, the mesh) of `exp` on this machine's
  first device: the train step the data benchmarks time."""
  job = Job.build(exp._replace(mesh=sharding.MeshConfig(data=1)), jax.devices()[:1])
  return (job.train_step(), job.create_state(0), steps.put_batch(host_batch, job.batch_sh),
          job.mesh)


def preempt_overhead(n_steps: int, trials: int) -> dict:
  exp = build(load_config(DEFAULT_CONFIG))
  train_step, state, batch, mesh = main_job_step(
      exp, next(pipeline.train_iterator(exp.data, exp.model.vocab_size, 2)))
  vote = preempt.Vote(mesh, collective=True)
  state, m = train_step(state, batch)
  vote(0)
  jax.block_until_ready(m)
  times = {'with': [], 'without': []}
  for _ in range(trials):
    for kind in ('without', 'with'):
      t = time.perf_counter()
      for _ in range(n_steps):
        state, m = train_step(state, batch)
        float(m['loss'])  # the trainer reads each step's metrics (a step late; here at once)
        if kind == 'with':
          vote(0)
      times[kind].append((time.perf_counter() - t) / n_steps)
  med = {k: float(np.median(v)) for k, v in times.items()}
  return {'preempt_step_s_with': med['with'], 'preempt_step_s_without': med['without'],
          'preempt_agreement_step_overhead': med['with'] / med['without']}


def _read_rate(dc, path: str, n_windows: int) -> float:
  cfg = pipeline.DataConfig(**{**dc.__dict__, 'source': 'tokens', 'path': path, 'val_path': ''})
  windows = pipeline.Windows(cfg, 'train', 1 << 20)
  ids = np.random.default_rng(0).integers(0, windows.num, n_windows)
  windows(int(ids[0]))
  t = time.perf_counter()
  for i in ids:
    windows(int(i))
  return n_windows * dc.seq_len / (time.perf_counter() - t)


def gcs_reads(n_windows: int, n_steps: int) -> dict:
  if gcs_server.executable() is None:
    return {'gcs_tokens_per_s_over_local': None, 'gcs_data_wait_fraction': None,
            'gcs_note': gcs_server.INSTALL}
  with gcs_server.local_gcs('loopmoe-bench') as env:
    exp = build(load_config(DEFAULT_CONFIG))
    dc = exp.data
    tokens = {split: np.asarray(pipeline.open_source(dc, split).tokens)
              for split in ('train', 'validation')}
    vocab = pipeline.open_source(dc, 'train').vocab_size
    with tempfile.TemporaryDirectory() as tmp:
      local = os.path.join(tmp, 'train.bin')
      sources.write_token_file(local, tokens['train'], vocab, dc.tokenizer)
      remote = 'gs://loopmoe-bench/data'
      sources.write_token_file(f'{remote}/train.bin', tokens['train'], vocab, dc.tokenizer)
      sources.write_token_file(f'{remote}/val.bin', tokens['validation'], vocab, dc.tokenizer)
      local_rate = _read_rate(dc, local, n_windows)
      gcs_rate = _read_rate(dc, f'{remote}/train.bin', n_windows)
      work = os.path.join(tmp, 'run')
      _launch(['--workdir=' + work, f'--config.train.steps={n_steps}',
               f'--config.train.log_every={n_steps}', '--config.train.sample_tokens=0',
               '--config.data.source=tokens', f'--config.data.path={remote}/train.bin',
               f'--config.data.val_path={remote}/val.bin'], env)
      row = [json.loads(l) for l in open(os.path.join(work, 'metrics.jsonl'))][-1]
  run_s = _wall(row) - row['time_compile_s'] - row['time_restore_s']
  return {'gcs_tokens_per_s': gcs_rate, 'local_tokens_per_s': local_rate,
          'gcs_tokens_per_s_over_local': gcs_rate / local_rate,
          'gcs_data_wait_fraction': row['time_data_s'] / max(run_s, 1e-9)}


def _wall(row: dict) -> float:
  """The run's wall time so far, from goodput and the time spent outside steps."""
  spent = sum(v for k, v in row.items() if k.startswith('time_') and k.endswith('_s'))
  return spent / max(1e-9, 1 - row['goodput'])


def _launch(args, env_extra=None) -> str:
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  env.update(env_extra or {}, JAX_PLATFORMS='cpu')
  p = subprocess.run([sys.executable, 'scripts/train.py', *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=1800)
  if p.returncode:
    raise RuntimeError(f'scripts/train.py {" ".join(args)} failed: {p.stderr[-1500:]}')
  return p.stdout


def _ready(out: str) -> dict:
  line = next(l for l in out.splitlines() if l.startswith('train program 1 ready in'))
  total = float(re.search(r'ready in ([\d.]+) s', line).group(1))
  return {'ready': total, **{k: float(v) for k, v in
                             re.findall(r'(trace|lower|compile) ([\d.]+) s', line)}}


def restart_compile(n_steps: int) -> dict:
  """Two launches of the main job in one workdir: the second resumes after the first's last
  checkpoint is removed (as a kill would leave it) and finds its program in the cache."""
  with tempfile.TemporaryDirectory() as tmp:
    args = [f'--workdir={tmp}', f'--config.train.steps={n_steps}',
            f'--config.train.save_every={max(1, n_steps // 2)}', '--config.train.sample_tokens=0']
    cold = _ready(_launch(args))
    storage.rmtree(os.path.join(tmp, 'checkpoints', str(n_steps)))
    os.remove(os.path.join(tmp, 'summary.json'))
    warm = _ready(_launch(args))
  return {'restart_compile_s': warm['compile'], 'cold_compile_s': cold['compile'],
          'restart_compile_over_cold': warm['compile'] / cold['compile'],
          'restart_ready_s': warm['ready'], 'cold_ready_s': cold['ready'],
          'restart_ready_over_cold': warm['ready'] / cold['ready']}


def pod_ops(quick: bool) -> dict:
  res = preempt_overhead(3 if quick else 10, 1 if quick else 3)
  res.update(gcs_reads(50 if quick else 400, 4 if quick else 20))
  res.update(restart_compile(2 if quick else 4))
  return res
