"""Helpers the test files share: the trainer tests' tiny run (`tiny`, `losses`) and the model
tests' tiny config with numpy-drawn params (`make_cfg`, `make_params`, `tokens`, `apply_fn`)."""
import functools
import json
import logging
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.config import ModelConfig, model_config_dict
from loopmoe_jax.config import RUN_FIELDS
from loopmoe_jax.config.data import DataConfig
from loopmoe_jax.config.mesh import MeshConfig
from loopmoe_jax.config.train import TrainConfig
from loopmoe_jax.experiment import Experiment, experiment_config
from loopmoe_jax.job import Job
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.runtime import Runtime


# The trainer's tiny run ---------------------------------------------------------------------

def tiny(dispatch='xla', **train_kw):
  """The trainer tests' run. `dispatch` 'xla' (ragged_dot) by default: its train step traces
  in half the time of the CPU default ('tiled', covered here by the bitwise-resume test and by
  test_dispatch against the reference), and what these tests check does not depend on it."""
  model = model_config_dict(vocab_size=256, d_model=32, num_heads=2, expert_width=32,
                            prelude_layers=1, prelude_experts=4, core_layers=1, core_experts=4,
                            num_loops=2, coda_layers=0, dispatch=dispatch)
  kw = dict(steps=6, warmup=2, log_every=1, save_every=3, eval_every=3, routing_every=3,
            sample_tokens=0, async_save=False, final_window=3)
  kw.update(train_kw)
  return experiment_config(model, train=kw, data=dict(seq_len=16, batch_size=8, val_batches=1))


def losses(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  return {r['step']: r['loss'] for r in rows}


def logged(caplog, level=logging.WARNING) -> str:
  """What the package logged (its warnings and notes: the scripts print them on stderr as
  `WARNING: ...`/`note: ...`) at `level` or above since the test began or caplog.clear(), one
  message a line."""
  return '\n'.join(r.getMessage() for r in caplog.records
                   if r.name.startswith('loopmoe_jax') and r.levelno >= level)


# The model tests' tiny config ---------------------------------------------------------------

B, T = 2, 6

BASE = dict(vocab_size=37, d_model=16, num_heads=4, expert_width=8, top_k=2,
            prelude_layers=1, prelude_experts=4, core_layers=2, core_experts=4, num_loops=3,
            coda_layers=1, coda_experts=4)


def make_cfg(**kw) -> ModelConfig:
  """The model tests' tiny architecture, the fields `kw` replaced (run settings go to `rt`)."""
  return ModelConfig(**{**BASE, **kw})


def rt(**run) -> Runtime:
  """This machine's runtime with the model tests' run settings (dispatch_tile 8), the run
  settings `run` replaced."""
  return Runtime.of(**{'dispatch_tile': 8, **run})


RT = rt()  # the model tests' runtime


def make(**fields) -> tuple[ModelConfig, Runtime]:
  """(architecture, runtime) of the model tests' tiny model with `fields` replaced, run
  settings (config.RUN_FIELDS) among them."""
  run = {k: fields.pop(k) for k in RUN_FIELDS if k in fields}
  return make_cfg(**fields), rt(**run)


def job_of(cfg: ModelConfig, runtime: Runtime = RT, train: TrainConfig = TrainConfig(),
           seq_len: int = 8, batch_size: int = 8, mesh: MeshConfig = MeshConfig(),
           devices=None) -> Job:
  """The Job of a model config and runtime (its run settings) at these train, data and mesh
  settings, over `devices` (default all)."""
  exp = Experiment(model=cfg, train=train, data=DataConfig(seq_len=seq_len,
                                                            batch_size=batch_size),
                   mesh=mesh, run=runtime.run)
  return Job.build(exp, devices, runtime)


def tokens(cfg, seed=1, batch=B, length=T):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)


def param_shapes(cfg):
  """The model's param tree as shapes, traced with for_init's cheap run settings (the same
  tree: test_model.py::test_init_is_the_same_under_every_dispatch_and_attention)."""
  shapes = jax.eval_shape(lambda: for_init(LoopedMoE(cfg)).init(jax.random.key(0),
                                                                jnp.zeros((1, 4), jnp.int32)))
  return nn.unbox(shapes['params'])


def _fan_in(name, shape):
  if name in ('q', 'k', 'v'):
    return shape[-3]
  if name == 'o':
    return shape[-3] * shape[-2]
  return shape[-2]


@functools.lru_cache(maxsize=None)
def make_params(cfg: ModelConfig, seed: int = 0):
  """Random params with the model's tree, drawn with numpy (no XLA compile of the init)."""
  rng = np.random.default_rng(seed)

  def draw(path, s):
    name = path[-1].key
    if name == 'scale':
      x = 1.0 + 0.3 * rng.standard_normal(s.shape)
    elif name == 'embed':
      x = rng.standard_normal(s.shape)
    else:
      x = rng.standard_normal(s.shape) / np.sqrt(_fan_in(name, s.shape))
    return jnp.asarray(x, s.dtype)

  return jax.tree_util.tree_map_with_path(draw, param_shapes(cfg))


@functools.lru_cache(maxsize=None)
def apply_fn(cfg: ModelConfig, num_loops=None, routing=False, runtime: Runtime = RT):
  model = LoopedMoE(cfg, runtime=runtime)
  return jax.jit(lambda p, t: model.apply({'params': p}, t, num_loops=num_loops,
                                          return_routing=routing))


@functools.lru_cache(maxsize=None)
def decode_step_fn(cfg, num_loops=None, runtime: Runtime = RT):
  """decode_step for `cfg`, jitted once per (config, passes, runtime)."""
  from loopmoe_jax.decode import decode_step  # pylint: disable=import-outside-toplevel
  return jax.jit(functools.partial(decode_step, cfg, num_loops=num_loops, runtime=runtime))


def decode_all(cfg, params, toks, prefix=1, max_len=None, num_loops=None,
               runtime: Runtime = RT):
  """Prefills toks[:, :prefix], then feeds the rest one token at a time into a cache of
  `max_len` (default: the tokens') slots; (logits [B, T, V], final cache)."""
  from loopmoe_jax.decode import init_cache  # pylint: disable=import-outside-toplevel
  cache = init_cache(cfg, toks.shape[0], max_len or toks.shape[1], num_loops)
  step = decode_step_fn(cfg, num_loops, runtime)
  logits, cache = step(params, cache, toks[:, :prefix])
  out = [logits]
  for t in range(prefix, toks.shape[1]):
    logits, cache = step(params, cache, toks[:, t:t + 1])
    out.append(logits)
  return jnp.concatenate(out, axis=1), cache


try:  # the Hugging Face comparisons (test_export*.py); CI installs both (.ci/run)
  import torch
  import transformers
except ImportError:
  torch = transformers = None
needs_torch = pytest.mark.skipif(torch is None, reason='torch and transformers are not '
                                 'installed (pip install torch==2.13.0 transformers==5.24.0)')
