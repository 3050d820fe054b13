"""An experiment's ConfigDict (model, run, train, data, mesh) and its frozen dataclasses, built
once.

Section `model` is the architecture (config.ModelConfig), `run` how its parameters run
(config.RunConfig: dispatch, remat, attention implementation, ...), which the model takes in
its runtime: `LoopedMoE(exp.model, runtime=exp.runtime())`.
Run settings found under `model` (a run directory written before `run` existed, or code that
sets `cfg.model.remat`) are read into `run`, with a one-line note."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping, NamedTuple

import ml_collections

from loopmoe_jax import config_file
from loopmoe_jax.config import RUN_FIELDS, ModelConfig, RunConfig
from loopmoe_jax.config.data import DataConfig
from loopmoe_jax.config.mesh import MeshConfig
from loopmoe_jax.config.train import TrainConfig

log = logging.getLogger(__name__)

SECTIONS = {'model': ModelConfig, 'train': TrainConfig, 'data': DataConfig, 'mesh': MeshConfig,
            'run': RunConfig}


class Experiment(NamedTuple):
  model: ModelConfig          # the architecture
  train: TrainConfig
  data: DataConfig
  mesh: MeshConfig = MeshConfig()
  run: RunConfig = RunConfig()

  def runtime(self, base=None):
    """The model's runtime with this experiment's run settings: `base` (a runtime.Runtime,
    e.g. Runtime.for_platform('tpu')) or this machine's."""
    # imported here, not at the top: the config layer loads without jax (a config file is
    # read before a script's Ctrl-C handler is installed, and config errors come at once)
    from loopmoe_jax.runtime import Runtime  # pylint: disable=import-outside-toplevel
    return (base or Runtime()).replace(run=self.run)


def experiment_config(model: ml_collections.ConfigDict, train=None, data=None, mesh=None,
                      run=None):
  """A ConfigDict with every field of every section (so --config.X.typo fails), the given
  train/data/mesh/run fields applied; run settings given in `model` move to `run`."""
  cfg = ml_collections.ConfigDict()
  run = dict(run or {})
  for key in RUN_FIELDS:
    if key in model:
      run.setdefault(key, model[key])
      del model[key]
  cfg.model = model
  for name, given in (('run', run), ('train', train or {}), ('data', data or {}),
                      ('mesh', mesh or {})):
    fields = {f.name: f.default for f in dataclasses.fields(SECTIONS[name])}
    for key in given:
      if key not in fields:
        raise ValueError(f'unknown config field {name}.{key}')
    fields.update(given)
    SECTIONS[name](**fields)  # validate
    cfg[name] = ml_collections.ConfigDict(fields)
  return cfg


_NOTED = set()


def split_run(sections: Mapping[str, Any]) -> tuple[dict, dict]:
  """(model dict, run dict) of a config's sections, run settings found under `model` read
  into `run` (they win over `run`'s: a stored config from before the section, or code that set
  cfg.model.X after the config was made), each noted once per process (an INFO log: the scripts
  print it as `note: ...`)."""
  model = dict(sections.get('model', {}) or {})
  run = dict(sections.get('run', {}) or {})
  moved = [k for k in model if k in RUN_FIELDS]
  for key in moved:
    run[key] = model.pop(key)
  if set(moved) - _NOTED:
    _NOTED.update(moved)
    log.info(f'model.{{{",".join(moved)}}} are run settings now: read as run.*')
  return model, run


def load_config(spec: str) -> ml_collections.ConfigDict:
  """The ConfigDict of 'FILE[:ARG]' as --config reads it; FILE may be relative to the
  repository (configs/foil.py:foil2), found from any directory, installed or not
  (loopmoe_jax.config_file). A missing file is a FileNotFoundError naming it."""
  from ml_collections import config_flags
  path, colon, arg = spec.partition(':')
  if not os.path.exists(path):  # the checkout's configs/, or the installed package's copy
    path = config_file(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f'no config file {spec.partition(":")[0]!r}')
  return config_flags.config_flags.ConfigFileFlagParser('config').parse(path + colon + arg)


def build(cfg: ml_collections.ConfigDict) -> Experiment:
  """Validates every section (unknown keys name near matches) and returns the dataclasses."""
  for key in cfg.keys():
    if key not in SECTIONS:
      raise ValueError(f'unknown config section {key!r}; sections are {sorted(SECTIONS)}')
  return _build(cfg.to_dict() if hasattr(cfg, 'to_dict') else cfg)


