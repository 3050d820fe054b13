"""The train state (an explicit pytree), its shardings, and the pure jitted train/eval steps.

state = {'params', 'opt_state', 'step'}. Shardings come from `loopmoe_jax.sharding`'s rules
table: the batch is split over the mesh's batch axes, parameters and optimizer moments over
`fsdp`, `expert` and `tensor` as their logical axes say. Every step runs under
`jax.set_mesh(mesh)` so the model's activation constraints and the expert-parallel
`shard_map` see the mesh.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from loopmoe_jax import sharding
from loopmoe_jax.objective import loss_fn, lm_loss


def init_key(seed: int):
  """The init key: XLA's RngBitGenerator ('rbg') compiles in a fraction of threefry's time."""
  return jax.random.key(seed, impl='rbg')


def _tokens(seq_len: int):
  return jax.ShapeDtypeStruct((1, seq_len), jnp.int32)


def init_state(model, tx, rng, seq_len: int):
  """Unboxed params (the logical axis names live in `shardings`). `lazy_init` skips the
  forward computation that the params do not depend on."""
  params = nn.unbox(model.lazy_init(rng, _tokens(seq_len))['params'])
  return {'params': params, 'opt_state': tx.init(params), 'step': jnp.zeros((), jnp.int32)}


def boxed_params(model, seq_len: int = 8):
  """The params' shapes with their logical axis names (nothing is computed)."""
  return jax.eval_shape(lambda: model.lazy_init(init_key(0), _tokens(seq_len))['params'])


def shardings(mesh, model, tx, seq_len: int):
  """(state shardings, batch sharding) on `mesh`, from the params' logical axis names."""
  boxed = boxed_params(model, seq_len)
  return sharding.state_shardings(mesh, boxed, tx), sharding.batch_sharding(mesh)


def abstract_state(model, tx, seq_len: int, state_sh=None):
  """ShapeDtypeStructs of the state (with `state_sh`, carrying those shardings)."""
  shapes = jax.eval_shape(lambda: init_state(model, tx, init_key(0), seq_len))
  if state_sh is None:
    return shapes
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, state_sh)


def create_state(model, tx, seed: int, seq_len: int, state_sh):
  """The initial state, created directly in its sharded layout (never whole on one device)."""
  mesh = jax.tree.leaves(state_sh)[0].mesh
  init = jax.jit(lambda rng: init_state(model, tx, rng, seq_len), out_shardings=state_sh)
  with jax.set_mesh(mesh):
    return init(init_key(seed))


class OnMesh:
  """A jitted function that is traced and run under `jax.set_mesh(mesh)`."""

  def __init__(self, jitted, mesh):
    self.jitted, self.mesh = jitted, mesh

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted.trace(*args).lower()


def global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


@jax.jit
def all_finite(tree) -> jax.Array:
  """True when every element of every (float) leaf is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def split_microbatches(batch, microbatches: int):
  """[B, ...] -> [m, B/m, ...] with microbatch i = rows i, i+m, ...: each device keeps its own
  rows (B/m of every device's rows per microbatch), so no data moves."""
  def one(x):
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
    return sharding.constrain(jnp.swapaxes(x, 0, 1), (None, 'batch', 'length'))
  return jax.tree.map(one, batch)


def loss_and_grads(params, model, batch, lb_coef, z_coef, microbatches: int = 1):
  """(metrics, grads) of the objective; with `microbatches` > 1 the mean over equal
  microbatches (gradient accumulation in float32). The LM loss and z-loss are token means,
  so equal microbatches give the whole batch's values; the load-balance loss is a product of
  batch means, computed per microbatch as a device holding that batch would."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if microbatches == 1:
    (_, metrics), grads = grad_fn(params, model, batch, lb_coef, z_coef)
    return metrics, grads

  def body(acc, mb):
    (_, metrics), grads = grad_fn(params, model, mb, lb_coef, z_coef)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return jax.tree.map(jnp.add, acc, (metrics, grads)), None

  mbs = split_microbatches(batch, microbatches)
  zeros = jax.eval_shape(lambda: grad_fn(params, model, jax.tree.map(lambda x: x[0], mbs),
                                         lb_coef, z_coef))
  acc0 = (jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), zeros[0][1]),
          jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
  (metrics, grads), _ = jax.lax.scan(body, acc0, mbs)
  grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grads, params)
  metrics = {k: v if k == 'dropped' else v / microbatches for k, v in metrics.items()}
  return metrics, grads  # dropped: the step's total


def make_train_step(model, tx, schedule, lb_coef: float, z_coef: float, state_sh, batch_sh,
                    microbatches: int = 1):
  def step(state, batch):
    metrics, grads = loss_and_grads(state['params'], model, batch, lb_coef, z_coef,
                                    microbatches)
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics = dict(metrics, grad_norm=global_norm(grads), lr=schedule(state['step']))
    return {'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}, metrics

  return OnMesh(jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                        donate_argnums=0), batch_sh.mesh)


def make_eval_step(model, num_loops=None, mesh=None):
  """Sum of token NLL and token count of a batch (so batches of any mask average exactly)."""
  def step(params, batch):
    logits, _ = model.apply({'params': params}, batch['inputs'], num_loops=num_loops)
    mask = batch['mask']
    count = jnp.sum(mask)
    return lm_loss(logits, batch['targets'], mask) * count, count
  return OnMesh(jax.jit(step), mesh) if mesh is not None else jax.jit(step)


def make_routing_step(model, mesh=None):
  """Per segment, pass and layer: load-balance loss, z-loss, MaxVio and dropped assignments
  of a batch."""
  def step(params, batch):
    _, extras = model.apply({'params': params}, batch['inputs'])
    out = {}
    for seg, s in extras['per_visit'].items():
      load = s['load']
      mean = jnp.mean(load, axis=-1, keepdims=True)
      out[seg] = {'load_balance': s['load_balance'], 'z_loss': s['z_loss'],
                  'max_vio': ((jnp.max(load, axis=-1, keepdims=True) - mean) / mean)[..., 0],
                  'dropped': s['dropped']}
    return out
  return OnMesh(jax.jit(step), mesh) if mesh is not None else jax.jit(step)


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
