"""Device meshes from config, the one logical-axis rules table, and the train state's shardings.

Mesh axes, outermost first: `dcn_data` (data parallel across TPU slices / GPU nodes, over the
slow network), `data`, `fsdp` (data parallel with parameters and optimizer state sharded),
`expert` (data parallel for attention, experts spread for the MoE layers), `tensor` (attention
heads and the expert hidden width). The batch is split over every axis but `tensor`.

RULES maps every name of `layers.LOGICAL_AXES`, and the activation names `batch`, `length`,
`act_embed`, to mesh axes; parameter and optimizer-state shardings, the batch sharding and the
activation constraints all come from it. A name may map to several mesh axes (outermost
first); within one array a mesh axis serves the first dimension that claims it, so an expert
weight ('experts', 'embed', 'mlp') is split over `expert` by its expert dimension and over
`fsdp` by its width, while a dense weight's 'embed' takes both `fsdp` and `expert`: no weight
is copied over an axis that could hold a part of it. For parameters, the axes after the first
are kept only while their product divides the dimension (the first must divide: an error
names the config key otherwise); `scripts/dry_run.py` prints the per-device bytes by group.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from loopmoe_jax.config.mesh import AXES, MeshConfig
from loopmoe_jax.layers import LOGICAL_AXES

BATCH_AXES = ('dcn_data', 'data', 'fsdp', 'expert')

RULES: dict[str, Any] = {
    # parameters
    'vocab': 'tensor', 'embed': ('fsdp', 'expert'), 'heads': 'tensor', 'kv_heads': 'tensor',
    'head_dim': None, 'mlp': 'tensor', 'experts': 'expert', 'loops': None, 'embed_in': None,
    'inject_src': None,
    # activations
    'batch': BATCH_AXES, 'length': None, 'act_embed': None,
}
assert set(LOGICAL_AXES) <= set(RULES), 'every logical axis needs a rule'

# What to change when a dimension does not divide over its mesh axis.
FIX = {'vocab': 'model.vocab_size', 'embed': 'model.d_model', 'heads': 'model.num_heads',
       'kv_heads': 'model.num_kv_heads', 'mlp': 'model.expert_width (or shared_expert_width)',
       'experts': 'the segment\'s model.*_experts'}


# Mesh axes by how much they talk, least first: on a TPU torus the last get the physical axes
# first (contiguous ICI rings), on GPUs the last are innermost (inside a node).
_INTENSITY = ('dcn_data', 'data', 'fsdp', 'tensor', 'expert')


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[Any] | None = None):
  """The 5-axis mesh (AxisType.Auto). With dcn_data > 1 the devices are grouped by TPU slice
  (or by process on GPU nodes) so only `dcn_data` crosses the slow network. On a TPU torus
  the axes are placed by their traffic (`_INTENSITY`: `expert`, then `tensor`, on whole
  physical axes where sizes allow), splitting a physical axis where a size is not a product of
  whole ones (fsdp=8 on 4x4x4); elsewhere (GPUs, fake CPU devices) in device order, the last
  axes innermost."""
  cfg = cfg or MeshConfig()
  devices = list(devices if devices is not None else jax.devices())
  sizes = cfg.sizes(len(devices))
  types = (jax.sharding.AxisType.Auto,) * len(AXES)
  slices = len({getattr(d, 'slice_index', 0) for d in devices})
  by_process = len({d.process_index for d in devices})
  tpu = devices[0].platform == 'tpu'
  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
  order = [AXES.index(a) for a in _INTENSITY]
  shape = tuple(sizes[a] for a in _INTENSITY)
  if sizes['dcn_data'] > 1 and sizes['dcn_data'] not in (slices, by_process):
    raise ValueError(f"mesh.dcn_data={sizes['dcn_data']} matches neither the TPU slices "
                     f'({slices}) nor the processes ({by_process}) of the run: set it to one '
                     'of them (or 1)')
  try:
    if sizes['dcn_data'] > 1:
      # granules: TPU slices when there are several, else processes (GPU nodes)
      ici = (1,) + shape[1:]
      dcn = (sizes['dcn_data'],) + (1,) * (len(AXES) - 1)
      grid = mesh_utils.create_hybrid_device_mesh(
          ici, dcn, devices, process_is_granule=slices != sizes['dcn_data'],
          allow_split_physical_axes=True)
    elif tpu:
      grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
      return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=types,
                           devices=devices)
  except (ValueError, NotImplementedError, AssertionError) as e:
    topo = 'x'.join(str(n) for n in _torus_shape(devices)) if tpu else f'{len(devices)} devices'
    mesh = ' x '.join(f'mesh.{a}={n}' for a, n in sizes.items() if n > 1) or 'one device'
    raise ValueError(f'mesh: no placement of {mesh} on the {topo} topology '
                     f'({devices[0].device_kind}): {(str(e).splitlines() or [type(e).__name__])[0][:160]}'
                     ) from None
  grid = np.transpose(grid, np.argsort(order))  # back to AXES order
  return jax.sharding.Mesh(grid, AXES, axis_types=types)


def _torus_shape(devices) -> tuple[int, ...]:
  """The extent of the devices' chip coordinates per physical axis (cores per chip apart)."""
  coords = np.array([d.coords for d in devices])
  return tuple(int(n) for n in coords.max(0) - coords.min(0) + 1)


