"""The train state (an explicit pytree), its shardings, and the pure jitted train/eval steps.

state = {'params', 'opt_state', 'step'}. The batch is sharded over the mesh's 'data' axis;
params and optimizer state are replicated (expert/model sharding comes with the mesh rules).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from loopmoe_jax.objective import loss_fn, lm_loss


def make_mesh(devices=None):
  devices = devices if devices is not None else jax.devices()
  return jax.make_mesh((len(devices),), ('data',), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)


def init_key(seed: int):
  """The init key: XLA's RngBitGenerator ('rbg') compiles in a fraction of threefry's time."""
  return jax.random.key(seed, impl='rbg')


def init_state(model, tx, rng, seq_len: int):
  """Unboxed params (logical axis names dropped: the replicated layout needs none yet).
  `lazy_init` skips the forward computation that the params do not depend on."""
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  params = nn.unbox(model.lazy_init(rng, tokens)['params'])
  return {'params': params, 'opt_state': tx.init(params), 'step': jnp.zeros((), jnp.int32)}


def abstract_state(model, tx, seq_len: int):
  return jax.eval_shape(lambda: init_state(model, tx, init_key(0), seq_len))


def shardings(mesh, state_shapes):
  rep = NamedSharding(mesh, P())
  return jax.tree.map(lambda _: rep, state_shapes), NamedSharding(mesh, P('data'))


def global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


@jax.jit
def all_finite(tree) -> jax.Array:
  """True when every element of every (float) leaf is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def make_train_step(model, tx, schedule, lb_coef: float, z_coef: float, state_sh, batch_sh):
  def step(state, batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state['params'], model, batch, lb_coef, z_coef)
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics = dict(metrics, grad_norm=global_norm(grads), lr=schedule(state['step']))
    return {'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}, metrics

  return jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                 donate_argnums=0)


def make_eval_step(model, num_loops=None):
  """Sum of token NLL and token count of a batch (so batches of any mask average exactly)."""
  def step(params, batch):
    logits, _ = model.apply({'params': params}, batch['inputs'], num_loops=num_loops)
    mask = batch['mask']
    count = jnp.sum(mask)
    return lm_loss(logits, batch['targets'], mask) * count, count
  return jax.jit(step)


def make_routing_step(model):
  """Per segment, pass and layer: load-balance loss, z-loss and MaxVio of a batch."""
  def step(params, batch):
    _, extras = model.apply({'params': params}, batch['inputs'])
    out = {}
    for seg, s in extras['per_visit'].items():
      load = s['load']
      mean = jnp.mean(load, axis=-1, keepdims=True)
      out[seg] = {'load_balance': s['load_balance'], 'z_loss': s['z_loss'],
                  'max_vio': ((jnp.max(load, axis=-1, keepdims=True) - mean) / mean)[..., 0]}
    return out
  return jax.jit(step)


def put_batch(batch, batch_sh):
  """Builds global arrays from this process's rows."""
  return {k: jax.make_array_from_process_local_data(batch_sh, np.asarray(v))
          for k, v in batch.items()}


def evaluate(eval_step, params, batches, batch_sh) -> float:
  total, count = 0.0, 0.0
  for b in batches:
    s, c = eval_step(params, put_batch(b, batch_sh))
    total, count = total + float(s), count + float(c)
  return total / max(count, 1.0)
