"""The training objective: LM loss plus weighted aux losses; the LM loss is reported alone."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from loopmoe_jax.model import variables


def lm_loss(logits_BTV, targets_BT, mask_BT=None):
  """Mean next-token negative log-likelihood (float32) over unmasked positions."""
  logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  nll_BT = -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
  if mask_BT is None:
    return jnp.mean(nll_BT)
  mask = mask_BT.astype(jnp.float32)
  return jnp.sum(nll_BT * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def loss_fn(params, model, batch, lb_coef: float = 0.01, z_coef: float = 0.001,
            num_loops: int | None = None, router_bias=None):
  """Returns (total objective, metrics). batch: 'inputs', 'targets' [B, T], optional 'mask'.
  With `router_bias` (model.router_bias; not differentiated) the metrics also hold the expert
  loads per segment under 'load' ({segment: [D, E] or the core's [L, D, E]})."""
  if router_bias is not None:
    router_bias = jax.lax.stop_gradient(router_bias)
  logits, extras = model.apply(variables(params, router_bias=router_bias), batch['inputs'],
                               num_loops=num_loops)
  lm = lm_loss(logits, batch['targets'], batch.get('mask'))
  total = lm + lb_coef * extras['load_balance'] + z_coef * extras['z_loss']
  metrics = {'loss': lm, 'load_balance': extras['load_balance'], 'z_loss': extras['z_loss'],
             'objective': total, 'dropped': extras['dropped'].astype(jnp.float32)}
  if router_bias is not None:
    metrics['load'] = {seg: s['load'] for seg, s in extras['per_visit'].items()}
  return total, metrics