# mesh.zero_data: parameter widths also over `data` (ZeRO-3 style), after RULES' axes
ZERO_DATA = {'embed': ('data',)}


def _rule_axes(names, mesh_axes, extra=None):
  """Per dimension, the mesh axes RULES gives it (then `extra`'s), each mesh axis used once
  (first claim)."""
  used, out = set(), []
  for name in names:
    rule = RULES.get(name) if name else None
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    axes += tuple((extra or {}).get(name, ()))
    axes = tuple(a for a in axes if a in mesh_axes and a not in used)
    used.update(axes)
    out.append(axes)
  return out


def _entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def spec(names: Sequence[str | None], mesh_axes: Sequence[str] = AXES) -> P:
  """The PartitionSpec of logical `names` under RULES (axes not in `mesh_axes` dropped)."""
  return P(*(_entry(axes) for axes in _rule_axes(names, mesh_axes)))


def batch_axes(mesh) -> tuple[str, ...]:
  """The batch axes present on `mesh` (the row split of tokens)."""
  return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


@functools.lru_cache(maxsize=64)
def process_rows(batch_sh, batch_size: int) -> np.ndarray:
  """The rows of a global batch of `batch_size` (sorted) that this process's devices hold
  under the batch sharding `batch_sh`: a process reads and feeds exactly these. All rows when
  a non-batch axis (tensor, say) spans the processes; its contiguous share when only batch
  axes do."""
  index = batch_sh.addressable_devices_indices_map((batch_size, 1))
  rows = np.unique(np.concatenate([np.arange(batch_size)[i[0]] for i in index.values()]))
  rows.setflags(write=False)
  return rows


def batch_size_of(mesh) -> int:
  """Number of batch shards: the product of the batch axes."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)


def check_batch(batch_size: int, microbatches: int, mesh):
  """The global batch must split into `microbatches` equal parts, each over the batch shards."""
  shards = batch_size_of(mesh)
  axes = ' x '.join(f'mesh.{a}={mesh.shape[a]}' for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
  if batch_size % microbatches:
    raise ValueError(f'train.microbatches={microbatches} does not divide data.batch_size='
                     f'{batch_size}; use a divisor of {batch_size}')
  if (batch_size // microbatches) % shards:
    per = f' per microbatch ({batch_size} / {microbatches})' if microbatches > 1 else ''
    raise ValueError(f'data.batch_size={batch_size}{per} does not split over the {shards} batch '
                     f'shards of the mesh ({axes or "one device"}); make the batch'
                     f'{" per microbatch" if per else ""} a multiple of {shards} or change '
                     'the mesh')


def check_device_limit(model, mesh):
  """model.max_expert_devices must not exceed the expert axis that expert parallelism runs
  over (one device, mesh.expert=1, runs any model)."""
  n, m = mesh.shape.get('expert', 1), model.max_expert_devices
  if n > 1 and m > n:
    raise ValueError(f'model.max_expert_devices={m} exceeds mesh.expert={n}: a token cannot '
                     f'reach more devices than the axis has; use at most {n}')


# Train-state shardings ---------------------------------------------------------------------

def _is_box(x):
  return isinstance(x, nn.LogicallyPartitioned)


def param_specs(boxed_params, mesh, zero_data: bool = False, min_bytes: int = 0):
  """PartitionSpecs of a boxed (logically partitioned) param tree, checking that every
  sharded dimension divides over its mesh axis (a ValueError naming the param, the numbers
  and the config key to change). A param of fewer than `min_bytes` bytes (run.min_shard_bytes)
  is whole on every device: no step gathers it."""
  def one(path, box):
    names = box.names if _is_box(box) else (None,) * len(box.shape)
    value = box.value if _is_box(box) else box
    if math.prod(value.shape) * np.dtype(value.dtype).itemsize < min_bytes:
      return P()
    out = []
    extra = ZERO_DATA if zero_data else None
    for dim, (name, axes) in enumerate(zip(names, _rule_axes(names, mesh.axis_names, extra))):
      axes = [a for a in axes if mesh.shape[a] > 1]
      if axes and value.shape[dim] % mesh.shape[axes[0]]:
        keys = [str(getattr(k, 'key', k)) for k in path]
        n = mesh.shape[axes[0]]
        fix = FIX.get(name, 'the model')
        if name == 'experts' and keys[0] in ('prelude', 'core', 'coda'):
          fix = f'model.{keys[0]}_experts'
        raise ValueError(
            f'param {"/".join(keys)}: its {name!r} dimension of size {value.shape[dim]} does '
            f'not divide over mesh.{axes[0]}={n}; change {fix} to a multiple of {n} or set '
            f'mesh.{axes[0]} to a divisor of {value.shape[dim]}')
      while axes and value.shape[dim] % math.prod(mesh.shape[a] for a in axes):
        axes.pop()  # a further axis that does not divide: that part stays copied
      out.append(_entry(axes))
    return P(*out)
  return jax.tree_util.tree_map_with_path(one, boxed_params, is_leaf=_is_box)


def param_shardings(mesh, boxed_params, zero_data: bool = False, min_bytes: int = 0):
  """NamedShardings of the params (param_specs on `mesh`)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s),
                      param_specs(boxed_params, mesh, zero_data, min_bytes),
                      is_leaf=lambda x: isinstance(x, P))


