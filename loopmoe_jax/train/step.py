"""The train state (an explicit pytree), its shardings, and the pure jitted train/eval steps.

state = {'params', 'opt_state', 'step'}, plus 'router_bias' ({segment: bias}) with
model.router_bias: updated in the train step from the step's expert loads, outside the
gradient and the optimizer. Shardings come from `loopmoe_jax.sharding`'s rules
table: the batch is split over the mesh's batch axes, parameters and optimizer moments over
`fsdp`, `expert` and `tensor` as their logical axes say. Every step runs under
`jax.set_mesh(mesh)` so the model's activation constraints and the expert-parallel
`shard_map` see the mesh.

Each `make_*` call makes a new program: a Job (loopmoe_jax/job.py) builds them once and owns
them, so dropping the Job frees them.

A train step's settings (StepSettings: the core's pass count, the passes it backpropagates
through, the loss coefficients) are static: one program each (train/depth.py draws the count
per step; the Job keeps a run's programs).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from loopmoe_jax import sharding
from loopmoe_jax.moe import max_vio
from loopmoe_jax.model import ROUTER_BIAS, bias_shapes, for_init, variables
from loopmoe_jax.objective import loss_fn, token_nll
from loopmoe_jax.runtime import Runtime


def init_key(seed: int):
  """The init key: XLA's RngBitGenerator ('rbg') compiles in a fraction of threefry's time."""
  return jax.random.key(seed, impl='rbg')


def _tokens(seq_len: int):
  return jax.ShapeDtypeStruct((1, seq_len), jnp.int32)


def init_state(model, tx, rng, seq_len: int):
  """Unboxed params (the logical axis names live in `shardings`). `lazy_init` skips the
  forward computation that the params do not depend on."""
  init = for_init(model).lazy_init(rng, _tokens(seq_len))
  params = nn.unbox(init['params'])
  state = {'params': params, 'opt_state': tx.init(params), 'step': jnp.zeros((), jnp.int32)}
  if ROUTER_BIAS in init:
    state[ROUTER_BIAS] = init[ROUTER_BIAS]
  return state


def boxed_params(model, seq_len: int = 8):
  """The params' shapes with their logical axis names (nothing is computed)."""
  init = for_init(model).lazy_init
  return jax.eval_shape(lambda: init(init_key(0), _tokens(seq_len))['params'])


def update_router_bias(collection, loads, rate: float):
  """DeepSeek-V3's aux-loss-free update of the 'router_bias' collection: each expert's bias
  moves by `rate` * sign(mean load - its load), from `loads` ({segment: expert loads}, [D, E],
  the core's [L, D, E], summed over passes for a shared bias). No gradient."""
  out = {}
  for seg, b in collection['bias'].items():
    load = jax.lax.stop_gradient(loads[seg])
    if load.ndim > b.ndim:  # a bias shared by every pass: the loads of all passes
      load = jnp.sum(load, axis=0)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    delta = rate * jnp.sign(mean - load)
    if delta.shape[0] < b.shape[0]:  # a per-pass bias, fewer passes run (a sampled count):
      # the passes not run keep theirs
      delta = jnp.pad(delta, [(0, b.shape[0] - delta.shape[0])] + [(0, 0)] * (b.ndim - 1))
    out[seg] = b + delta
  return {'bias': out}


def shardings(mesh, model, tx, seq_len: int, zero_data: bool = False):
  """(state shardings, batch sharding) on `mesh`, from the params' logical axis names
  (`zero_data`: mesh.zero_data; params under the model's run.min_shard_bytes whole)."""
  boxed = boxed_params(model, seq_len)
  state_sh = sharding.state_shardings(mesh, boxed, tx, zero_data,
                                      model.runtime.run.min_shard_bytes)
  segments = bias_shapes(model.cfg)
  if segments:  # small: replicated
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state_sh[ROUTER_BIAS] = {'bias': {seg: rep for seg in segments}}
  return state_sh, sharding.batch_sharding(mesh)


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
  with jax.set_mesh(mesh):
    init = jax.jit(lambda rng: init_state(model, tx, rng, seq_len), out_shardings=state_sh)
    return init(init_key(seed))


