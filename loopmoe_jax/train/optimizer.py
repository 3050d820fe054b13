"""AdamW with global-norm clipping and warmup-stable-decay or cosine schedules."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from loopmoe_jax.config.train import TrainConfig


def wsd_schedule(peak: float, total: int, warmup: int, decay_fraction: float,
                 shape: str = '1-sqrt', final_fraction: float = 0.05):
  """Linear warmup to `peak`, constant, then a decay over the last `decay_fraction` of
  `total` steps to `final_fraction * peak` with shape 1-sqrt, linear or cosine."""
  decay_steps = int(round(decay_fraction * total))
  decay_start = total - decay_steps

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum(1.0, (step + 1) / max(warmup, 1)) if warmup else peak
    frac = jnp.clip((step - decay_start) / max(decay_steps, 1), 0.0, 1.0)
    if shape == '1-sqrt':
      g = 1.0 - jnp.sqrt(frac)
    elif shape == 'linear':
      g = 1.0 - frac
    else:
      g = 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    decayed = peak * (final_fraction + (1.0 - final_fraction) * g)
    return jnp.where(step < decay_start, warm, jnp.minimum(warm, decayed))

  return schedule


def make_schedule(cfg: TrainConfig):
  if cfg.schedule == 'wsd':
    return wsd_schedule(cfg.lr, cfg.total_steps, cfg.warmup, cfg.decay_fraction,
                        cfg.decay_shape, cfg.final_lr_fraction)
  if cfg.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup, 1), cfg.total_steps,
                                              cfg.lr * cfg.final_lr_fraction)
  return optax.constant_schedule(cfg.lr)


def decay_mask(params):
  """Weight decay on matrices only: norms (and any bias) are 1-D and excluded."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


# TrainConfig fields that touch neither the optimizer nor its schedule. Every other field (one
# added later too) is part of the key under which equal settings share one optimizer.
NOT_OPTIMIZER = ('seed', 'lb_coef', 'z_coef', 'bias_rate', 'log_every', 'eval_every',
                 'save_every', 'keep', 'keep_every', 'keep_steps', 'async_save', 'routing_every',
                 'final_window', 'peak_flops', 'sample_tokens', 'sample_prompt', 'init_from',
                 'init_step', 'microbatches', 'profile_steps')


class Optimizer(optax.GradientTransformationExtraArgs):
  """optax's (init, update) of a TrainConfig, equal to (and hashed like) any other made from
  the same optimizer settings (`settings`): a program kept under it (train/step.py) is found
  again whichever object made it."""

  def __eq__(self, other):
    return isinstance(other, Optimizer) and self.settings == other.settings

  def __hash__(self):
    return hash(self.settings)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The learning rate at a step (`make_schedule` of `settings`); equal and hashed by them."""
  settings: TrainConfig

  def __call__(self, step):
    return _schedule_fn(self.settings)(step)


@functools.lru_cache(maxsize=16)
def _schedule_fn(cfg: TrainConfig):
  return make_schedule(cfg)


def make_optimizer(cfg: TrainConfig):
  """(tx, schedule), compared and hashed by the optimizer settings of `cfg` (every field but
  NOT_OPTIMIZER's; so the programs built on them, train/step.py, are built once per process
  for equal settings). Equal settings also give the same two objects while they are cached."""
  defaults = TrainConfig()
  return _optimizer(dataclasses.replace(
      cfg, steps=cfg.total_steps, schedule_steps=0,
      **{f: getattr(defaults, f) for f in NOT_OPTIMIZER}))


@functools.lru_cache(maxsize=16)
def _optimizer(cfg: TrainConfig):
  schedule = Schedule(cfg)
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  tx = optax.chain(optax.clip_by_global_norm(cfg.clip), adamw) if cfg.clip > 0 else adamw
  tx = Optimizer(tx.init, tx.update)
  tx.settings = cfg
  return tx, schedule