def _build(sections: Mapping[str, Any]) -> Experiment:
  model, run = split_run(sections)
  run_cfg = RunConfig.from_dict(run)
  model_cfg = ModelConfig.from_dict(model)
  others = {n: SECTIONS[n].from_dict(sections.get(n, {}) or {}) for n in ('train', 'data', 'mesh')}
  check_adaptive_depth(model_cfg, others['train'])
  return Experiment(model=model_cfg, run=run_cfg, **others)


def check_adaptive_depth(mc: ModelConfig, tc: TrainConfig):
  """A ValueError naming the key and the fix when the sampled pass counts
  (train.loops_sampler, loops_low/high) or train.backprop_loops do not fit the model: the
  counts a run may draw must all run on its weights (untied attention and a per-pass router
  bias hold model.num_loops passes; tied attention runs up to model.MAX_LOOPS_FACTOR times
  that), and the passes with gradient must not outnumber the passes run."""
  # imported here: the config layer loads without jax (model.py imports it)
  from loopmoe_jax.model import MAX_LOOPS_FACTOR, check_loops  # pylint: disable=import-outside-toplevel
  if mc.exit == 'gate' and tc.backprop_loops:
    raise ValueError(f"train.backprop_loops={tc.backprop_loops}: model.exit='gate' trains on "
                     "every pass's readout, so every pass needs its gradient; set "
                     "--config.train.backprop_loops=0 or train without the gate")
  if not (tc.sampled or tc.backprop_loops):
    return
  key = 'loops_sampler' if tc.sampled else 'backprop_loops'
  if not mc.core_layers:
    raise ValueError(f'train.{key}={getattr(tc, key)!r}: the model has no looped core '
                     '(model.core_layers=0); set model.core_layers >= 1 or drop the setting')
  L = mc.num_loops
  if not tc.sampled:
    if tc.backprop_loops > L:
      raise ValueError(f'train.backprop_loops={tc.backprop_loops} exceeds the passes a step '
                       f'runs (model.num_loops={L}): set it to at most {L} (0: all)')
    return
  low, high = tc.loops_bounds(L)
  high_key = (f'train.loops_high={high}' if tc.loops_high else
              f'train.loops_high=0 (model.num_loops={L})')
  if low > high:
    raise ValueError(f'train.loops_low={low} exceeds {high_key}: set '
                     f'--config.train.loops_high to at least {low}')
  if mc.router_bias == 'per_pass' and high > L:
    raise ValueError(f"{high_key}: model.router_bias='per_pass' has a bias for "
                     f'model.num_loops={L} passes, and passes past them would reuse the last '
                     f"one's without training theirs; set --config.train.loops_high={L} or "
                     "lower, or use model.router_bias='shared'")
  try:  # the most passes a forward runs on these weights (model.check_loops)
    check_loops(mc, high)
  except ValueError as e:
    most = L if not mc.tie_attention else MAX_LOOPS_FACTOR * L
    raise ValueError(f'{high_key}: every count the run draws must run on the weights, and '
                     f'{e}; set --config.train.loops_high to at most {most}') from None
  # a step drawing r passes backpropagates through its last min(k, r) (train/depth.py): a
  # draw below k keeps every pass's gradient, as Huginn's short draws do
  if tc.backprop_loops > high:
    raise ValueError(f'train.backprop_loops={tc.backprop_loops} exceeds the most passes a '
                     f'step draws ({high_key}): set it to at most {high} (0: all)')


# How the same parameters run, not what they are: the same results up to float summation order
# (dispatch backend, exchange transport, remat, loop implementation, the core's collectives,
# attention implementation, loss chunks). A resumed run or a finished sweep point may change
# them.
RUN_SETTINGS = tuple(f'run.{k}' for k in RUN_FIELDS)


def config_diff(stored: Mapping[str, Any], exp: Experiment) -> list[tuple[str, Any, Any]]:
  """(section.field, stored value, current value) for every field of every section where a
  stored config (a resolved config's JSON dict; run settings under `model` read as `run`'s)
  differs from `exp`; a stored section that does not read gives (section, the error, None).
  The model section compares the architecture; the run settings are section `run`'s."""
  out = []
  model, run = split_run(stored)
  for name, current in exp._asdict().items():
    given = {'model': model, 'run': run}.get(name, stored.get(name, {}) or {})
    try:
      if name == 'model':
        old, now = ModelConfig.from_dict(given).architecture(), current.architecture()
      else:
        old, now = dataclasses.asdict(SECTIONS[name].from_dict(given)), dataclasses.asdict(current)
    except (ValueError, TypeError) as e:
      out.append((name, f'does not read ({e})', None))
      continue
    out += [(f'{name}.{k}', old[k], v) for k, v in now.items() if old[k] != v]
  return out