def state_shardings(mesh, boxed_params, tx, zero_data: bool = False, min_bytes: int = 0):
  """NamedShardings of {'params', 'opt_state', 'step'}: optimizer moments follow their
  params (optax.tree_map_params), counters and other scalars are replicated."""
  params = nn.unbox(boxed_params)
  named = param_shardings(mesh, boxed_params, zero_data, min_bytes)
  rep = NamedSharding(mesh, P())
  opt_shapes = jax.eval_shape(tx.init, params)
  opt = optax.tree_map_params(tx, lambda _, sh: sh, opt_shapes, named,
                              transform_non_params=lambda _: rep,
                              is_leaf=lambda x: isinstance(x, NamedSharding))
  return {'params': named, 'opt_state': opt, 'step': rep}


def batch_sharding(mesh):
  return NamedSharding(mesh, spec(('batch', 'length'), mesh.axis_names))


def bytes_per_device(shapes, shardings) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs under the given shardings (the
  largest shard of each leaf)."""
  total = 0
  for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))):
    shard = sh.shard_shape(s.shape)
    total += int(np.prod(shard, dtype=np.int64)) * np.dtype(s.dtype).itemsize
  return total


def gathered_inside(names: Sequence[str | None], shape, itemsize: int, mesh,
                    inside: Sequence[str | None], min_bytes: int = 0):
  """(in_spec, {dim: mesh axes}) for a weight entering a shard_map: the dimensions named in
  `inside` as the body uses them (`spec` of `inside`), and the others (None there, a weight's
  width, e.g. 'embed') in their stored split over the axes of size > 1 that RULES gives them,
  to be all-gathered in the body. Gathered inside, a weight's gradient leaves the shard_map
  reduce-scattered over those axes, where a weight gathered before it (its in_spec whole
  there) comes back all-reduced whole. A weight under `min_bytes` (run.min_shard_bytes, kept
  whole) gathers nothing."""
  base = spec(inside, mesh.axis_names)
  if math.prod(shape) * itemsize < min_bytes:
    return base, {}
  used = {a for e in base if e for a in ((e,) if isinstance(e, str) else e)}
  entries, gathers = list(base), {}
  for dim, (name, kept) in enumerate(zip(names, inside)):
    if kept is not None or name is None:
      continue
    axes = [a for a in _rule_axes([name], mesh.axis_names)[0]
            if a not in used and mesh.shape[a] > 1]
    while axes and shape[dim] % math.prod(mesh.shape[a] for a in axes):
      axes.pop()
    if axes:
      used.update(axes)
      entries[dim], gathers[dim] = _entry(axes), tuple(axes)
  return P(*entries), gathers
