"""`data` benchmark: the Grain pipeline's throughput over the train step's consumption.

data_over_step_throughput = tokens/s the pipeline delivers (iterating batches, nothing else)
/ tokens/s the jitted train step of the same config consumes (target >= 10: data is never the
bottleneck). Also reports both rates and the default run's tokens/s.

checkpoint_save_over_unchecked / checkpoint_restore_over_unchecked: seconds to save (written,
synchronously) and restore a train state of `checkpoint_mib` float32 MiB with the checksums
(train/checkpoint.py) over the same Orbax save / restore without them (median of 3; target
<= 1.15).

prepare_tokens_per_s_2w_over_1w: tokens/s of scripts/prepare_data.py's preparation
(data/prepare.py, whole runs: pool start-up, reading, tokenizing, writing shards) with 2 worker
processes over 1 (target >= 1.7). The input is the embedded corpus repeated `prepare_repeats`
times (2; 1 with --quick) so that the workers' start-up (a spawned interpreter each) is paid
over seconds of work, tokenized by a BPE of 2048 trained on the corpus's first 200 documents
(the byte tokenizer costs next to nothing, so it would time the reading and writing alone);
median of `prepare_trials` alternating runs. Needs 2 idle cores: `prepare_load_average_1m` and
the workers' CPU seconds (`prepare_worker_cpu_s_*`, about equal when the work is split and not
repeated) tell a busy machine from poor scaling.

manifest_batches_per_s / main_job_steps_per_s = manifest_batches_over_steps: batches/s of the
Grain pipeline over the embedded corpus prepared as a sharded manifest (data.source=manifest,
shards of 2**21 tokens) over the default config's (the README main job's) train steps/s
(target >= 20: data never stalls training).

Pod operations (bench/pod_ops.py): preempt_agreement_step_overhead, gcs_tokens_per_s_over_local,
gcs_data_wait_fraction, restart_compile_over_cold, restart_ready_over_cold.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import tempfile
import time

import jax

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from loopmoe_jax.bench import register
from loopmoe_jax.bench.pod_ops import main_job_step, pod_ops
from loopmoe_jax import DEFAULT_CONFIG
from loopmoe_jax.data import corpus, pipeline
from loopmoe_jax.data.prepare import prepare
from loopmoe_jax.data.tokenizers import train_bpe
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.train import checkpoint


def _default_experiment():
  return build(load_config(DEFAULT_CONFIG))


@register('data')
def bench_data(quick: bool = False):
  exp = _default_experiment()
  mc, dc = exp.model, exp.data
  n_steps, n_batches = (3, 50) if quick else (10, 400)
  tokens_per_batch = dc.batch_size * dc.seq_len

  it = pipeline.train_iterator(dc, mc.vocab_size, n_batches + n_steps + 10)
  next(it)  # corpus load and first batch
  t = time.perf_counter()
  for _ in range(n_batches):
    next(it)
  data_tps = n_batches * tokens_per_batch / (time.perf_counter() - t)

  train_step, state, batch, _ = main_job_step(exp, next(it))
  state, m = train_step(state, batch)
  jax.block_until_ready(m)
  t = time.perf_counter()
  for _ in range(n_steps):
    state, m = train_step(state, batch)
  jax.block_until_ready(m)
  step_tps = n_steps * tokens_per_batch / (time.perf_counter() - t)
  res = {'data_tokens_per_s': data_tps, 'step_tokens_per_s': step_tps,
         'data_over_step_throughput': data_tps / step_tps}
  res.update(manifest_throughput(dc, mc.vocab_size, n_batches, step_tps / tokens_per_batch))
  res.update(prepare_scaling(1 if quick else 2, 1 if quick else 3))
  res.update(checkpoint_seconds(16 if quick else 256, 1 if quick else 3))
  res.update(pod_ops(quick))  # preemption agreement, gs:// reads, restart compile (pod_ops.py)
  return res


def manifest_throughput(dc, model_vocab: int, n_batches: int, steps_per_s: float) -> dict:
  """Batches/s of the pipeline over the embedded corpus prepared as a sharded manifest, beside
  the main job's train steps/s."""
  with tempfile.TemporaryDirectory() as tmp:
    info = prepare(['embedded'], tmp, tokenizer=dc.tokenizer, shard_tokens=1 << 21)
    cfg = dataclasses.replace(dc, source='manifest', path=tmp, val_path='')
    it = pipeline.train_iterator(cfg, model_vocab, n_batches + 1)
    next(it)
    t = time.perf_counter()
    for _ in range(n_batches):
      next(it)
    batches_per_s = n_batches / (time.perf_counter() - t)
  return {'manifest_shards': info['shards']['train'], 'manifest_batches_per_s': batches_per_s,
          'main_job_steps_per_s': steps_per_s,
          'manifest_batches_over_steps': batches_per_s / steps_per_s}


