"""The training objective: LM loss plus weighted aux losses; the LM loss is reported alone.

The loss applies the output head itself (`token_nll`): with `model.loss_chunk` = c > 0 the
head, the log-softmax and the target's log-probability run over chunks of c positions inside a
scan whose body is rematerialised, so at most [B, c, V] float32 logits exist at a time in the
forward or the backward (never [B, T, V]); with `model.remat` set the whole-sequence head and
loss are rematerialised (the backward keeps the final hidden states, not the logits).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from loopmoe_jax import sharding
from loopmoe_jax.model import head_matrix, variables


def lm_loss(logits_BTV, targets_BT, mask_BT=None):
  """Mean next-token negative log-likelihood (float32) over unmasked positions."""
  logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  nll_BT = -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
  if mask_BT is None:
    return jnp.mean(nll_BT)
  mask = mask_BT.astype(jnp.float32)
  return jnp.sum(nll_BT * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _nll_sum(h_BcD, head_DV, targets_Bc, mask_Bc):
  """Summed NLL of one chunk (float32 logits live only here)."""
  logits = jnp.dot(h_BcD, head_DV.astype(h_BcD.dtype), preferred_element_type=jnp.float32)
  target = jnp.take_along_axis(logits, targets_Bc[..., None], axis=-1)[..., 0]
  return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target) * mask_Bc)


def head_nll(h_BTD, head_DV, targets_BT, mask_BT, chunk: int, remat: bool = False):
  """(summed NLL, token count) of the output head `head_DV` on the final hidden states: with
  `chunk` > 0 over chunks of that many positions (the last padded and masked), each chunk's
  logits recomputed in the backward; else in one piece (rematerialised with `remat`)."""
  b, t, d = h_BTD.shape
  mask_BT = jnp.ones((b, t), jnp.float32) if mask_BT is None else mask_BT.astype(jnp.float32)
  count = jnp.sum(mask_BT)
  if not chunk or chunk >= t:
    fn = jax.checkpoint(_nll_sum) if remat else _nll_sum
    return fn(h_BTD, head_DV, targets_BT, mask_BT), count
  n = -(-t // chunk)
  pad = n * chunk - t

  def split(x):  # [B, T, ...] -> [n, B, chunk, ...], each batch shard keeping its rows
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)
    return sharding.constrain(x, (None, 'batch', 'length') + ('act_embed',) * (x.ndim - 3))

  body = jax.checkpoint(_nll_sum)

  def step(total, piece):
    return total + body(piece[0], head_DV, piece[1], piece[2]), None

  total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32),
                          (split(h_BTD), split(targets_BT), split(mask_BT)))
  return total, count


def token_nll(params, model, batch, num_loops: int | None = None, router_bias=None):
  """(summed NLL over the batch's unmasked targets, their count, the model's extras), the head
  and loss as model.loss_chunk and model.remat say."""
  c = model.cfg
  h_BTD, extras = model.apply(variables(params, router_bias=router_bias), batch['inputs'],
                              num_loops=num_loops, return_hidden=True)
  head_DV = head_matrix(c, params['params'] if 'params' in params else params)
  total, count = head_nll(h_BTD, head_DV, batch['targets'], batch.get('mask'),
                          c.loss_chunk, remat=c.remat != 'none')
  return total, count, extras


def loss_fn(params, model, batch, lb_coef: float = 0.01, z_coef: float = 0.001,
            num_loops: int | None = None, router_bias=None):
  """Returns (total objective, metrics). batch: 'inputs', 'targets' [B, T], optional 'mask'.
  With `router_bias` (model.router_bias; not differentiated) the metrics also hold the expert
  loads per segment under 'load' ({segment: [D, E] or the core's [L, D, E]})."""
  if router_bias is not None:
    router_bias = jax.lax.stop_gradient(router_bias)
  total_nll, count, extras = token_nll(params, model, batch, num_loops, router_bias)
  lm = total_nll / jnp.maximum(count, 1.0)
  total = lm + lb_coef * extras['load_balance'] + z_coef * extras['z_loss']
  metrics = {'loss': lm, 'load_balance': extras['load_balance'], 'z_loss': extras['z_loss'],
             'objective': total, 'dropped': extras['dropped'].astype(jnp.float32)}
  if router_bias is not None:
    metrics['load'] = {seg: s['load'] for seg, s in extras['per_visit'].items()}
  return total, metrics
