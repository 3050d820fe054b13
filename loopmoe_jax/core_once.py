"""The looped core with its collectives once per step (run.core_collectives='once').

Under a mesh, `core.Core` runs its scanned passes through `core_once`: inside `jax.shard_map`
over the whole mesh each device runs every pass on its own rows. The core's weights enter in
their sharded layout and are all-gathered once, before the loop; the transpose of that gather
is one reduce-scatter per weight after the backward loop, so the shared weights' gradients
accumulate locally across the passes and are reduced once per step, whatever the pass count
(XLA's partitioning of a plain scan reduces them inside the loop, once per pass); the memory
price is the core's weights, and their gradient accumulator, whole over the batch axes for
the step. The MoE
layers see a manual mesh and route and exchange locally (moe.py, expert_parallel.py); their
routing sums are added over the shards here so the aux losses are the global batch's.

`core_once` is a lifted transform (like `nn.scan`): it takes the core's bound layer stack and
hands the stack's own variables (its weights, and read-only inputs such as analysis/masking's
expert masks) into the shard_map, where the stack runs on each device's view of them
(runtime.LOCAL_SPLIT: whole, but for an expert dimension, which keeps its `expert` split).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift, unfreeze
from jax.sharding import PartitionSpec as P

from loopmoe_jax import sharding
from loopmoe_jax.attention import AttentionWeights
from loopmoe_jax.core_plan import CoreInputs
from loopmoe_jax.moe import SUM_KEYS, losses_from_sums
from loopmoe_jax.runtime import split_inside


def _gather_specs(boxed, mesh, min_bytes: int = 0):
  """Per weight of a boxed tree: (its PartitionSpec under the rules table, per dimension the
  mesh axes to gather it over inside the shard_map: all of them but those LOCAL_SPLIT keeps,
  runtime.split_inside); weights under `min_bytes` (run.min_shard_bytes) whole."""
  specs = sharding.param_specs(boxed, mesh, min_bytes=min_bytes)
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)

  def gather_axes(box, spec):
    return tuple(split_inside(name, entry)[1] for name, entry in zip(box.names, spec))
  gathers = jax.tree.map(gather_axes, boxed, specs, is_leaf=is_box)
  return specs, gathers


def layouts(stack: nn.Module, inputs: CoreInputs, per_pass: bool):
  """The layouts `core_once` takes: (specs, gathers) of the stack's params and of the untied
  attention's per-pass weights on the stack's mesh, read from their declarations (an abstract
  init of the stack, whole over the mesh, on one pass's inputs: the same boxes the train
  state's shardings are made from). `inputs` as core_once's (any of the passes), bias per
  pass when `per_pass`."""
  mesh = stack.runtime.mesh
  whole = stack.clone(parent=None, runtime=dataclasses.replace(stack.runtime, local=False))
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        tuple(inputs.one_pass(0, per_pass)))
  min_bytes = stack.runtime.run.min_shard_bytes
  params = _gather_specs(jax.eval_shape(
      lambda *a: whole.init(jax.random.key(0), *a), *shapes)['params'], mesh, min_bytes)
  if inputs.pass_attn is None:
    return params, None
  layer = jax.eval_shape(lambda: AttentionWeights(stack.cfg, stack=stack.cfg.num_loops)
                         .init(jax.random.key(0)))['params']
  attn_spec, attn_gather = _gather_specs(layer, mesh, min_bytes)
  n = len(inputs.pass_attn)
  return params, ([attn_spec] * n, [attn_gather] * n)


def _gather(w, dims):
  for dim, axes in enumerate(dims):
    if axes:
      w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
  return w


def _gather_tree(tree, gathers):
  return jax.tree.map(_gather, tree, gathers, is_leaf=lambda x: isinstance(x, tuple))


def _shard_mapped(body_fn, scope, *args, collections, mesh, layouts, has_experts: bool):
  """The lifted shard_map (flax.core.lift.pack): `body_fn(scope, *args)` (`args`: the
  CoreInputs' fields) inside `jax.shard_map` over `mesh`, the scope's `collections` entering
  in their stored layout and gathered to each device's view before the body runs (nothing
  written back: the stack's variables are read-only here)."""
  (param_specs, param_gathers), attn = layouts
  rows = P(sharding.batch_axes(mesh))
  inputs = CoreInputs(*args)

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    del repack_fn
    (variables,) = variable_groups[0]   # one filter, one scope
    variables = nn.unbox(unfreeze(variables))  # boxed params (a fresh init) read as arrays
    specs = {col: param_specs if col == 'params' else jax.tree.map(lambda _: P(), tree)
             for col, tree in variables.items()}

    def local(variables, *args):
      local_inputs = CoreInputs(*args)
      with jax.named_scope('gather_core_weights'):
        variables = dict(variables, params=_gather_tree(variables['params'], param_gathers))
        if local_inputs.pass_attn is not None:
          local_inputs = local_inputs._replace(
              pass_attn=_gather_tree(local_inputs.pass_attn, attn[1]))
      inner_scope = scope_fn(((variables,),), rng_groups)
      x_BTD, stats = body_fn(inner_scope, *local_inputs)
      if not stats:
        return x_BTD, {}
      return x_BTD, {'sums': jax.tree.map(lambda v: v[None], stats['sums']),
                     'dropped': stats['dropped']}

    out_stats = {'sums': {k: rows for k in SUM_KEYS}, 'dropped': P()} if has_experts else {}
    opt = lambda a, spec: None if a is None else spec
    y = jax.shard_map(
        local, in_specs=(specs, rows, None if attn is None else attn[0],
                         opt(inputs.e_BTD, rows), rows, opt(inputs.bias, P())),
        out_specs=(rows, out_stats), check_vma=False)(variables, *args)
    return y, ()

  return lift.pack(inner, (collections,), (), (), name='core_once')(scope, *inputs)


def core_once(fn, stack: nn.Module, inputs: CoreInputs, collections, layouts):
  """`fn(stack, *inputs)`, the core's scan over its bound layer stack, inside a shard_map
  over the whole mesh (module docstring): the stack's `collections` (weights first,
  read-only) gathered once by `layouts`, the MoE routing sums added over the shards.
  Returns what the plain scan returns."""
  mesh = stack.runtime.mesh
  x_BTD, stats = nn.transforms.lift_direct_transform(
      _shard_mapped, (fn,), stack, *inputs, collections=collections, mesh=mesh,
      layouts=layouts, has_experts=bool(stack.num_experts))
  if not stats:
    return x_BTD, {}
  sums = jax.tree.map(lambda v: jnp.sum(v, axis=0), stats['sums'])
  lb, zl = losses_from_sums(sums, stack.cfg.top_k)
  return x_BTD, {'load_balance': lb, 'z_loss': zl, 'load': sums['load'],
                 'dropped': stats['dropped']}
