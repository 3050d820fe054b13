"""`data` benchmark: the Grain pipeline's throughput over the train step's consumption.

data_over_step_throughput = tokens/s the pipeline delivers (iterating batches, nothing else)
/ tokens/s the jitted train step of the same config consumes (target >= 10: data is never the
bottleneck). Also reports both rates and the default run's tokens/s.
"""
from __future__ import annotations

import time

import jax

from loopmoe_jax.bench import register
from loopmoe_jax.cli import DEFAULT_CONFIG
from loopmoe_jax.data import pipeline
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax import sharding
from loopmoe_jax.train import step as steps
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
  return {'data_tokens_per_s': data_tps, 'step_tokens_per_s': step_tps,
          'data_over_step_throughput': data_tps / step_tps}
