"""`benchmark.py adaptive`: what adaptive depth in training costs (train/depth.py, core.Core).

One function per figure (`bench_adaptive` joins them):
- step_time_r8_over_r2 (`step_time_ratio`): the trainer's train step (train/step.py: AdamW,
  load-balance and z-loss; configs/default.py:smoke, one device) compiled for a sampled
  count of 8 passes over the same family's program for 2 (what train.loops_sampler runs:
  `make_train_step` with a static `num_loops`), timed interleaved, the median of
  `repeats` steps after 2 warm-up steps each. `flops_r8_over_r2` is the ratio of the two
  steps' model FLOPs (depth.step_flops_per_token) beside it: a step costs what its count
  costs when the time ratio follows it (a program of the largest count, masked, would give
  about 1).
- compiled_programs (`compiled_programs`): the train programs a `poisson_lognormal` run of
  configs/default.py:smoke compiled (the trainer's summary), train.loops_mean 3 (its
  model.num_loops) clipped to [1, 8]: at most 8, one per count drawn.
  `compiled_programs_steps` says how many steps the run had (200; 20 with --quick), and
  `counts_drawn` the distinct counts `sample_loops` gives for those steps, and
  `compiled_programs_over_counts_drawn` their ratio (target <= 1: one program per count
  drawn, none compiled twice; the clip alone keeps `compiled_programs` <= 8).
- decode_exit_over_full (`decode_exit_ratio`): decode seconds per token at batch 1 under
  per-token early exit (model.exit='kl', early_exit.py) over the same model running every pass
  (model.exit='none'), a random-init model of 8 passes whose looped core dominates the step;
  the KL threshold is bisected (on a full forward over the same tokens) for about half the
  passes on average, and `decode_exit_mean_passes` is what the timed decode actually ran.
  Target <= 0.65.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
from typing import Any

import jax

from loopmoe_jax.bench import _batch, register, time_interleaved
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.decode import decode_step, init_cache, mean_passes
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.job import Job
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.runtime import Runtime
from loopmoe_jax.train import depth
from loopmoe_jax.train.trainer import train


def _smoke(quick: bool):
  """The smoke experiment (configs/default.py:smoke); with `quick` at the quick sizes of
  bench/model.py's train-step figure (its figures are not comparable)."""
  cfg = load_config('configs/default.py:smoke')
  if quick:
    cfg.model.update(d_model=32, num_heads=2, num_kv_heads=1, expert_width=32)
    cfg.run.dispatch = 'xla'
    cfg.data.update(batch_size=2, seq_len=32)
  return cfg, build(cfg)


def step_time_ratio(quick: bool, counts=(2, 8), repeats: int | None = None) -> dict[str, Any]:
  """Median train-step seconds at each of `counts` (one device), their ratio and the model
  FLOPs ratio."""
  _, exp = _smoke(quick)
  dc, mc = exp.data, exp.model
  job = Job.build(exp, jax.devices()[:1])
  placed = jax.device_put(_batch(mc, dc.batch_size, dc.seq_len), job.batch_sh)
  thunks = {}
  for n in counts:
    step = job.train_step(n)
    box = [job.create_state()]

    def run_step(step=step, box=box):  # the state is donated: carry it on
      box[0], metrics = step(box[0], placed)
      return metrics
    thunks[n] = run_step
  secs = time_interleaved(thunks, repeats or (3 if quick else 15))
  flops = {n: depth.step_flops_per_token(mc, dc.seq_len, n) for n in counts}
  lo, hi = counts
  return {f'step_s_r{lo}': secs[lo], f'step_s_r{hi}': secs[hi],
          f'step_time_r{hi}_over_r{lo}': secs[hi] / secs[lo],
          f'flops_r{hi}_over_r{lo}': flops[hi] / flops[lo]}


