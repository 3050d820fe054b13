"""The `model` benchmark (`scripts/benchmark.py model`).

Measures (targets in bench.TARGETS; lower is better):
- compile_ratio_L16_over_L1: lower+compile time of a jitted train step (value_and_grad of
  `objective.loss_fn` + SGD update) at num_loops=16 over num_loops=1 (median of fresh compiles,
  wall clock; `compile_cpu_ratio_*` uses process CPU time, steadier on a shared machine).
  `compile_ratio_L16_over_L2` shows whether compile grows with L once there is a loop at all
  (the lowered step has the scan's while loops at every L; XLA deletes them at trip count 1).
- loop_over_unrolled: step time of the looped core (tied attention, C layers x L passes,
  loop_impl='scan') over the unrolled model with independent weights and the same executed
  depth (core_layers=D*L, num_loops=1). loop_unroll_impl_over_unrolled: the same with
  loop_impl='unroll'. Models are timed interleaved (A, B, A, B, ...), median per model.
- moe_E64_over_E8: the MoE layer alone (dispatch 'tiled'), forward+backward, 64 over 8 experts
  at the same width and top-k (same active FLOPs). The same ratio for 'xla' and 'reference'
  is reported for information, on `moe_info_tokens` tokens (both do dense work that grows with E
  on CPU); None when the E=64 call is predicted to be too slow.
- bias_step_over_plain: the trainer's own jitted train step (AdamW, load-balance and z-loss,
  on a one-device mesh) of the README's main job (configs/default.py) with
  model.router_bias='shared' over the same step without a bias (the bias routes the step and
  moves against the step's loads). Timed interleaved, median per model.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from loopmoe_jax.bench import (FAST_COMPILE, _batch, _block, compile_seconds, init_params,
                               register, step_seconds, time_interleaved)
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.job import Job
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.moe import MoE
from loopmoe_jax.runtime import Runtime


DENSE_IN_E = ('xla', 'reference')


def moe_fwd_bwd(cfg: ModelConfig, num_experts: int, num_tokens: int, options=None,
                cache: dict | None = None, *, runtime: Runtime):
  """A compiled fwd+bwd thunk of the MoE layer on [1, num_tokens, d_model] inputs."""
  moe = MoE(cfg, num_experts, runtime=runtime)
  x = jax.random.normal(jax.random.key(1), (1, num_tokens, cfg.d_model), jnp.float32)
  params = init_params(moe, x, cache)

  def loss(p, x):
    y, stats = moe.apply({'params': p}, x)
    return jnp.mean(y * y) + 0.01 * stats['load_balance'] + 0.001 * stats['z_loss']

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile(options)
  return lambda: fn(params, x)


def moe_ratio(cfg: ModelConfig, backend: str, num_tokens: int, small: int, large: int,
              repeats: int, max_seconds: float = float('inf'), options=None,
              cache: dict | None = None, tile: int = 128):
  """Seconds of one fwd+bwd at `small` and `large` experts and their ratio. When the large-E
  call is predicted (from one small-E call; linear in E for DENSE_IN_E backends) to take more
  than `max_seconds`, the large one is skipped (None)."""
  rt = Runtime.of(dispatch=backend, dispatch_tile=tile)
  thunks = {small: moe_fwd_bwd(cfg, small, num_tokens, options, cache, runtime=rt)}
  t0 = time.perf_counter()
  _block(thunks[small]())
  predicted = (time.perf_counter() - t0) * (large / small if backend in DENSE_IN_E else 1.0)
  if predicted > max_seconds:
    t = time_interleaved(thunks, repeats, warmup=0)[small]
    return dict(small=t, large=None, ratio=None)
  thunks[large] = moe_fwd_bwd(cfg, large, num_tokens, options, cache, runtime=rt)
  secs = time_interleaved(thunks, repeats, warmup=0 if backend in DENSE_IN_E else 1)
  return dict(small=secs[small], large=secs[large], ratio=secs[large] / secs[small])


# The `model` sub-command ------------------------------------------------------------------------

def _cfg(quick: bool, **kw) -> ModelConfig:
  sizes = dict(vocab_size=64, d_model=32, num_heads=2, expert_width=32) if quick else dict(
      vocab_size=256, d_model=128, num_heads=4, expert_width=256)
  return ModelConfig(**{**sizes, 'top_k': 2, **kw})


@register('model')
def bench_model(quick: bool = False) -> dict[str, Any]:
  res: dict[str, Any] = {'quick': quick, 'backend': jax.default_backend()}
  opts = FAST_COMPILE if quick else None
  cache = {}  # params shared by configs with the same param shapes
  # 1. Train-step compile time at L=16 over L=1 (L=2 too: the loop itself costs once).
  edge = 0 if quick else 1
  base = _cfg(quick, prelude_layers=edge, prelude_experts=8, core_layers=1 if quick else 2,
              core_experts=8, coda_layers=edge, coda_experts=8)
  loops = (1, 16) if quick else (1, 2, 16)
  wall, cpu = compile_seconds({l: base.replace(num_loops=l) for l in loops},
                              _batch(base, 2, 32), 1 if quick else 3, opts)
  res.update({f'compile_s_L{l}': wall[l] for l in loops})
  res['compile_ratio_L16_over_L1'] = wall[16] / wall[1]
  res['compile_cpu_ratio_L16_over_L1'] = cpu[16] / cpu[1]
  if 2 in loops:
    res['compile_ratio_L16_over_L2'] = wall[16] / wall[2]

  # 2. Looped core (C layers x L passes, shared weights) vs the unrolled model of the same
  # executed depth with its own weights (D*L layers, 1 pass). No prelude or coda.
  d, l = (1, 2) if quick else (2, 4)
  looped = _cfg(quick, prelude_layers=0, coda_layers=0, core_layers=d, core_experts=8,
                num_loops=l, tie_attention=True)
  cfgs = {'scan': looped, 'unroll': LoopedMoE(looped, runtime=Runtime.of(loop_impl='unroll')),
          'unrolled': looped.replace(core_layers=d * l, num_loops=1)}
  secs = step_seconds(cfgs, _batch(looped, 2 if quick else 4, 32 if quick else 128),
                      3 if quick else 10, opts, cache)
  res.update({f'step_s_{k}': v for k, v in secs.items()})
  res['loop_over_unrolled'] = secs['scan'] / secs['unrolled']
  res['loop_unroll_impl_over_unrolled'] = secs['unroll'] / secs['unrolled']

  # 3. The MoE layer alone, E=64 over E=8 at the same width and top-k (same active FLOPs).
  # 'xla' and 'reference' grow with E on CPU: informational, on fewer tokens.
  moe_cfg = ModelConfig(d_model=64 if quick else 256, num_heads=4,
                        expert_width=128 if quick else 512, top_k=2)
  tokens, info_tokens = (512, 256) if quick else (8192, 512)
  r = moe_ratio(moe_cfg, 'tiled', tokens, 8, 64, 3 if quick else 5, options=opts, cache=cache,
                tile=64)
  res.update(moe_tokens=tokens, moe_s_tiled_E8=r['small'], moe_s_tiled_E64=r['large'],
             moe_E64_over_E8=r['ratio'], moe_info_tokens=info_tokens)
  for backend in ('xla',) if quick else ('xla', 'reference'):
    r = moe_ratio(moe_cfg, backend, info_tokens, 8, 64, 1 if quick else 2, max_seconds=10.0,
                  options=opts, cache=cache, tile=64)
    res.update({f'moe_s_{backend}_E8': r['small'], f'moe_s_{backend}_E64': r['large'],
                f'moe_{backend}_E64_over_E8': r['ratio']})

  # 4. The router-bias update's cost in the trainer's train step of the README's main job.
  secs = bias_step_seconds(quick, 3 if quick else 15)
  res.update(step_s_plain=secs['none'], step_s_bias=secs['shared'],
             bias_step_over_plain=secs['shared'] / secs['none'])
  return res


def bias_step_seconds(quick: bool, repeats: int) -> dict[str, float]:
  """Median seconds of the trainer's train step (train/step.py) on configs/default.py
  ('smoke' when quick) with model.router_bias 'none' and 'shared', timed interleaved."""
  exp = build(load_config('configs/default.py' + (':smoke' if quick else '')))
  if quick:  # a smoke run: the main job's structure at the quick sizes, less its coda, with
    # the dispatch that traces fastest (its figures are not comparable anyway)
    exp = exp._replace(
        model=exp.model.replace(d_model=32, num_heads=2, num_kv_heads=1, expert_width=32,
                                coda_layers=0),
        run=dataclasses.replace(exp.run, dispatch='xla'),
        data=dataclasses.replace(exp.data, batch_size=2, seq_len=32))
  batch = _batch(exp.model, exp.data.batch_size, exp.data.seq_len)
  thunks = {}
  for layout in ('none', 'shared'):
    job = Job.build(exp._replace(model=exp.model.replace(router_bias=layout)),
                    jax.devices()[:1])
    step = job.train_step()
    placed = jax.device_put(batch, job.batch_sh)
    box = [job.create_state()]

    def run_step(step=step, box=box, placed=placed):  # the state is donated: carry it on
      box[0], metrics = step(box[0], placed)
      return metrics
    thunks[layout] = run_step
  return time_interleaved(thunks, repeats)


# Reporting --------------------------------------------------------------------------------------
