"""AdamW with global-norm clipping and warmup-stable-decay or cosine schedules."""
from __future__ import annotations

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


def make_optimizer(cfg: TrainConfig):
  """(tx, schedule): AdamW on `make_schedule(cfg)`, after global-norm clipping at cfg.clip
  (none at 0), weight decay on matrices only."""
  schedule = make_schedule(cfg)
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  tx = optax.chain(optax.clip_by_global_norm(cfg.clip), adamw) if cfg.clip > 0 else adamw
  return tx, schedule
