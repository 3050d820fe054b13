"""The looped core with its collectives once per step (run.core_collectives='once').

Under a mesh, `core.Core` runs its scanned passes through `core_once`: inside `jax.shard_map`
over the whole mesh each device runs every pass on its own rows. The core's weights enter in
their sharded layout and are all-gathered once, before the loop; the transpose of that gather
is one reduce-scatter per weight after the backward loop, so the shared weights' gradients
accumulate locally across the passes and are reduced once per step, whatever the pass count
(XLA's partitioning of a plain scan reduces them inside the loop, once per pass). The MoE
layers see a manual mesh and route and exchange locally (moe.py, expert_parallel.py); their
routing sums are added over the shards here so the aux losses are the global batch's.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from loopmoe_jax import sharding
from loopmoe_jax.attention import AttentionWeights
from loopmoe_jax.moe import SUM_KEYS, losses_from_sums


def _gather_specs(boxed, mesh):
  """Per weight of a boxed tree: (its PartitionSpec under the rules table, per dimension the
  mesh axes to gather it over inside the shard_map: all of them but an expert dimension's
  `expert`)."""
  specs = sharding.param_specs(boxed, mesh)
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)

  def gather_axes(box, spec):
    out = []
    for name, entry in zip(box.names, spec):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      out.append(tuple(a for a in axes if not (name == 'experts' and a == 'expert')))
    return tuple(out)
  gathers = jax.tree.map(gather_axes, boxed, specs, is_leaf=is_box)
  return specs, gathers


def core_once(scanned, params, args):
  """The scanned core inside `jax.shard_map` over the whole mesh: each device runs every pass
  on its rows. The core's weights enter in their sharded layout and are all-gathered once
  inside, before the loop (expert weights keep their `expert` split); the transpose of that
  gather is one reduce-scatter of each weight's gradient after the backward loop, so the
  shared weights' gradients accumulate locally across passes and are reduced once (the
  memory price: the core's weights, and their gradient accumulator, whole over the batch
  axes for the step). The MoE layers route and exchange locally (moe.py) and return their
  routing sums, added here over the shards to give the global batch's aux losses; outputs
  as the plain scan's."""
  mesh = scanned.runtime.mesh  # its runtime is the local view (Runtime.local_view)
  rows = P(sharding.batch_axes(mesh))
  x_BTD, pass_attn, e_BTD, positions_BT, bias = args
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  whole = scanned.clone(runtime=dataclasses.replace(scanned.runtime, local=False))
  specs, gathers = _gather_specs(jax.eval_shape(  # the weights' specs, whole over the mesh
      lambda *a: whole.init(jax.random.key(0), *a), *shapes)['params'], mesh)
  attn_specs, attn_gathers = None, None
  if pass_attn is not None:  # untied attention: per pass, sharded like any weight
    one_layer = jax.eval_shape(lambda: AttentionWeights(scanned.cfg, stack=scanned.cfg.num_loops)
                               .init(jax.random.key(0)))['params']
    attn_spec, attn_gather = _gather_specs(one_layer, mesh)
    attn_specs = [attn_spec] * len(pass_attn)
    attn_gathers = [attn_gather] * len(pass_attn)

  def gather(w, dims):
    for dim, axes in enumerate(dims):
      if axes:
        w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w

  def inner(params, x_BTD, pass_attn, e_BTD, positions_BT, bias):
    with jax.named_scope('gather_core_weights'):
      dims = lambda x: isinstance(x, tuple)
      params = jax.tree.map(gather, params, gathers, is_leaf=dims)
      if pass_attn is not None:
        pass_attn = jax.tree.map(gather, pass_attn, attn_gathers, is_leaf=dims)
    x_BTD, stats = scanned.apply({'params': params}, x_BTD, pass_attn, e_BTD, positions_BT, bias)
    if not stats:
      return x_BTD, {}
    return x_BTD, {'sums': jax.tree.map(lambda v: v[None], stats['sums']),
                   'dropped': stats['dropped']}

  out_stats = {} if not scanned.num_experts else {
      'sums': {k: rows for k in SUM_KEYS}, 'dropped': P()}
  opt = lambda a, spec: None if a is None else spec
  x_BTD, stats = jax.shard_map(
      inner, in_specs=(specs, rows, attn_specs, opt(e_BTD, rows), rows,
                       opt(bias, P())),
      out_specs=(rows, out_stats), check_vma=False)(params, x_BTD, pass_attn, e_BTD,
                                                    positions_BT, bias)
  if not stats:
    return x_BTD, {}
  sums = jax.tree.map(lambda v: jnp.sum(v, axis=0), stats['sums'])
  lb, zl = losses_from_sums(sums, scanned.cfg.top_k)
  return x_BTD, {'load_balance': lb, 'z_loss': zl, 'load': sums['load'],
                 'dropped': stats['dropped']}
