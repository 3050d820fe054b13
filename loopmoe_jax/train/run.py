"""A run directory: its layout, and the one way back from it to a built experiment.

    workdir/
      checkpoints/<step>/   Orbax steps: train state, data-iterator state, resolved config
      metrics.jsonl         one JSON row per logged step (train/metrics.py)
      final_steps.jsonl     the LM loss of every step of the last train.final_window steps
                            (the paired comparison's record, whatever train.log_every is;
                            RunDir.final_steps: the steps the final-window loss averages)
      routing.jsonl         per-visit routing records (train.routing_every)
      summary.json          the run's end: final-window loss, wall time, ...
      (sweep points add config.json and point.json)

`RunDir(workdir).load(step)` reads one checkpoint once (params, router bias, step and the
stored config) and builds its experiment with `experiment.build`, so evaluation, generation,
diagnosis, probes, evals and export share one parsed object (`Loaded`) instead of each
re-reading the checkpoint and re-parsing sections of its config. `as_loaded` lets a function
take either a workdir or a `Loaded` that its caller already holds.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from loopmoe_jax import dispatch, experiment, sharding, storage
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.train import checkpoint, checksums
from loopmoe_jax.train.metrics import FINAL_STEPS, METRICS, ROUTING, SUMMARY  # noqa: F401
from loopmoe_jax.train.metrics import final_window, read_rows
from loopmoe_jax.train.step import boxed_params

log = logging.getLogger(__name__)

CHECKPOINTS = 'checkpoints'


@dataclasses.dataclass(frozen=True)
class Loaded:
  """One checkpoint of a run: the experiment built from its stored config, the params
  (onto one device, or sharded by `RunDir.load`'s mesh), the trained router bias
  ({segment: array}, or None when the model has none), the step and the stored config."""
  workdir: str
  exp: Any
  params: Any
  router_bias: Any
  step: int
  config: dict

  @property
  def model_cfg(self):
    return self.exp.model

  @functools.cached_property
  def runtime(self):
    """The model's runtime on this machine with the run's stored run settings (its Pallas
    self-check settled once)."""
    return dispatch.settle(self.exp.runtime())

  @property
  def variables(self):
    """What `model.variables` and `apply` take: the params, joined by the router bias."""
    if self.router_bias is None:
      return self.params
    return {'params': self.params, 'router_bias': self.router_bias}


class RunDir:
  """The files of one run directory (see the module docstring)."""

  def __init__(self, workdir):
    self.path = os.fspath(workdir)

  def file(self, name: str) -> str:
    return storage.join(self.path, name)

  @property
  def checkpoints(self) -> str:
    return self.file(CHECKPOINTS)

  def load(self, step: int | None = None, mesh=None) -> Loaded:
    """The newest readable checkpoint (or `step`), read once (a damaged step is skipped for
    the previous good one)."""
    exp, params, s, config = _read(self.path, step, mesh)
    bias = read_router_bias(self.path, s) if exp.model.router_bias != 'none' else None
    return Loaded(self.path, exp, params, bias, s, config)

  def _jsonl(self, name: str, required: bool = False) -> list[dict]:
    path = self.file(name)
    if not storage.exists(path):
      if required:
        raise FileNotFoundError(f'{self.path}: no {name} (not a run directory?)')
      return []
    return read_rows(path)  # a torn last line (a crash mid-write) skipped with a note

  def metrics(self, required: bool = False) -> list[dict]:
    """metrics.jsonl's rows in order ([] when there is none, unless `required`)."""
    return self._jsonl(METRICS, required)

  def series(self, key: str = 'loss') -> dict[int, float]:
    """{step: value} of one metrics.jsonl key (the last row of a step wins, as on resume)."""
    rows = self.metrics(required=True)
    try:
      return {int(r['step']): float(r[key]) for r in rows if key in r}
    except (KeyError, TypeError, ValueError):
      raise ValueError(f'{self.file(METRICS)}: a row without a numeric step and {key!r}') from None

  def routing(self) -> list[dict]:
    return self._jsonl(ROUTING)

  def final_steps(self) -> dict[int, float]:
    """{step: LM loss} of every step of the run's final window, the last train.final_window
    steps of train.steps as its newest checkpoint's config says, shrunk as the summary's
    final-window loss is for a run too short for it after its warmup (metrics.final_window;
    rows an earlier, shorter invocation recorded before them are left out); {} for a run
    without the record (one written before it existed, or one that has not reached its
    window)."""
    rows = {int(r['step']): float(r['loss']) for r in self._jsonl(FINAL_STEPS)}
    if rows:
      train = self.stored_config().get('train', {})
      n, _ = final_window(train.get('steps', 0), train.get('warmup', 0),
                          train.get('final_window', 0))
      rows = {s: v for s, v in rows.items() if s > train.get('steps', 0) - n}
    return rows

  def summary(self) -> dict | None:
    path = self.file(SUMMARY)
    if not storage.exists(path):
      return None
    return json.loads(storage.read_text(path))

  def stored_config(self) -> dict:
    """The resolved config saved with the newest checkpoint step whose config reads back
    (checkpoints/<step>/config/metadata, JSON), without Orbax."""
    ckpt = self.checkpoints
    steps = sorted((int(s) for s in storage.listdir(ckpt) if s.isdigit()), reverse=True)
    for s in steps:
      try:
        return json.loads(storage.read_text(storage.join(ckpt, str(s), 'config', 'metadata')))
      except (OSError, ValueError):
        continue
    raise FileNotFoundError(f'{self.path}: no checkpoint step with a readable config')


def as_loaded(run, step: int | None = None) -> Loaded:
  """`run` (a workdir or a Loaded) as a Loaded: a Loaded is used as it is when `step` is None
  or its own step; a workdir is read once."""
  if isinstance(run, Loaded):
    if step is not None and step != run.step:
      raise ValueError(f'{run.workdir}: step {step} asked of a loaded step {run.step}')
    return run
  return RunDir(run).load(step)


def load_on(run, mesh, step: int | None = None) -> Loaded:
  """`run` (a workdir or a Loaded) with its params on `mesh` as the rules table shards them
  (a workdir is read sharded; a Loaded's params are moved) and its router bias replicated;
  `as_loaded` when `mesh` is None."""
  if mesh is None:
    return as_loaded(run, step)
  if isinstance(run, Loaded):
    loaded = as_loaded(run, step)
    params = jax.device_put(loaded.params, _param_shardings(loaded.model_cfg, None, mesh))
  else:
    loaded = RunDir(run).load(step, mesh=mesh)
    params = loaded.params
  bias = None if loaded.router_bias is None else jax.device_put(
      loaded.router_bias, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return dataclasses.replace(loaded, params=params, router_bias=bias)


# Reading a checkpoint without the trainer ------------------------------------------------

def _params_reader(ckpt_dir: str):
  """A read-only manager whose state handler restores a subtree (the params alone)."""
  opts = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                      enable_async_checkpointing=False)
  return ocp.CheckpointManager(ckpt_dir, options=opts, item_handlers={
      'state': ocp.PyTreeCheckpointHandler(use_ocdbt=checkpoint.use_ocdbt(ckpt_dir)),
      'data': ocp.JsonCheckpointHandler(),
      'config': ocp.JsonCheckpointHandler()})


def _checkpoint_dir(directory: str) -> str:
  """A run directory's checkpoints/ (or `directory` itself when it is one)."""
  sub = storage.join(directory, 'checkpoints')
  return sub if storage.isdir(sub) else directory


def _read(directory: str, step: int | None, mesh):
  """(the built Experiment, params, step, config dict) of checkpoint `step` (None: the
  newest readable) of a run directory: the parameters alone (not the optimizer state),
  whatever mesh wrote them, onto this machine's first device or with `mesh` sharded by the
  rules table (sharding.py)."""
  ckpt_dir = _checkpoint_dir(directory)
  if not storage.isdir(ckpt_dir):
    raise FileNotFoundError(f'no checkpoint directory at {directory!r}')
  mngr = _params_reader(storage.absolute(ckpt_dir))
  existing = sorted(mngr.all_steps(), reverse=True)
  if not existing:
    raise FileNotFoundError(f'no checkpoint in {ckpt_dir!r}: no complete step was written there')
  if step is not None and step not in existing:
    raise FileNotFoundError(f'step {step}: no such checkpoint in {ckpt_dir!r} (steps there: '
                            f'{sorted(existing)})')
  steps = existing if step is None else [step]
  for s in steps:
    try:
      config = mngr.restore(s, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
      exp = experiment.build(ml_collections.ConfigDict(config))
      shapes = mngr.item_metadata(s)['state']['params']
      shardings = _param_shardings(exp.model, shapes, mesh)
      target = jax.tree.map(lambda m, sh: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh),
                            shapes, shardings)
      restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
      params = mngr.restore(s, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          {'params': target}, restore_args={'params': restore_args},
          partial_restore=True)))['state']['params']
      data = mngr.restore(s, args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']
    except Exception as e:
      log.warning(f'checkpoint step {s} in {ckpt_dir} is unreadable ({type(e).__name__}); '
                  'skipping it')
      continue
    stored = (data or {}).get(checksums.CHECKSUMS)
    bad = None if stored is None else checksums.checksum_mismatch(params, stored, "['params']")
    if bad:
      log.warning(f'checkpoint step {s} in {ckpt_dir} is damaged (the checksum of {bad} '
                  'differs from the one saved with it); skipping it')
      continue
    return exp, params, s, config
  raise ValueError(f'no readable checkpoint step in {ckpt_dir!r} (tried {steps})')


def read_router_bias(directory: str, step: int):
  """The router bias ({segment: array}, onto this machine's first device) of checkpoint
  `step` in `directory` (as `RunDir.load` found it), or None when the run had none."""
  ckpt_dir = _checkpoint_dir(directory)
  mngr = _params_reader(storage.absolute(ckpt_dir))
  shapes = mngr.item_metadata(step)['state'].get('router_bias')
  if shapes is None:
    return None
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), shapes)
  restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
  return mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      {'router_bias': target}, restore_args={'router_bias': restore_args},
      partial_restore=True)))['state']['router_bias']


def _param_shardings(cfg: ModelConfig, shapes, mesh):
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, shapes)
  return sharding.param_shardings(mesh, boxed_params(LoopedMoE(cfg)))
