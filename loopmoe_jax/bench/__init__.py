"""Benchmarks behind `scripts/benchmark.py`: a registry of sub-commands, each a function
`fn(quick: bool) -> dict` of results. Ratios are measured side by side in one process, so they
travel across machines better than absolute times.

One module per sub-command (`MODULES`: bench/model.py, data.py, kernels.py, scale.py,
memory.py, adaptive.py, decode.py, each registering itself with `register`); every target in `TARGETS`,
here.

`--quick` shrinks every size and repeat count for a smoke run (tests/test_benchmark.py).
"""
from __future__ import annotations

import importlib
import json
import math
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from loopmoe_jax.train import compile_cache
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.objective import loss_fn

SUBCOMMANDS: dict[str, Callable[[bool], dict[str, Any]]] = {}
# Sub-command -> the module that registers it (imported by `run` on demand).
MODULES = {name: f'loopmoe_jax.bench.{name}' for name in ('model', 'data', 'kernels', 'scale',
                                                          'memory', 'adaptive', 'decode',
                                                          'export')}
# Every sub-command's targets, in this one table: key -> upper bound (ratios; lower is better),
# or ('>=', lower bound) where higher is better.
TARGETS = {
    # model
    'compile_ratio_L16_over_L1': 1.3,
    'loop_over_unrolled': 1.15,
    'moe_E64_over_E8': 1.5,
    'bias_step_over_plain': 1.03,
    # data
    'checkpoint_save_over_unchecked': 1.15,
    'checkpoint_restore_over_unchecked': 1.15,
    'prepare_tokens_per_s_2w_over_1w': ('>=', 1.7),   # parallel preparation scales
    'manifest_batches_over_steps': ('>=', 20),        # data never stalls training
    # kernels (CPU, then GPU time ratios)
    'cpu_tiled_E64_over_E8': 1.3,
    'cpu_tiled_over_dense': 1.3,
    'gpu_pallas_over_dense_fwd_E64': 1.25,      # >= 0.8 of dense bf16 TFLOP/s
    'gpu_pallas_over_dense_fwd_bwd_E64': 1.25,
    'gpu_pallas_over_xla_fwd_E64': 0.5,         # >= 2x ragged_dot
    'gpu_moe_layer_over_dense_swiglu': 1.3,
    # scale
    'a2a_bytes_over_analytic': 1.1,
    'fsdp8_param_bytes_over_replicated': 0.14,
    'grad_reduce_bytes_over_one_reduction': 1.05,
    'tpu_grad_reduce_bytes_over_one_reduction': 1.05,   # the real compilers (bench/scale.py)
    'cuda_grad_reduce_bytes_over_one_reduction': 1.05,
    # memory
    'attn_temp_T4096_over_T1024': 1.3,
    'loss_temp_over_logits': 0.25,
    'remat_best_temp_over_none': 0.35,
    'remat_best_flops_over_none': 1.2,
    'tpu_remat_best_temp_over_none': 0.35,       # the real compilers (bench/memory.py)
    'tpu_remat_best_flops_over_none': 1.2,
    'cuda_remat_best_temp_over_none': 0.35,
    'cuda_remat_best_flops_over_none': 1.2,
    'cuda_hbm_fraction.attention': 1.0,          # 8 x H200 Foil-2 batch 96 fits
    'tpu_hbm_fraction.none': 1.0,                # v5p-128 Foil-2 batch 128 fits without remat
    # adaptive
    'step_time_r8_over_r2': ('>=', 2.5),          # a step's cost follows the sampled count
    'decode_exit_over_full': 0.65,
    'compiled_programs': 8,
    'compiled_programs_over_counts_drawn': 1.0,   # one program per count drawn
    # decode
    'spec_tokens_per_s_over_plain': ('>=', 1.5),  # loop-draft, batch 1, greedy, same tokens
    'batched_tokens_per_s_over_single': ('>=', 4),  # 8 mixed-length prompts in one batch
    # export
    'looped_bytes_over_params': 1.05,             # hf-looped: each shared weight once
}


def _bound(target) -> tuple[str, float]:
  return target if isinstance(target, tuple) else ('<=', target)
# XLA options that skip LLVM optimisation: param init always compiles with them (it runs once),
# and so does everything in a --quick run (a smoke run; its figures are not comparable).
FAST_COMPILE = {'xla_backend_optimization_level': 0}


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


def as_model(spec) -> nn.Module:
  """A benchmark's model: a LoopedMoE as given, or a ModelConfig's on this machine's runtime."""
  return spec if isinstance(spec, nn.Module) else LoopedMoE(spec)