def prepare_scaling(repeats: int, trials: int) -> dict:
  """Tokens/s of preparing the embedded corpus (`repeats` times over, a BPE of 2048) with 1 and
  2 worker processes, alternating, median of `trials`."""
  def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
  times, cpu = {1: [], 2: []}, {1: [], 2: []}
  load = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as tmp:
    bpe = os.path.join(tmp, 'bpe.json')
    train_bpe([text for _, text in corpus.documents()[:200]], 2048, bpe)
    for trial in range(trials):
      for workers in (1, 2):
        out = os.path.join(tmp, f'w{workers}-{trial}')
        c, t = children_cpu_s(), time.perf_counter()
        info = prepare(['embedded'] * repeats, out, tokenizer=bpe, workers=workers,
                       shard_tokens=1 << 22)
        times[workers].append(time.perf_counter() - t)
        cpu[workers].append(children_cpu_s() - c)
  tps = {w: info['num_tokens'] / float(np.median(t)) for w, t in times.items()}
  # the workers' CPU seconds: about equal when the work is split, not repeated; with the
  # load average (other processes on the machine) they tell contention from poor scaling
  return {'prepare_repeats': repeats, 'prepare_trials': trials,
          'prepare_tokens': info['num_tokens'], 'prepare_load_average_1m': load,
          'prepare_worker_cpu_s_1w': float(np.median(cpu[1])),
          'prepare_worker_cpu_s_2w': float(np.median(cpu[2])),
          'prepare_tokens_per_s_1w': tps[1], 'prepare_tokens_per_s_2w': tps[2],
          'prepare_tokens_per_s_2w_over_1w': tps[2] / tps[1]}


def checkpoint_seconds(mib: int, repeats: int) -> dict:
  """Save and restore times of a train-state-like tree of `mib` float32 MiB, with and without
  the checksums, timed alternately."""
  rng = np.random.default_rng(0)
  n = mib * 2**20 // 4 // 4
  state = {'params': {f'w{i}': jnp.asarray(rng.standard_normal(n), jnp.float32)
                      for i in range(4)}, 'step': jnp.int32(1)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  times = {k: [] for k in ('save_checked', 'save_plain', 'restore_checked', 'restore_plain')}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(repeats):
      for kind in ('checked', 'plain'):
        mngr = checkpoint.manager(os.path.join(tmp, f'{kind}{r}'), async_save=False)
        t = time.perf_counter()
        if kind == 'checked':
          checkpoint.save(mngr, 1, state, {}, '{}')
        else:
          mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=ocp.args.JsonSave({}),
                                               config=ocp.args.JsonSave({})))
        mngr.wait_until_finished()
        times[f'save_{kind}'].append(time.perf_counter() - t)
        t = time.perf_counter()
        if kind == 'checked':
          jax.block_until_ready(checkpoint.restore_latest(mngr, abstract)[1])
        else:
          jax.block_until_ready(mngr.restore(1, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
              config=ocp.args.JsonRestore()))['state'])
        times[f'restore_{kind}'].append(time.perf_counter() - t)
        mngr.close()
  med = {k: float(np.median(v)) for k, v in times.items()}
  return {'checkpoint_mib': mib, **{f'checkpoint_{k}_s': v for k, v in med.items()},
          'checkpoint_save_over_unchecked': med['save_checked'] / med['save_plain'],
          'checkpoint_restore_over_unchecked': med['restore_checked'] / med['restore_plain']}
