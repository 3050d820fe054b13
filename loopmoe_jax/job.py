"""One experiment set up once on its devices: the mesh, the model on its runtime, the optimizer
and schedule, the state's shardings and abstract shapes, and the programs it compiles.

    job = Job.build(exp)                  # exp: experiment.Experiment; devices, runtime optional
    state = job.create_state()            # created sharded, never whole on one device
    state, metrics = job.train_step()(state, batch)

The trainer, the dry run and the real-compiler dry run (aot.py), the fit finder, evaluation
and the benchmarks build one and nothing else. The Job owns its programs: one per key (train:
pass count and passes with gradient; eval: pass count; routing), made on first use. Dropping
the Job frees them; two Jobs never share one. Building one checks the batch against the mesh
and the run settings against the platform (attention_impls.check).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from loopmoe_jax import attention_impls, dispatch, sharding
from loopmoe_jax.experiment import Experiment
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.runtime import Runtime
from loopmoe_jax.train import checksums, step as steps
from loopmoe_jax.train.optimizer import make_optimizer


@dataclasses.dataclass(frozen=True, eq=False)
class Job:
  """An experiment on a mesh (module docstring). Built by `Job.build`."""
  exp: Experiment
  mesh: jax.sharding.Mesh
  model: LoopedMoE
  tx: Any                      # optax.GradientTransformation
  schedule: Callable           # step -> learning rate
  programs: dict = dataclasses.field(default_factory=dict, repr=False)

  @classmethod
  def build(cls, exp: Experiment, devices=None, runtime: Runtime | None = None) -> 'Job':
    """The Job of `exp` on `devices` (default: all of this process's view) for `runtime`'s
    platform (default: this machine's, with the experiment's run settings). A ValueError
    naming the key when the batch does not divide over the mesh, the routing limit exceeds
    the expert axis, or the runtime cannot run a setting (attention_impls.check)."""
    mesh = sharding.make_mesh(exp.mesh, devices)
    sharding.check_batch(exp.data.batch_size, exp.train.microbatches, mesh)
    sharding.check_device_limit(exp.model, mesh)
    runtime = dispatch.settle(exp.runtime(runtime))
    attention_impls.check(runtime, exp.model)
    tx, schedule = make_optimizer(exp.train)
    return cls(exp, mesh, LoopedMoE(exp.model, runtime=runtime), tx, schedule)

  @property
  def runtime(self) -> Runtime:
    return self.model.runtime

  @functools.cached_property
  def _shardings(self):
    return steps.shardings(self.mesh, self.model, self.tx, self.exp.data.seq_len,
                           self.exp.mesh.zero_data)

  @property
  def state_sh(self):
    """The train state's shardings (params and optimizer moments from the rules table)."""
    return self._shardings[0]

  @property
  def batch_sh(self) -> jax.sharding.NamedSharding:
    """The batch's sharding: rows over the mesh's batch axes."""
    return sharding.batch_sharding(self.mesh)

  @functools.cached_property
  def abstract_state(self):
    """ShapeDtypeStructs of the train state, with their shardings."""
    return steps.abstract_state(self.model, self.tx, self.exp.data.seq_len, self.state_sh)

  def abstract_batch(self) -> dict:
    """ShapeDtypeStructs of a global batch of inputs and targets, with its sharding."""
    shape = (self.exp.data.batch_size, self.exp.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sh)
            for k in ('inputs', 'targets')}

  def process_rows(self):
    """The rows of a global batch that this process's devices hold, in order."""
    return sharding.process_rows(self.batch_sh, self.exp.data.batch_size)

  def step_args(self) -> tuple:
    """(abstract state, abstract batch): what a train step is lowered at."""
    return self.abstract_state, self.abstract_batch()

  def create_state(self, seed: int | None = None):
    """The initial train state (seed: train.seed by default), made in its sharded layout."""
    seed = self.exp.train.seed if seed is None else seed
    return steps.create_state(self.model, self.tx, seed, self.exp.data.seq_len, self.state_sh)

  def _program(self, key: tuple, make: Callable):
    if key not in self.programs:
      self.programs[key] = make()
    return self.programs[key]

  def train_step(self, num_loops: int | None = None, backprop_loops: int = 0):
    """The train step of `num_loops` core passes (None: the trained count) with gradient
    through the last `backprop_loops` (0: all), made once."""
    settings = steps.StepSettings.of(self.exp.train, num_loops, backprop_loops)
    return self._program(('train', num_loops, backprop_loops), lambda: steps.make_train_step(
        self.model, self.tx, self.schedule, self.state_sh, self.batch_sh, settings))

  def eval_step(self, num_loops: int | None = None):
    """(params, batch, router_bias) -> (NLL sum, token count), made once per pass count."""
    return self._program(('eval', num_loops),
                         lambda: steps.make_eval_step(self.model, num_loops, self.mesh))

  def routing_step(self):
    """(params, batch, router_bias) -> per segment routing statistics, made once."""
    return self._program(('routing',), lambda: steps.make_routing_step(self.model, self.mesh))

  def all_finite(self, tree) -> bool:
    """Whether every float element of `tree` (the state's params) is finite."""
    return bool(self._program(('finite',), lambda: jax.jit(lambda t: steps.all_finite(t)))(tree))

  def checksum_program(self):
    """The checksums of the train state (checksums.checksum_program), made once: every save
    of the run computes them."""
    return self._program(('checksums',), checksums.checksum_program)

  @property
  def train_programs(self) -> int:
    """How many train-step programs this Job has made."""
    return sum(1 for k in self.programs if k[0] == 'train')
