"""`data` benchmark: the Grain pipeline's throughput over the train step's consumption.

data_over_step_throughput = tokens/s the pipeline delivers (iterating batches, nothing else)
/ tokens/s the jitted train step of the same config consumes (target >= 10: data is never the
bottleneck). Also reports both rates and the default run's tokens/s.

checkpoint_save_over_unchecked / checkpoint_restore_over_unchecked: seconds to save (written,
synchronously) and restore a train state of `checkpoint_mib` float32 MiB with the checksums
(train/checkpoint.py) over the same Orbax save / restore without them (median of 3; target
<= 1.15).
"""
from __future__ import annotations

import time

import jax

import os
import tempfile

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from loopmoe_jax.bench import register
from loopmoe_jax import DEFAULT_CONFIG
from loopmoe_jax.data import pipeline
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax import sharding
from loopmoe_jax.train import checkpoint, step as steps
from loopmoe_jax.train.optimizer import make_optimizer


def _default_experiment():
  return build(load_config(DEFAULT_CONFIG))


@register('data')
def bench_data(quick: bool = False):
  exp = _default_experiment()
  mc, tc, dc = exp.model, exp.train, exp.data
  n_steps, n_batches = (3, 50) if quick else (10, 400)
  tokens_per_batch = dc.batch_size * dc.seq_len

  it = pipeline.train_iterator(dc, mc.vocab_size, n_batches + n_steps + 10)
  next(it)  # corpus load and first batch
  t = time.perf_counter()
  for _ in range(n_batches):
    next(it)
  data_tps = n_batches * tokens_per_batch / (time.perf_counter() - t)

  model = LoopedMoE(mc)
  tx, schedule = make_optimizer(tc)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1])
  state_sh, batch_sh = steps.shardings(mesh, model, tx, dc.seq_len)
  state = steps.create_state(model, tx, 0, dc.seq_len, state_sh)
  train_step = steps.make_train_step(model, tx, schedule, tc.lb_coef, tc.z_coef, state_sh,
                                     batch_sh)
  batch = steps.put_batch(next(it), batch_sh)
  state, m = train_step(state, batch)
  jax.block_until_ready(m)
  t = time.perf_counter()
  for _ in range(n_steps):
    state, m = train_step(state, batch)
  jax.block_until_ready(m)
  step_tps = n_steps * tokens_per_batch / (time.perf_counter() - t)
  res = {'data_tokens_per_s': data_tps, 'step_tokens_per_s': step_tps,
         'data_over_step_throughput': data_tps / step_tps}
  res.update(checkpoint_seconds(16 if quick else 256, 1 if quick else 3))
  return res


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