class OnMesh:
  """A jitted function that is traced and run under `jax.set_mesh(mesh)`."""

  def __init__(self, jitted, mesh):
    self.jitted, self.mesh = jitted, mesh

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args, platform: str | None = None):
    """The lowered program; with `platform` ('tpu', 'cuda', ...) lowered for that platform
    (its model built with `Runtime.for_platform(platform)` to build its kernels too)."""
    with jax.set_mesh(self.mesh):
      traced = self.jitted.trace(*args)
      return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def all_finite(tree) -> jax.Array:
  """True when every element of every (float) leaf is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def split_microbatches(batch, microbatches: int, *, runtime: Runtime):
  """[B, ...] -> [m, B/m, ...] with microbatch i = rows i, i+m, ...: each device keeps its own
  rows (B/m of every device's rows per microbatch, on the runtime's mesh), so no data moves."""
  def one(x):
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
    return runtime.constrain(jnp.swapaxes(x, 0, 1), (None, 'batch', 'length'))
  return jax.tree.map(one, batch)


def replays(model) -> bool:
  """Whether a train step of `model` on its runtime's mesh replays an overflowing exchange
  (model.exchange_overflow='replay' with expert parallelism)."""
  rt = model.runtime.resolved()
  return (model.cfg.exchange_overflow == 'replay' and not rt.exchange_dropless and rt.sharded
          and rt.axis('expert') > 1)


def dropless(model, remat: str = 'full'):
  """`model` with the dropless worst-case exchange buffers (the same parameters and, with no
  row dropped, the same results as the bounded program), under `remat`: 'full' for the replay
  of a step whose bounded buffers dropped a row (it keeps its activations within the bounded
  program's memory); a forward alone keeps no layer's buffers, whatever the policy."""
  return model.clone(runtime=model.runtime.with_run(remat=remat).replace(exchange_dropless=True))


def with_replay(value_and_grad, model):
  """`value_and_grad(params, model, batch)` that, when `replays(model)`, reruns a batch
  whose bounded exchange buffers (model.exchange_buffer_factor) dropped a row with
  `dropless(model)`, inside the same program (a `lax.cond` on the step's global drop count:
  every device takes the same branch). The step's memory is the larger of the two programs',
  not the dropless worst case without remat (under `full` the fallback's MoE runs in token
  chunks, run.expert_block_rows, so its buffers are a chunk's); a replayed batch costs one
  more forward and backward, with full's recompute. metrics['replayed'] counts the replayed
  (micro)batches; 'dropped' is then 0."""
  if not replays(model):
    return value_and_grad
  fallback = dropless(model)

  def fn(params, _, batch):
    (loss, metrics), grads = value_and_grad(params, model, batch)
    overflow = metrics['dropped'] > 0

    def replay(_):
      (loss2, metrics2), grads2 = value_and_grad(params, fallback, batch)
      return (loss2, dict(metrics2, replayed=jnp.float32(1))), grads2

    kept = (loss, dict(metrics, replayed=jnp.float32(0))), grads
    return jax.lax.cond(overflow, replay, lambda x: x, kept)
  return fn


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """What a train step computes besides the model: the loss coefficients, the microbatches,
  the router bias's rate, and the core's passes (`num_loops`, None: the trained count) and
  those with gradient (`backprop_loops`, 0: all). Each value is static: one program each."""
  lb_coef: float = 0.01
  z_coef: float = 0.001
  microbatches: int = 1
  bias_rate: float = 0.0
  num_loops: int | None = None
  backprop_loops: int = 0

  @classmethod
  def of(cls, tc, num_loops: int | None = None, backprop_loops: int = 0) -> 'StepSettings':
    """A TrainConfig's settings for a step of `num_loops` passes."""
    return cls(tc.lb_coef, tc.z_coef, tc.microbatches, tc.bias_rate, num_loops, backprop_loops)


def loss_and_grads(params, model, batch, settings: StepSettings, router_bias=None):
  """(metrics, grads) of the objective; with settings.microbatches > 1 the mean over equal
  microbatches (gradient accumulation in float32). The LM loss and z-loss are token means,
  so equal microbatches give the whole batch's values; the load-balance loss is a product of
  batch means, computed per microbatch as a device holding that batch would. The expert
  loads ('load', with `router_bias`) are the whole batch's (summed)."""
  s = settings
  value_and_grad = jax.value_and_grad(
      lambda p, m, b: loss_fn(p, m, b, s.lb_coef, s.z_coef, s.num_loops, router_bias,
                              s.backprop_loops), has_aux=True)
  grad_fn = with_replay(value_and_grad, model)
  if s.microbatches == 1:
    (_, metrics), grads = grad_fn(params, model, batch)
    return metrics, grads

  def body(acc, mb):
    (_, metrics), grads = grad_fn(params, model, mb)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return jax.tree.map(jnp.add, acc, (metrics, grads)), None

  mbs = split_microbatches(batch, s.microbatches, runtime=model.runtime)
  zeros = jax.eval_shape(lambda: grad_fn(params, model, jax.tree.map(lambda x: x[0], mbs)))
  acc0 = (jax.tree.map(lambda z: jnp.zeros(z.shape, jnp.float32), zeros[0][1]),
          jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
  (metrics, grads), _ = jax.lax.scan(body, acc0, mbs)
  grads = jax.tree.map(lambda g, p: (g / s.microbatches).astype(p.dtype), grads, params)
  metrics = {k: v if k in ('dropped', 'load', 'replayed') else v / s.microbatches
             for k, v in metrics.items()}
  return metrics, grads  # dropped, load and replayed: the step's totals


def make_train_step(model, tx, schedule, state_sh, batch_sh, settings: StepSettings):
  """The jitted train step (state, batch) -> (state, metrics) on the batch sharding's mesh.
  With a router bias in the state: the bias routes the step, then moves by
  settings.bias_rate against the step's loads; the metrics gain 'max_vio_<segment>' (mean
  over the segment's visits of the per-visit MaxVio). A new program each call: its owner
  (job.Job) keeps it."""
  def step(state, batch):
    bias = state.get(ROUTER_BIAS)
    metrics, grads = loss_and_grads(state['params'], model, batch, settings, bias)
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics = dict(metrics, grad_norm=global_norm(grads), lr=schedule(state['step']))
    new = {'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}
    if bias is not None:
      load = metrics.pop('load')
      new[ROUTER_BIAS] = update_router_bias(bias, load, settings.bias_rate)
      metrics.update({f'max_vio_{s}': jnp.mean(max_vio(v)) for s, v in load.items()})
    return new, metrics

  return OnMesh(jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                        donate_argnums=0), batch_sh.mesh)


def make_eval_step(model, num_loops=None, mesh=None):
  """Sum of token NLL and token count of a batch (so batches of any mask average exactly).
  With model.exchange_overflow='replay' the forward uses the dropless exchange buffers (a
  forward keeps no layer's buffers for a backward)."""
  if model.cfg.exchange_overflow == 'replay':
    model = dropless(model, model.runtime.run.remat)

  def step(params, batch, router_bias=None):
    total, count, _ = token_nll(params, model, batch, num_loops, router_bias)
    return total, count
  return OnMesh(jax.jit(step), mesh) if mesh is not None else jax.jit(step)


def make_routing_step(model, mesh=None):
  """Per segment, pass and layer: load-balance loss, z-loss, MaxVio and dropped assignments
  of a batch."""
  def step(params, batch, router_bias=None):
    _, extras = model.apply(variables(params, router_bias=router_bias), batch['inputs'])
    out = {}
    for seg, s in extras['per_visit'].items():
      out[seg] = {'load_balance': s['load_balance'], 'z_loss': s['z_loss'],
                  'max_vio': max_vio(s['load']), 'dropped': s['dropped']}
    return out
  return OnMesh(jax.jit(step), mesh) if mesh is not None else jax.jit(step)


def put_batch(batch, batch_sh, batch_size: int | None = None):
  """Global arrays of a batch of `batch_size` rows (None: `batch` is the whole global batch)
  from `batch`: the whole batch, or this process's rows of it,
  sharding.process_rows(batch_sh, batch_size), in order. Each addressable device gets its
  slice, whichever mesh axes span the processes."""
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    n = v.shape[0] if batch_size is None else batch_size
    rows = sharding.process_rows(batch_sh, n)
    if v.shape[0] == n:  # the whole batch: each device's slice as it is
      fetch = lambda idx, v=v: v[idx[0]]  # noqa: E731
    elif v.shape[0] == rows.size:  # this process's rows: each global row at its place
      fetch = lambda idx, v=v, rows=rows, n=n: v[np.searchsorted(rows, _range(idx[0], n))]  # noqa: E731
    else:
      raise ValueError(f'batch {k!r}: {v.shape[0]} rows fed, but this process\'s devices hold '
                       f'{rows.size} of the {n} rows')
    out[k] = jax.make_array_from_callback((n,) + v.shape[1:], batch_sh, fetch)
  return out


def _range(index, n: int) -> np.ndarray:
  return np.arange(n)[index]


def evaluate(eval_step, params, batches, batch_sh, router_bias=None,
             batch_size: int | None = None) -> float:
  """Mean loss over `batches` (this process's rows of global batches of `batch_size`)."""
  total, count = 0.0, 0.0
  for b in batches:
    s, c = eval_step(params, put_batch(b, batch_sh, batch_size), router_bias)
    total, count = total + float(s), count + float(c)
  return total / max(count, 1.0)
