"""Adaptive depth in training: the core's pass count drawn per step, and a run's programs.

Huginn (Geiping et al. 2025, "Scaling up test-time compute with latent reasoning") trains a
recurrent-depth model with the recurrence count drawn per step from a Poisson-log-normal
and backpropagates through the last k iterations only, so one model learns to run at many
depths and the training cost follows the drawn count. Here `sample_loops` draws the count
of each train step (train.loops_sampler: fixed, uniform or poisson_lognormal) from
(train.seed, step) alone, so a resumed run draws what an uninterrupted one does;
`train_step_at` gives the train step of each count drawn (the count is static, so a step of 2
passes runs a 2-pass program, not the largest one masked; the run's Job keeps them); with
train.backprop_loops = k the gradient flows through the last min(k, r) of a step's r passes
(core.Core): a short draw keeps every pass's gradient (Huginn's rule), so k may exceed
train.loops_low.
"""
from __future__ import annotations

import numpy as np

from loopmoe_jax import accounting

# Huginn's spread of the log-normal rate
LOGNORMAL_SIGMA = 0.5
# Mixed into the seed of every step's draw, so it is a stream of its own among those seeded
# by train.seed
LOOPS_STREAM = 0x4C4F4F50


def poisson_lognormal(rng: np.random.Generator, mean: float,
                      sigma: float = LOGNORMAL_SIGMA) -> int:
  """Huginn's pass count (Geiping et al. 2025): tau ~ Normal(log(mean) -
  sigma^2/2, sigma), r = Poisson(exp(tau)) + 1. The rate exp(tau) has mean `mean`, so E[r] =
  mean + 1 and Var[r] = mean + mean^2 (exp(sigma^2) - 1): mostly near the mean, with a long
  right tail. Not clipped."""
  tau = rng.normal(np.log(mean) - sigma ** 2 / 2, sigma)
  return int(rng.poisson(np.exp(tau))) + 1


def sample_loops(tc, trained: int, step: int) -> int:
  """The core's pass count of train step `step` (0-based: the state's step before it), a
  pure function of (train.seed, step). `tc`: the TrainConfig; `trained`: model.num_loops.
  'fixed': `trained`; 'uniform': an integer uniform over [loops_low, loops_high];
  'poisson_lognormal': `poisson_lognormal` with train.loops_mean, clipped to [loops_low,
  loops_high] (loops_high 0: `trained`). The clip bounds the programs a run compiles (one per
  count drawn: at most high - low + 1) and the worst step's time and memory; it moves the
  tails' mass onto the bounds (the mean count is below loops_mean + 1 when loops_high cuts
  into the right tail)."""
  if not tc.sampled:
    return trained
  low, high = tc.loops_bounds(trained)
  rng = np.random.default_rng([LOOPS_STREAM, tc.seed & (2 ** 64 - 1), step])
  if tc.loops_sampler == 'uniform':
    return int(rng.integers(low, high + 1))
  return int(np.clip(poisson_lognormal(rng, tc.loops_mean), low, high))


def backprop(tc, num_loops: int) -> int:
  """The passes with gradient of a step of `num_loops` passes, as the model takes them: 0
  (every pass) unless train.backprop_loops leaves some out."""
  return tc.backprop_loops if tc.backprop_loops < num_loops else 0


def train_step_at(job, step: int):
  """(pass count, train program) of train step `step` of `job` (job.Job, which keeps one
  program per count drawn)."""
  tc = job.exp.train
  n = sample_loops(tc, job.exp.model.num_loops, step)
  return n, job.train_step(n if tc.sampled else None, backprop(tc, n))


def describe(tc, trained: int) -> str:
  """The sampler and truncated backprop for the trainer's header line ('' for neither)."""
  text = ''
  if tc.sampled:
    low, high = tc.loops_bounds(trained)
    mean = f' mean {tc.loops_mean:g},' if tc.loops_sampler == 'poisson_lognormal' else ''
    text = f'; passes {tc.loops_sampler}{mean} in [{low}, {high}]'
  if tc.backprop_loops:
    text += f'; backprop through the last {tc.backprop_loops} passes'
  return text


def step_flops_per_token(mc, seq_len: int, num_loops: int, backprop_loops: int = 0) -> float:
  """Model FLOPs per token of a train step of `num_loops` passes (accounting.py's forward
  FLOPs F): the forward F(n) and a backward of twice the forward of what has gradient, the
  prelude, coda, head and the last k passes: F(n) + 2 F(k) (k = n without truncation); gate
  training (model.exit='gate') adds 3 x its readouts' forward (accounting's
  gate_train_flops_per_token, which refuses truncation)."""
  k = backprop_loops if 0 < backprop_loops < num_loops else num_loops
  # the router bias changes no FLOP (and a per-pass one needs 2 passes to be a config)
  count = lambda n: accounting.count(mc.replace(num_loops=n, router_bias='none'), seq_len)
  gate = 3 * count(num_loops)['gate_train_flops_per_token']
  return count(num_loops)['flops_per_token'] + 2 * count(k)['flops_per_token'] + gate
