"""`benchmark.py scale`: what scale-out costs, read from compiled programs on 8 devices.

- a2a_bytes_over_analytic: the expert exchange of one MoE layer (data=2 x expert=4, dropless,
  the ragged transport of GPU/TPU, lowered for 'cuda' from this machine): bytes each device
  sends forward (the ragged_all_to_all operand, the M = T*k sorted rows) plus bytes it receives
  back (the return exchange's output, the same M rows), per token, over the analytic
  k * d_model * bytes * 2. 1.0 means the exchange carries the routed rows and nothing else.
- a2a_padded_bytes_over_analytic: the same for the CPU transport (padded all_to_all, the
  compiled program's HLO): n = mesh.expert times the analytic figure when dropless;
  ..._cf1_... with model.capacity_factor=1 (slots of E/n * C rows).
- ep_counts_bytes_per_token: the other collective of the exchange (all_gather of the per-expert
  counts), per token.
- fsdp8_param_bytes_over_replicated: per-device parameter bytes at fsdp=8 over one device's.
- act_allgather_bytes: bytes per step of all-gathers of activations in the EP train step of
  the README's main job at smoke widths (data=2 x expert=4; `dry_run.classify`); 0 expected.
- grad_reduce_bytes_over_one_reduction: gradient-reduction bytes per step of that train step
  at num_loops=4 over the same at num_loops=1 (each shared weight's gradient reduced once
  whatever the passes would give 1.0).
- {tpu,cuda}_act_allgather_bytes, {tpu,cuda}_grad_reduce_bytes_over_one_reduction: the same
  two figures read from the train step compiled by the accelerator's own compiler (aot.py:
  v5p:2x2x2 and 8 x H100, 8 compile-only devices each, data=2 x expert=4, the pod compiler
  preset), where its extra is installed (`real_compilers` says which ran); the keys without a
  prefix are the CPU proxy's (`program`: cpu-proxy).
- step_s_*: train-step time of the README's main job (smoke widths) at a fixed global batch on
  1 device and on meshes of 8 fake CPU devices (informative only: fake devices share 2 cores).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax import aot, dry_run, expert_parallel, sharding, targets
from loopmoe_jax.bench import register, time_interleaved
from loopmoe_jax import DEFAULT_CONFIG
from loopmoe_jax.config import ModelConfig
from loopmoe_jax import hlo as hlo_lib
from loopmoe_jax.hlo import collective_bytes
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.job import Job
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.sharding import MeshConfig
from loopmoe_jax.config.train import TrainConfig

_TENSOR = re.compile(r'tensor<([\dx]+)x(f32|bf16|f16)>')


def _layer_inputs(tokens, d, f, experts, k, dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
  ids = jnp.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]),
                    jnp.int32)
  w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
  params = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), dtype) for n, s in
            (('gate', (experts, d, f)), ('up', (experts, d, f)), ('down', (experts, f, d)))}
  return x, ids, w, params


def _exchange(cfg, mesh, args, exchange: str, platform=None, rows: str = 'assignment'):
  runtime = (Runtime.for_platform(platform) if platform else HERE).with_run(
      dispatch='xla', expert_exchange=exchange, exchange_rows=rows)
  fn = jax.jit(lambda *a: expert_parallel.moe_dispatch(*a, cfg, mesh.abstract_mesh,
                                                               runtime=runtime))
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  with jax.set_mesh(mesh):
    traced = fn.trace(*shapes)
    if platform:
      return traced.lower(lowering_platforms=(platform,)).as_text()
    return traced.lower().compile().as_text()


def _ragged_bytes(stablehlo: str) -> int:
  """Forward operands plus the return's output of the ragged exchanges (the moved rows):
  the last call is the return; by token rows the rows and their routing go out in two."""
  calls = [l for l in stablehlo.splitlines() if 'ragged_all_to_all' in l and '->' in l]
  if len(calls) not in (2, 3):
    raise RuntimeError(f'expected 2 or 3 ragged_all_to_all calls, found {len(calls)}')
  size = lambda dims, dt: int(np.prod([int(v) for v in dims.split('x')])) * (
      4 if dt == 'f32' else 2)
  sent = [_TENSOR.search(c.split(':')[-1]).groups() for c in calls[:-1]]
  back_output = _TENSOR.search(calls[-1].split('->')[-1]).groups()
  return sum(size(*a) for a in sent) + size(*back_output)


def _exchange_ratios(res, quick):
  tokens, d, f, experts, k = (256, 64, 32, 8, 2) if quick else (4096, 512, 256, 16, 2)
  mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
  local_tokens = tokens // sharding.batch_size_of(mesh)
  base = dict(core_experts=experts, top_k=k)
  # bf16 rows for the accelerator program; float32 for the CPU one (XLA:CPU converts bf16
  # collectives to float32, which would double its figures)
  ragged = _exchange(ModelConfig(**base), mesh,
                     _layer_inputs(tokens, d, f, experts, k, jnp.bfloat16), 'ragged', 'cuda')
  res['a2a_bytes_over_analytic'] = _ragged_bytes(ragged) / (local_tokens * k * d * 2 * 2)
  args = _layer_inputs(tokens, d, f, experts, k, jnp.float32)
  analytic = local_tokens * k * d * 4 * 2
  padded = collective_bytes(_exchange(ModelConfig(**base), mesh, args, 'padded'))
  res['a2a_padded_bytes_over_analytic'] = padded['all-to-all'] / analytic
  res['ep_counts_bytes_per_token'] = padded.get('all-gather', 0) / local_tokens
  cf1 = collective_bytes(_exchange(ModelConfig(**base, capacity_factor=1.0), mesh, args,
                                   'padded'))
  res['a2a_padded_cf1_bytes_over_analytic'] = cf1['all-to-all'] / analytic
  # fine-grained (top-7 of 32 over 4 devices): token rows against assignment rows, bf16
  fine = dict(prelude_experts=32, core_experts=32, coda_experts=32, top_k=7)
  args = _layer_inputs(tokens, d, f, 32, 7, jnp.bfloat16)
  got = {rows: _ragged_bytes(_exchange(ModelConfig(**fine), mesh, args, 'ragged', 'cuda', rows))
         for rows in ('assignment', 'token')}
  res['a2a_token_rows_bytes_over_assignment_top7'] = got['token'] / got['assignment']


def _experiment():
  """The README's main job at smoke widths with its run settings, trained at the default
  train settings."""
  return build(load_config(DEFAULT_CONFIG + ':smoke'))._replace(train=TrainConfig())


def _job(exp, mesh_cfg, devices=None) -> Job:
  return Job.build(exp._replace(mesh=mesh_cfg), devices)


def _fsdp_ratio(res, exp):
  got = {}
  for name, mesh_cfg, devices in (('one', MeshConfig(data=1), jax.devices()[:1]),
                                  ('fsdp8', MeshConfig(data=1, fsdp=8), None)):
    job = _job(exp, mesh_cfg, devices)
    got[name] = sharding.bytes_per_device(job.abstract_state['params'], job.state_sh['params'])
  res['fsdp8_param_bytes_over_replicated'] = got['fsdp8'] / got['one']


def _step_times(res, exp, quick):
  batch, seq = exp.data.batch_size, exp.data.seq_len
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, exp.model.vocab_size, (batch, seq + 1), dtype=np.int32)
  data = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  fns = {}
  for name, mesh_cfg, devices in (('1dev', MeshConfig(data=1), jax.devices()[:1]),
                                  ('data8', MeshConfig(data=8), None),
                                  ('data2_expert4', MeshConfig(data=2, expert=4), None)):
    job = _job(exp, mesh_cfg, devices)
    holder = {'state': job.create_state(0)}
    step = job.train_step()
    b = jax.device_put(data, job.batch_sh)

    def run(step=step, holder=holder, b=b):
      holder['state'], m = step(holder['state'], b)
      return m['loss']
    fns[name] = run
  times = time_interleaved(fns, repeats=2 if quick else 5, warmup=1)
  for name, t in times.items():
    res[f'step_s_{name}'] = t
  res['step_ratio_data8_over_1dev'] = times['data8'] / times['1dev']
  res['step_ratio_data2_expert4_over_1dev'] = times['data2_expert4'] / times['1dev']


def _step_collectives(num_loops: int):
  cfg = load_config(DEFAULT_CONFIG + ':smoke')
  cfg.model.num_loops = num_loops
  cfg.mesh.data, cfg.mesh.expert = 2, 4
  job = dry_run.job_of(cfg)
  hlo, _ = dry_run.partitioned_compile(job.train_step().lower(*job.step_args()))
  return dry_run.classify(hlo_lib.collectives(hlo), job.abstract_state['params'])


REAL_TARGETS = {'tpu': 'v5p:2x2x2', 'cuda': 'h100x8'}


def _real_step_collectives(target, num_loops: int):
  cfg = load_config(DEFAULT_CONFIG + ':smoke')
  cfg.model.num_loops = num_loops
  cfg.model.dtype = 'bfloat16'
  cfg.mesh.data, cfg.mesh.expert = 2, 4
  summary, ((state, _), _, _) = aot.compile_summary(cfg, target)
  return dry_run.classify(summary['collectives'], state['params'])


def _real_step_traffic(res):
  import importlib.util  # pylint: disable=import-outside-toplevel
  res['real_compilers'] = {}
  for platform, name in REAL_TARGETS.items():
    if importlib.util.find_spec(targets.EXTRAS[platform][0]) is None:
      res['real_compilers'][platform] = f'not installed ({targets.EXTRAS[platform][1]})'
      continue
    target = targets.get(name)
    one, four = _real_step_collectives(target, 1), _real_step_collectives(target, 4)
    res['real_compilers'][platform] = name
    res[f'{platform}_act_allgather_bytes'] = four['act_allgather']
    res[f'{platform}_grad_reduce_bytes_loops1'] = one['grad_reduce']
    res[f'{platform}_grad_reduce_bytes_loops4'] = four['grad_reduce']
    res[f'{platform}_grad_reduce_bytes_over_one_reduction'] = (four['grad_reduce'] /
                                                              one['grad_reduce'])


def _step_traffic(res):
  one, four = _step_collectives(1), _step_collectives(4)
  res['act_allgather_bytes'] = four['act_allgather']
  res['grad_reduce_bytes_loops1'] = one['grad_reduce']
  res['grad_reduce_bytes_loops4'] = four['grad_reduce']
  res['grad_reduce_bytes_over_one_reduction'] = four['grad_reduce'] / one['grad_reduce']


@register('scale')
def scale(quick: bool):
  if jax.device_count() < 8:
    raise RuntimeError(f'benchmark scale needs 8 devices, found {jax.device_count()}: run it '
                       'with JAX_NUM_CPU_DEVICES=8 on CPU')
  res = {'program': 'cpu-proxy'}
  _exchange_ratios(res, quick)
  _step_traffic(res)
  _real_step_traffic(res)
  exp = _experiment()
  _fsdp_ratio(res, exp)
  _step_times(res, exp, quick)
  res['gpu_train_step'] = None  # needs the accelerator machine (one-GPU MFU: issue of its own)
  return res
