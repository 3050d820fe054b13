"""Orbax checkpoints: train state, data-iterator state and the resolved config per step.

Saves are asynchronous with keep-N and Orbax's atomic commit (a step directory appears
only once it is complete); a save that Orbax skips is an error. Restore takes the latest
step that reads back; a corrupt or partial step is reported and skipped for the previous
good one (the trainer then moves it aside, `set_aside`, so the run can write it again).
`load_params` reads a checkpoint without the trainer (evaluation, generation, export).
"""
from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from loopmoe_jax.config import ModelConfig

log = logging.getLogger(__name__)


def manager(directory: str, keep: int = 3, async_save: bool = True, read_only: bool = False):
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                      enable_async_checkpointing=async_save, read_only=read_only)
  handlers = {'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler(),
              'config': ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(os.path.abspath(directory), options=opts, item_handlers=handlers)


def save(mngr, step: int, state, data_state, config_json: str, force: bool = False):
  saved = mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {}),
      config=ocp.args.JsonSave(json.loads(config_json))), force=force)
  if not saved:  # Orbax skips a step that already exists rather than overwrite it
    raise RuntimeError(f'checkpoint step {step} was not written in {mngr.directory} (a step '
                       f'{step} exists there already: {sorted(mngr.all_steps())})')


def stored_config(mngr):
  """(step, config dict) of the newest step whose config reads back, or None."""
  for s in sorted(mngr.all_steps(), reverse=True):
    try:
      return s, mngr.restore(s, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    except Exception:  # pylint: disable=broad-except  (a damaged step: try the previous one)
      continue
  return None


class StateMismatch(ValueError):
  """An intact checkpoint whose train state does not fit the one asked for."""


def spread(shape) -> jax.sharding.Sharding:
  """A sharding for a leaf of unknown role: its first dimension that divides over every device
  split over all of them (else replicated), so no device holds a whole large array."""
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.asarray(devices), ('all',))
  dims = [None] * len(shape)
  for i, n in enumerate(shape):
    if n % len(devices) == 0:
      dims[i] = 'all'
      break
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*dims))


def _intact(mngr, step: int) -> bool:
  """Whether the step's state restores as stored (spread over every device, `spread`)."""
  try:
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                                         sharding=spread(m.shape)),
                          mngr.item_metadata(step)['state'])
    mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  except Exception:  # pylint: disable=broad-except
    return False
  return True


def set_aside(mngr, steps, workdir: str) -> list[str]:
  """Moves the given (unreadable) step directories to workdir/unreadable_checkpoints/, so a
  resumed run can save those steps again and nothing is deleted; returns the new paths."""
  moved = []
  for s in steps:
    src = os.path.join(str(mngr.directory), str(s))
    dst = os.path.join(workdir, 'unreadable_checkpoints', str(s))
    n = 1
    while os.path.exists(dst):
      dst = os.path.join(workdir, 'unreadable_checkpoints', f'{s}.{n}')
      n += 1
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)
    moved.append(dst)
  mngr.reload()
  return moved


def restore_latest(mngr, abstract_state, step: int | None = None, skipped=None):
  """(step, state, data_state, config dict) of the newest readable step, or None if none.

  With `step`, only that step is tried. Unreadable steps are logged, skipped and, when
  `skipped` is a list, appended to it. A step that restores as stored but not into
  abstract_state (another optimizer, another model) raises StateMismatch."""
  steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
  for s in steps:
    try:
      out = mngr.restore(s, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
          config=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many kinds for a damaged step
      if _intact(mngr, s):
        raise StateMismatch(f'checkpoint step {s} in {mngr.directory} is intact but its train '
                            f'state does not fit this run\'s ({type(e).__name__}: '
                            f'{str(e)[:300]})') from e
      log.warning('checkpoint step %d in %s is unreadable (%s: %s); trying the previous one',
                  s, mngr.directory, type(e).__name__, str(e)[:200])
      print(f'WARNING: checkpoint step {s} in {mngr.directory} is unreadable '
            f'({type(e).__name__}); skipping it')
      if skipped is not None:
        skipped.append(s)
      continue
    return s, out['state'], out['data'], out['config']
  return None


def _params_reader(ckpt_dir: str):
  """A read-only manager whose state handler restores a subtree (the params alone)."""
  opts = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                      enable_async_checkpointing=False)
  return ocp.CheckpointManager(ckpt_dir, options=opts, item_handlers={
      'state': ocp.PyTreeCheckpointHandler(), 'data': ocp.JsonCheckpointHandler(),
      'config': ocp.JsonCheckpointHandler()})


def load_params(directory: str, step: int | None = None, mesh=None):
  """(ModelConfig, params, step, config dict) from a checkpoint directory, without the trainer.

  Only the parameters are read (not the optimizer state), whatever mesh wrote them: onto this
  machine's first device, or with `mesh` sharded by the rules table (sharding.py)."""
  ckpt_dir = directory
  if os.path.isdir(os.path.join(directory, 'checkpoints')):
    ckpt_dir = os.path.join(directory, 'checkpoints')
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f'no checkpoint directory at {directory!r}')
  mngr = _params_reader(os.path.abspath(ckpt_dir))
  steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
  if not steps:
    raise FileNotFoundError(f'no complete checkpoint step in {ckpt_dir!r}')
  for s in steps:
    try:
      config = mngr.restore(s, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
      cfg = ModelConfig.from_dict(config['model'])
      shapes = mngr.item_metadata(s)['state']['params']
      shardings = _param_shardings(cfg, shapes, mesh)
      target = jax.tree.map(lambda m, sh: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh),
                            shapes, shardings)
      restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
      params = mngr.restore(s, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          {'params': target}, restore_args={'params': restore_args},
          partial_restore=True)))['state']['params']
    except Exception as e:
      print(f'WARNING: checkpoint step {s} in {ckpt_dir} is unreadable ({type(e).__name__}); '
            'skipping it')
      continue
    return cfg, params, s, config
  raise ValueError(f'no readable checkpoint step in {ckpt_dir!r} (tried {steps})')


def _param_shardings(cfg: ModelConfig, shapes, mesh):
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, shapes)
  from loopmoe_jax import sharding
  from loopmoe_jax.model import LoopedMoE
  boxed = jax.eval_shape(lambda: LoopedMoE(cfg).lazy_init(
      jax.random.key(0, impl='rbg'), jax.ShapeDtypeStruct((1, 8), jax.numpy.int32))['params'])
  specs = sharding.param_specs(boxed, mesh)
  return jax.tree.map(lambda sp: jax.sharding.NamedSharding(mesh, sp), specs,
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
