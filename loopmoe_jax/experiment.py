"""An experiment's ConfigDict (model, train, data) and its frozen dataclasses, built once."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, NamedTuple

import ml_collections

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.data.pipeline import DataConfig
from loopmoe_jax.sharding import MeshConfig
from loopmoe_jax.train.config import TrainConfig

SECTIONS = {'model': ModelConfig, 'train': TrainConfig, 'data': DataConfig, 'mesh': MeshConfig}


class Experiment(NamedTuple):
  model: ModelConfig
  train: TrainConfig
  data: DataConfig
  mesh: MeshConfig = MeshConfig()


def experiment_config(model: ml_collections.ConfigDict, train=None, data=None, mesh=None):
  """A ConfigDict with every field of every section (so --config.X.typo fails), the given
  train/data/mesh fields applied."""
  cfg = ml_collections.ConfigDict()
  cfg.model = model
  for name, given in (('train', train or {}), ('data', data or {}), ('mesh', mesh or {})):
    fields = {f.name: f.default for f in dataclasses.fields(SECTIONS[name])}
    for key in given:
      if key not in fields:
        raise ValueError(f'unknown config field {name}.{key}')
    fields.update(given)
    SECTIONS[name](**fields)  # validate
    cfg[name] = ml_collections.ConfigDict(fields)
  return cfg


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(spec: str) -> ml_collections.ConfigDict:
  """The ConfigDict of 'FILE[:ARG]' as --config reads it; FILE may be relative to the
  repository (configs/foil.py:foil2). A missing file is a FileNotFoundError naming it."""
  from ml_collections import config_flags
  path, colon, arg = spec.partition(':')
  if not os.path.exists(path) and os.path.exists(os.path.join(ROOT, path)):
    path = os.path.join(ROOT, path)
  if not os.path.exists(path):
    raise FileNotFoundError(f'no config file {spec.partition(":")[0]!r}')
  return config_flags.config_flags.ConfigFileFlagParser('config').parse(path + colon + arg)


def build(cfg: ml_collections.ConfigDict) -> Experiment:
  """Validates every section (unknown keys name near matches) and returns the dataclasses."""
  for key in cfg.keys():
    if key not in SECTIONS:
      raise ValueError(f'unknown config section {key!r}; sections are {sorted(SECTIONS)}')
  return Experiment(*(SECTIONS[n].from_dict(cfg.get(n, {}) or {}) for n in SECTIONS))


# How the same parameters run, not what they are: the same results up to float summation order
# (dispatch backend, exchange transport, remat, loop implementation, the core's collectives,
# attention implementation, loss chunks). A resumed run or a finished sweep point may change
# them.
RUN_SETTINGS = tuple(f'model.{k}' for k in (
    'dispatch', 'dispatch_tile', 'expert_exchange', 'remat', 'loop_impl', 'core_collectives',
    'attention_impl', 'attention_block', 'loss_chunk'))


def config_diff(stored: Mapping[str, Any], exp: Experiment) -> list[tuple[str, Any, Any]]:
  """(section.field, stored value, current value) for every field of every section where a
  stored config (a resolved config's JSON dict) differs from `exp`; a stored section that
  does not read gives (section, the error, None)."""
  out = []
  for name, current in exp._asdict().items():
    try:
      old = dataclasses.asdict(SECTIONS[name].from_dict(stored.get(name, {}) or {}))
    except (ValueError, TypeError) as e:
      out.append((name, f'does not read ({e})', None))
      continue
    out += [(f'{name}.{k}', old[k], v) for k, v in dataclasses.asdict(current).items()
            if old[k] != v]
  return out