def _abstract_params(spec, batch):
  model = as_model(spec)
  shapes = jax.eval_shape(lambda: nn.unbox(for_init(model).init(jax.random.key(0),
                                                                batch['inputs'])))
  return model, shapes['params']


def init_params(module: nn.Module, x, cache: dict | None = None):
  """Real init of `module` (a LoopedMoE or an MoE) on a one-token slice of `x`, with the 'xla'
  dispatch (params depend on neither) and compiled without LLVM optimisation (it runs once;
  the RNG kernels otherwise take seconds to optimise). Modules whose param trees have the same
  shapes share one init through `cache` (e.g. loop_impl 'scan' and 'unroll', two backends)."""
  fast = for_init(module)
  init = lambda key, x: nn.unbox(fast.init(key, x))['params']
  key, x = jax.random.key(0), x[:1, :1]
  sig = str(jax.tree.map(lambda a: (a.shape, a.dtype), jax.eval_shape(init, key, x)))
  if cache is None or sig not in cache:
    params = jax.jit(init).lower(key, x).compile(FAST_COMPILE)(key, x)
    if cache is None:
      return params
    cache[sig] = params
  return cache[sig]


def _fresh(step):
  """`step` as a new function object: no trace cache or in-memory compile cache answers its
  compile (compile_seconds turns the persistent compilation cache off around it)."""
  return lambda params, batch: step(params, batch)


def compile_seconds(cfgs: dict[str, Any], batch, repeats: int, options=None):
  """Median lower+compile seconds (wall, and process CPU) of each config's (a ModelConfig, or
  a LoopedMoE with its runtime: `as_model`) train step, with a
  fresh function object every time, compiling the configs in turn (A, B, A, B, ...)."""
  abstract = {name: _abstract_params(cfg, batch) for name, cfg in cfgs.items()}
  wall = {name: [] for name in cfgs}
  cpu = {name: [] for name in cfgs}
  for _ in range(repeats):
    for name, (model, params) in abstract.items():
      step = _fresh(make_train_step(model))
      t0, c0 = time.perf_counter(), time.process_time()
      with compile_cache.off():  # a real compile, and no entry written for a timing
        jax.jit(step).lower(params, batch).compile(options)
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  med = lambda d: {k: float(np.median(v)) for k, v in d.items()}
  return med(wall), med(cpu)


def step_seconds(cfgs: dict[str, Any], batch, repeats: int, options=None,
                 cache: dict | None = None) -> dict[str, float]:
  """Median train-step seconds of each config (a ModelConfig or a LoopedMoE: `as_model`),
  timed interleaved on the same batch."""
  thunks = {}
  for name, cfg in cfgs.items():
    model = as_model(cfg)
    params = init_params(model, batch['inputs'], cache)
    step = jax.jit(make_train_step(model)).lower(params, batch).compile(options)
    thunks[name] = (lambda step=step, params=params: step(params, batch))
  return time_interleaved(thunks, repeats)


# MoE layer alone --------------------------------------------------------------------------------

# Backends whose cost grows linearly with E on CPU (masked dense work).
def verdicts(results: dict[str, Any]) -> dict[str, bool]:
  """PASS (True) / FAIL per TARGETS key present in `results` (None or non-finite fails)."""
  def ok(v, target):
    op, bound = _bound(target)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      return False
    return v >= bound if op == '>=' else v <= bound
  return {k: ok(results[k], t) for k, t in TARGETS.items() if k in results}


def format_table(results: dict[str, Any]) -> str:
  passed = verdicts(results)
  rows = []
  for key, value in results.items():
    if isinstance(value, dict):
      continue
    text = f'{value:.4g}' if isinstance(value, float) else (
        'skipped' if value is None else str(value))
    op, bound = _bound(TARGETS.get(key, 0.0))
    verdict = f'{op} {bound}  {"PASS" if passed[key] else "FAIL"}' if key in passed else ''
    rows.append((key, text, verdict))
  width = max(len(r[0]) for r in rows)
  return '\n'.join(f'{k:<{width}}  {v:>10}  {t}'.rstrip() for k, v, t in rows)


def run(name: str, quick: bool = False, json_path: str | None = None) -> dict[str, Any]:
  """Runs sub-command `name`, prints a table and the JSON (with a 'pass' entry per target),
  and writes the JSON to `json_path` when given."""
  if name not in MODULES:
    raise ValueError(f'unknown benchmark {name!r}; known: {sorted(MODULES)}')
  importlib.import_module(MODULES[name])
  results = SUBCOMMANDS[name](quick)
  results['pass'] = verdicts(results)
  print(format_table(results))
  text = json.dumps(results, indent=1)
  print(text)
  if json_path:
    with open(json_path, 'w') as f:
      f.write(text + '\n')
  return results