def compiled_programs(quick: bool, steps: int | None = None) -> dict[str, Any]:
  """The programs a poisson_lognormal run compiled (its summary) over `steps` steps."""
  steps = steps or (20 if quick else 200)
  cfg, _ = _smoke(quick)
  cfg.train.update(steps=steps, loops_sampler='poisson_lognormal', loops_mean=3.0,
                   loops_low=1, loops_high=8, log_every=50, eval_every=steps,
                   save_every=steps, sample_tokens=0, async_save=False)
  cfg.data.val_batches = 1
  with tempfile.TemporaryDirectory() as work, contextlib.redirect_stdout(io.StringIO()) as out:
    summary = train(cfg, os.path.join(work, 'run'))
  exp = build(cfg)
  drawn = {depth.sample_loops(exp.train, exp.model.num_loops, s) for s in range(steps)}
  made = out.getvalue().count('compiling train program')
  return {'compiled_programs': summary['compiled_programs'], 'compiled_programs_steps': steps,
          'compiled_programs_over_counts_drawn': summary['compiled_programs'] / len(drawn),
          'compiled_programs_printed': made, 'counts_drawn': len(drawn),
          'counts': json.dumps(sorted(drawn))}


def decode_exit_ratio(quick: bool, loops: int = 8, tokens: int | None = None,
                      repeats: int | None = None) -> dict[str, Any]:
  """Per-token decode time at batch 1, early exit ('kl', ~loops/2 passes) over every pass."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  tokens = tokens or (16 if quick else 64)
  width = 64 if quick else 256
  cfg = ModelConfig(vocab_size=256, d_model=width, num_heads=4, expert_width=width,
                    prelude_layers=1, prelude_experts=0, core_layers=2, core_experts=4,
                    num_loops=loops, coda_layers=1, coda_experts=0)
  xla = Runtime.of(dispatch='xla')
  toks = jax.random.randint(jax.random.key(1), (1, tokens), 0, cfg.vocab_size)
  params = for_init(LoopedMoE(cfg)).init(jax.random.key(0), toks[:, :4])['params']

  def forward_passes(t):
    c = cfg.replace(exit='kl', exit_threshold=t)
    _, ex = LoopedMoE(c, runtime=xla).apply({'params': params}, toks, early_exit=True)
    return float(ex['exit']['mean_passes'])
  lo, hi = 1e-6, 1e2  # bisect log10(threshold) for about half the passes
  for _ in range(12):  # a larger threshold exits sooner
    mid = float(np.sqrt(lo * hi))
    lo, hi = (lo, mid) if forward_passes(mid) < loops / 2 else (mid, hi)
  threshold = float(np.sqrt(lo * hi))
  runs = {'full': cfg, 'exit': cfg.replace(exit='kl', exit_threshold=threshold)}
  steps = {k: jax.jit(lambda p, ca, x, c=c: decode_step(c, p, ca, x, runtime=xla))
           for k, c in runs.items()}
  caches = {}
  secs = {}
  for k in runs:
    step, best = steps[k], float('inf')
    for _ in range(repeats or (2 if quick else 3)):
      cache = init_cache(runs[k], 1, tokens)
      jax.block_until_ready(step(params, cache, toks[:, :1]))  # compiled, warm
      start = time.perf_counter()
      for i in range(tokens):
        logits, cache = step(params, cache, toks[:, i:i + 1])
      jax.block_until_ready(logits)
      best = min(best, (time.perf_counter() - start) / tokens)
    secs[k], caches[k] = best, cache
  return {'decode_s_per_token_full': secs['full'], 'decode_s_per_token_exit': secs['exit'],
          'decode_exit_over_full': secs['exit'] / secs['full'],
          'decode_exit_threshold': threshold, 'decode_exit_loops': loops,
          'decode_exit_mean_passes': float(mean_passes(caches['exit'])),
          'decode_exit_forward_mean_passes': forward_passes(threshold)}


@register('adaptive')
def bench_adaptive(quick: bool = False) -> dict[str, Any]:
  res: dict[str, Any] = {'quick': quick}
  res.update(step_time_ratio(quick))
  res.update(compiled_programs(quick))
  res.update(decode_exit_ratio(quick))
  print(f"decode_exit_over_full={res['decode_exit_over_full']:.3f} at "
        f"{res['decode_exit_mean_passes']:.2f} of {res['decode_exit_loops']} passes on average")
  return res
