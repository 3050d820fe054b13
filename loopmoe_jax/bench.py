"""Benchmarks behind `scripts/benchmark.py`: a registry of sub-commands, each a function
`fn(quick: bool) -> dict` of results. Ratios are measured side by side in one process, so they
travel across machines better than absolute times.

`model` measures (targets in TARGETS; lower is better):
- compile_ratio_L16_over_L1: lower+compile time of a jitted train step (value_and_grad of
  `objective.loss_fn` + SGD update) at num_loops=16 over num_loops=1 (median of fresh compiles).
- loop_over_unrolled: step time of the looped core (tied attention, D layers x L passes,
  loop_impl='scan') over the unrolled model with independent weights and the same executed
  depth (core_layers=D*L, num_loops=1). loop_unroll_impl_over_unrolled: the same with
  loop_impl='unroll'. Models are timed interleaved (A, B, A, B, ...), median per model.
- moe_E64_over_E8: the MoE layer alone (dispatch 'sorted'), forward+backward, 64 over 8 experts
  at the same width and top-k (same active FLOPs). The same ratio for 'xla' and 'reference'
  (None when skipped) is reported for information.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.moe import MoE
from loopmoe_jax.objective import loss_fn

SUBCOMMANDS: dict[str, Callable[[bool], dict[str, Any]]] = {}
TARGETS = {  # key -> upper bound
    'compile_ratio_L16_over_L1': 1.3,
    'loop_over_unrolled': 1.15,
    'moe_E64_over_E8': 1.5,
}


def register(name: str):
  def wrap(fn):
    SUBCOMMANDS[name] = fn
    return fn
  return wrap


# Timing helpers ---------------------------------------------------------------------------------

def _block(tree):
  return jax.tree.map(lambda a: a.block_until_ready(), tree)


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2):
  """Median seconds per call of each thunk, calling them in turn (A, B, A, B, ...)."""
  for _ in range(warmup):
    for fn in fns.values():
      _block(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      _block(fn())
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(t)) for name, t in times.items()}


# Model: train step ------------------------------------------------------------------------------

def make_train_step(model: nn.Module, lr: float = 1e-2):
  """A fresh train step function: value_and_grad of loss_fn, then SGD on the params."""
  def step(params, batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model, batch)
    new_params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return new_params, metrics
  return step


def _batch(cfg: ModelConfig, batch: int, seq: int, seed: int = 0):
  tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, cfg.vocab_size)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}


def _abstract_params(cfg: ModelConfig, batch):
  model = LoopedMoE(cfg)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), batch['inputs'])))
  return model, shapes['params']


def _init_params(cfg: ModelConfig, batch):
  model = LoopedMoE(cfg)
  return model, nn.unbox(jax.jit(model.init)(jax.random.key(0), batch['inputs']))['params']


def compile_seconds(cfg: ModelConfig, batch, repeats: int) -> float:
  """Median lower+compile seconds of the train step, with a fresh function every time."""
  model, params = _abstract_params(cfg, batch)
  times = []
  for _ in range(repeats):
    step = make_train_step(model)  # a new function object: no trace or compile cache hit
    t0 = time.perf_counter()
    jax.jit(step).lower(params, batch).compile()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def step_seconds(cfgs: dict[str, ModelConfig], batch, repeats: int) -> dict[str, float]:
  """Median train-step seconds of each config, timed interleaved on the same batch."""
  thunks = {}
  for name, cfg in cfgs.items():
    model, params = _init_params(cfg, batch)
    step = jax.jit(make_train_step(model))
    thunks[name] = (lambda step=step, params=params: step(params, batch))
  return time_interleaved(thunks, repeats)


# MoE layer alone --------------------------------------------------------------------------------

def moe_fwd_bwd(cfg: ModelConfig, num_experts: int, num_tokens: int):
  """A jitted fwd+bwd thunk of the MoE layer on [1, num_tokens, d_model] inputs."""
  moe = MoE(cfg, num_experts)
  x = jax.random.normal(jax.random.key(1), (1, num_tokens, cfg.d_model), jnp.float32)
  params = nn.unbox(moe.init(jax.random.key(0), x))['params']

  def loss(p, x):
    y, stats = moe.apply({'params': p}, x)
    return jnp.mean(y * y) + 0.01 * stats['load_balance'] + 0.001 * stats['z_loss']

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  return lambda: fn(params, x)


def moe_ratios(cfg: ModelConfig, num_tokens: int, small: int, large: int, repeats: int,
               backends=('sorted', 'xla', 'reference'), max_seconds: float = 5.0):
  """Per backend: seconds at `small` and `large` experts and their ratio. A backend whose
  large-E step is predicted (from the small one, linear in E) to exceed `max_seconds` is
  skipped at large E (ratio None)."""
  out = {}
  for backend in backends:
    c = cfg.replace(dispatch=backend)
    thunks = {small: moe_fwd_bwd(c, small, num_tokens)}
    t_small = time_interleaved(thunks, 1, warmup=1)[small]
    predicted = t_small * (large / small if backend == 'reference' else 1.0)
    if predicted > max_seconds:
      secs = time_interleaved(thunks, repeats, warmup=0)
      out[backend] = dict(small=secs[small], large=None, ratio=None)
      continue
    thunks[large] = moe_fwd_bwd(c, large, num_tokens)
    secs = time_interleaved(thunks, repeats, warmup=1)
    out[backend] = dict(small=secs[small], large=secs[large], ratio=secs[large] / secs[small])
  return out


# The `model` sub-command ------------------------------------------------------------------------

@register('model')
def bench_model(quick: bool = False) -> dict[str, Any]:
  res: dict[str, Any] = {'quick': quick, 'backend': jax.default_backend()}
  # 1. Compile time, L=16 over L=1.
  base = ModelConfig(vocab_size=256, d_model=64 if quick else 128, num_heads=4,
                     expert_width=128 if quick else 256, top_k=2, prelude_layers=1,
                     prelude_experts=8, core_layers=2, core_experts=8, coda_layers=1,
                     coda_experts=8, num_loops=1)
  batch = _batch(base, 2, 32)
  n = 1 if quick else 3
  c1 = compile_seconds(base.replace(num_loops=1), batch, n)
  c16 = compile_seconds(base.replace(num_loops=16), batch, n)
  res.update(compile_s_L1=c1, compile_s_L16=c16, compile_ratio_L16_over_L1=c16 / c1)

  # 2. Looped (D x L, shared weights) vs unrolled (D*L layers, own weights), same depth.
  d, l = 2, 4
  looped = ModelConfig(vocab_size=256, d_model=64 if quick else 128, num_heads=4,
                       expert_width=128 if quick else 256, top_k=2, prelude_layers=0,
                       coda_layers=0, core_layers=d, core_experts=8, num_loops=l,
                       tie_attention=True, loop_impl='scan')
  cfgs = {'scan': looped, 'unroll': looped.replace(loop_impl='unroll'),
          'unrolled': looped.replace(core_layers=d * l, num_loops=1)}
  batch = _batch(looped, 2 if quick else 8, 32 if quick else 128)
  secs = step_seconds(cfgs, batch, 3 if quick else 10)
  res.update({f'step_s_{k}': v for k, v in secs.items()})
  res['loop_over_unrolled'] = secs['scan'] / secs['unrolled']
  res['loop_unroll_impl_over_unrolled'] = secs['unroll'] / secs['unrolled']

  # 3. MoE layer alone, E=64 over E=8 at the same active FLOPs.
  moe_cfg = ModelConfig(d_model=64 if quick else 256, num_heads=4,
                        expert_width=128 if quick else 512, top_k=2, dispatch_tile=64)
  tokens = 512 if quick else 8192
  moe = moe_ratios(moe_cfg, tokens, 8, 64, 2 if quick else 5,
                   backends=('sorted', 'xla') if quick else ('sorted', 'xla', 'reference'),
                   max_seconds=2.0 if quick else 5.0)
  for backend, r in moe.items():
    res[f'moe_s_{backend}_E8'] = r['small']
    res[f'moe_s_{backend}_E64'] = r['large']
    res['moe_E64_over_E8' if backend == 'sorted' else f'moe_{backend}_E64_over_E8'] = r['ratio']
  return res


# Reporting --------------------------------------------------------------------------------------

def format_table(results: dict[str, Any]) -> str:
  rows = []
  for key, value in results.items():
    if isinstance(value, float):
      text = f'{value:.4g}'
    else:
      text = 'skipped' if value is None else str(value)
    target = TARGETS.get(key)
    verdict = ''
    if target is not None:
      ok = isinstance(value, float) and math.isfinite(value) and value <= target
      verdict = f'<= {target}  {"PASS" if ok else "FAIL"}'
    rows.append((key, text, verdict))
  width = max(len(r[0]) for r in rows)
  return '\n'.join(f'{k:<{width}}  {v:>10}  {t}'.rstrip() for k, v, t in rows)


def run(name: str, quick: bool = False, json_path: str | None = None) -> dict[str, Any]:
  """Runs sub-command `name`, prints a table and the JSON, optionally writes the JSON."""
  if name not in SUBCOMMANDS:
    raise ValueError(f'unknown benchmark {name!r}; known: {sorted(SUBCOMMANDS)}')
  results = SUBCOMMANDS[name](quick)
  print(format_table(results))
  text = json.dumps(results, indent=1)
  print(text)
  if json_path:
    with open(json_path, 'w') as f:
      f.write(text + '\n')
  return results
