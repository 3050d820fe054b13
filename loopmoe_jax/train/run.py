"""A run directory: its layout, and the one way back from it to a built experiment.

    workdir/
      checkpoints/<step>/   Orbax steps: train state, data-iterator state, resolved config
      metrics.jsonl         one JSON row per logged step (train/metrics.py)
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
import json
import os
from typing import Any

import ml_collections

from loopmoe_jax import experiment
from loopmoe_jax.train import checkpoint

CHECKPOINTS, METRICS, ROUTING, SUMMARY = 'checkpoints', 'metrics.jsonl', 'routing.jsonl', 'summary.json'


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
    return os.path.join(self.path, name)

  @property
  def checkpoints(self) -> str:
    return self.file(CHECKPOINTS)

  def load(self, step: int | None = None, mesh=None) -> Loaded:
    """The newest readable checkpoint (or `step`), read once (checkpoint.load_params skips a
    damaged step for the previous good one)."""
    cfg, params, s, config = checkpoint.load_params(self.path, step, mesh)
    bias = checkpoint.load_router_bias(self.path, s) if cfg.router_bias != 'none' else None
    return Loaded(self.path, experiment.build(ml_collections.ConfigDict(config)), params, bias,
                  s, config)

  def _jsonl(self, name: str) -> list[dict]:
    path = self.file(name)
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def metrics(self) -> list[dict]:
    return self._jsonl(METRICS)

  def routing(self) -> list[dict]:
    return self._jsonl(ROUTING)

  def summary(self) -> dict | None:
    path = self.file(SUMMARY)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)


def as_loaded(run, step: int | None = None) -> Loaded:
  """`run` (a workdir or a Loaded) as a Loaded: a Loaded is used as it is when `step` is None
  or its own step; a workdir is read once."""
  if isinstance(run, Loaded):
    if step is not None and step != run.step:
      raise ValueError(f'{run.workdir}: step {step} asked of a loaded step {run.step}')
    return run
  return RunDir(run).load(step)
