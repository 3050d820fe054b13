"""The train step compiled ahead of time by an accelerator's own compiler, on this CPU: libtpu
for TPU targets, XLA:GPU (the CUDA plugin) for GPU targets, over compile-only devices
(targets.py). Nothing runs; the compiled program's figures are real:

    summary = compile_summary(cfg_dict, targets.get('v5p-128'))
    summary['memory']        # arguments, outputs, aliases, temporaries, code: bytes per device
    summary['collectives']   # hlo.collectives of the compiled, scheduled program

Compiler presets (`PRESETS`, on by default, `--compiler_preset=none` to compare): the flags pods
run with. Each is shown to take effect in the compiled program (tests/test_targets.py counts
the async and overlapped collectives with and without):

| platform | flag | what it does |
|---|---|---|
| tpu | xla_tpu_enable_latency_hiding_scheduler | schedules collectives early, compute between start and done |
| tpu | xla_tpu_enable_async_collective_fusion (+ _fuse_all_gather, _multiple_steps) | runs a collective inside a fusion beside compute |
| tpu | xla_tpu_overlap_compute_collective_tc | lets the TensorCore compute while a collective is in flight |
| tpu | xla_enable_async_all_gather, xla_enable_async_collective_permute | start/done pairs for those |
| tpu | xla_tpu_enable_async_all_to_all, xla_tpu_enable_async_ragged_all_to_all | start/done pairs for the expert exchange, so compute can run while it is in flight |
| tpu | xla_tpu_enable_data_parallel_all_reduce_opt (+ _different_sized_ops) | overlaps gradient all-reduces with the backward |
| cuda | xla_gpu_enable_latency_hiding_scheduler | schedules compute between collective start and done |
| cuda | xla_gpu_enable_pipelined_all_gather / _reduce_scatter / _all_reduce | pipelines loop collectives with the next iteration |
| cuda | xla_gpu_enable_while_loop_double_buffering | double-buffers loop-carried collective buffers |
| cuda | xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes = 128 MiB | fewer, larger NCCL calls |

Summaries are kept on disk (`cache_dir`, default ~/.cache/loopmoe_jax/compiles; env
LOOPMOE_COMPILE_CACHE) under a hash of the lowered program, the target and the mesh's device
order, the compiler options, XLA_FLAGS / LIBTPU_INIT_ARGS, the compiler's version and
`SUMMARY_VERSION` (what a summary holds): the same program is compiled once (a rerun of the fit
finder reads them back).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import tempfile
import time

import jax

from loopmoe_jax import dry_run, hlo, sharding, targets
from loopmoe_jax.experiment import build
from loopmoe_jax.job import Job
from loopmoe_jax.runtime import Runtime
from loopmoe_jax.train import compile_cache
from pallas_kernels import capability

log = logging.getLogger(__name__)
_NOTED = set()

PRESETS = {
    'tpu': {'xla_tpu_enable_latency_hiding_scheduler': True,
            'xla_tpu_enable_async_collective_fusion': True,
            'xla_tpu_enable_async_collective_fusion_fuse_all_gather': True,
            'xla_tpu_enable_async_collective_fusion_multiple_steps': True,
            'xla_tpu_overlap_compute_collective_tc': True,
            'xla_enable_async_all_gather': 'true',
            'xla_enable_async_collective_permute': 'true',
            'xla_tpu_enable_async_all_to_all': True,
            'xla_tpu_enable_async_ragged_all_to_all': True,
            'xla_tpu_enable_data_parallel_all_reduce_opt': True,
            'xla_tpu_data_parallel_opt_different_sized_ops': True},
    'cuda': {'xla_gpu_enable_latency_hiding_scheduler': True,
             'xla_gpu_enable_pipelined_all_gather': True,
             'xla_gpu_enable_pipelined_reduce_scatter': True,
             'xla_gpu_enable_pipelined_all_reduce': True,
             'xla_gpu_enable_while_loop_double_buffering': True,
             'xla_gpu_all_reduce_combine_threshold_bytes': 134217728,
             'xla_gpu_all_gather_combine_threshold_bytes': 134217728,
             'xla_gpu_reduce_scatter_combine_threshold_bytes': 134217728},
}
PRESET_NAMES = ('pod', 'none')
SUMMARY_VERSION = 1  # raise when `summarize` or hlo.collectives reads a program differently
# the custom calls of each platform's kernels, as the compiled program names them
KERNEL_CALLS = {'tpu': {'mosaic': 'tpu_custom_call'},
                'cuda': {'triton': '__gpu$xla.gpu.triton', 'mosaic_gpu': 'mosaic_gpu',
                         'cudnn_attention': '__cudnn$fmha'}}


def target_for(name: str | None, preset: str = 'pod', kernel_family: str | None = None
               ) -> targets.Target:
  """The target a script compiles for (--target), its compiler, preset and --kernel_family
  checked before anything is built: each miss one line naming the flag or the pip command."""
  if not name:
    raise ValueError('--target is required (e.g. v5p-128, h200x8, rtx4090x1)')
  target = targets.with_kernel_family(targets.get(name), kernel_family)
  targets.check_extra(target.platform)
  compiler_options(target.platform, preset)
  kernel_runtime(target)
  return target


def kernel_runtime(target: targets.Target) -> Runtime:
  """Runtime.for_platform(target's) with the Pallas kernels its chip runs (a GPU: by compute
  capability, pallas_kernels/capability.py; none: `auto` dispatch takes XLA), or the target's
  kernel_family where the chip runs it; said once per target (a note; XLA: a warning)."""
  runtime = Runtime.for_platform(target.platform)
  cc, family = target.chip.compute_capability, target.kernel_family
  if cc is None and family not in (None, 'tpu'):
    raise ValueError(f"--kernel_family={family}: target {target.name} is a TPU: use 'tpu'")
  if cc is None:
    return runtime.replace(kernel_family=family)
  gpu_families = sorted(capability.MIN_CC)
  if family is not None and family not in gpu_families:
    raise ValueError(f'--kernel_family={family}: target {target.name} is a GPU: one of '
                     f'{", ".join(gpu_families)}')
  tiles, why_not, line = capability.plan(cc, family)
  if (target.name, family) not in _NOTED:  # once per target and choice
    _NOTED.add((target.name, family))
    (log.warning if why_not else log.info)(f'{target.name} kernels, {line}')
  runtime = runtime.with_tiles(tiles) if tiles else runtime
  return runtime.replace(pallas_check=why_not) if why_not else runtime


def compiler_options(platform: str, preset: str = 'pod') -> dict:
  if preset not in PRESET_NAMES:
    raise ValueError(f'--compiler_preset={preset!r}: must be one of {", ".join(PRESET_NAMES)}')
  return dict(PRESETS.get(platform, {})) if preset == 'pod' else {}


def cache_dir() -> str:
  return os.environ.get('LOOPMOE_COMPILE_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'loopmoe_jax', 'compiles')


def _compiler_version(platform: str) -> str:
  dist = {'tpu': 'libtpu', 'cuda': 'jax-cuda12-plugin'}[platform]
  try:
    return f'{dist} {importlib.metadata.version(dist)}'
  except importlib.metadata.PackageNotFoundError:
    return dist


def lower_step(cfg_dict, target: targets.Target):
  """(lowered train step, (state, batch), mesh, experiment) for `target`: the mesh over its
  compile-only devices, the kernels, dispatch and exchange its platform picks (Pallas kernels
  compiled, not interpreted)."""
  runtime = kernel_runtime(target)
  try:  # a setting the target cannot run (attention_impls.check, dispatch), a mesh
    job = Job.build(build(cfg_dict), target.devices(), runtime)
    args = job.step_args()
    return job.train_step().lower(*args), args, job.mesh, job.exp
  except ValueError as e:
    raise ValueError(f'target {target.name}: {e}') from e


def summarize(compiled, platform: str) -> dict:
  """What the project reads of a compiled program: memory per device, collectives, kernel
  calls, the compiler's FLOPs (None where it reports none)."""
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else None) if isinstance(cost, list) else cost
  memory = {'arguments': int(mem.argument_size_in_bytes), 'outputs': int(mem.output_size_in_bytes),
            'aliases': int(mem.alias_size_in_bytes), 'temporaries': int(mem.temp_size_in_bytes),
            'code': int(mem.generated_code_size_in_bytes)}
  memory['total'] = (memory['arguments'] + memory['outputs'] - memory['aliases'] +
                     memory['temporaries'] + memory['code'])
  return {'memory': memory, 'collectives': hlo.collectives(text),
          'flops': float(cost['flops']) if cost and cost.get('flops') else None,
          'kernel_calls': {k: text.count(f'custom_call_target="{v}')
                           for k, v in KERNEL_CALLS.get(platform, {}).items()},
          'ragged_all_to_all': text.count(' ragged-all-to-all(') +
                               text.count(' ragged-all-to-all-start(')}


# libtpu refuses a program whose temporaries exceed the chip's memory (XLA:GPU returns it):
# "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
# (139.80G) exceeds available HBM (95.74G)."
_REFUSED = re.compile(r'HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM '
                      r'\(([\d.]+)([KMGT]?)\)')
_UNITS = {'': 1, 'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}


def refusal(error: BaseException) -> dict | None:
  """{'temporaries', 'available'} (bytes) when `error` is the compiler refusing a program for
  its memory, else None."""
  m = _REFUSED.search(str(error))
  size = lambda value, unit: int(float(value) * _UNITS[unit])
  return m and {'temporaries': size(m.group(1), m.group(2)),
                'available': size(m.group(3), m.group(4))}


def _refused_summary(error: BaseException, refused: dict, args) -> dict:
  """A summary of a program the compiler refused: its arguments (the state and batch this
  device holds) and the temporaries the compiler asked for; nothing else was compiled."""
  arguments = sharding.bytes_per_device(args, jax.tree.map(lambda s: s.sharding, args))
  memory = {'arguments': arguments, 'outputs': 0, 'aliases': 0,
            'temporaries': refused['temporaries'], 'code': 0,
            'total': arguments + refused['temporaries']}
  return {'memory': memory, 'collectives': [], 'flops': None, 'kernel_calls': {},
          'ragged_all_to_all': 0, 'refused': (str(error).strip().splitlines() or [''])[0][:300],
          'compiler_available_bytes': refused['available']}


def compile_summary(cfg_dict, target: targets.Target, preset: str = 'pod',
                    use_cache: bool = True):
  """(`summarize` of the config's train step compiled for `target` with 'compile_s', 'cached'
  and 'options', (abstract state and batch, mesh, experiment)); the summary is read from the
  cache (module docstring) when the same program was compiled before. A program the compiler
  refuses for its memory gives a summary with 'refused' (the compiler's line) and the bytes it
  asked for, not an error."""
  options = compiler_options(target.platform, preset)
  start = time.perf_counter()
  lowered, args, mesh, exp = lower_step(cfg_dict, target)
  lower_s = time.perf_counter() - start
  key = hashlib.sha256('\n'.join([
      str(SUMMARY_VERSION), lowered.as_text(), target.name,
      ','.join(str(d.id) for d in mesh.devices.flat), json.dumps(options, sort_keys=True),
      jax.__version__, _compiler_version(target.platform),
      *(f'{k}={os.environ.get(k, "")}' for k in ('XLA_FLAGS', 'LIBTPU_INIT_ARGS'))
  ]).encode()).hexdigest()[:32]
  path = os.path.join(cache_dir(), f'{key}.json')
  if use_cache and os.path.exists(path):
    with open(path) as f:
      out = json.load(f)
    out.update(cached=True, lower_s=round(lower_s, 1))
    return out, (args, mesh, exp)
  start = time.perf_counter()
  try:
    with compile_cache.off():
      out = summarize(lowered.compile(options), target.platform)
  except Exception as e:  # pylint: disable=broad-except
    refused = refusal(e)
    if refused is None:
      raise
    out = _refused_summary(e, refused, args)
  out.update(compile_s=round(time.perf_counter() - start, 1), lower_s=round(lower_s, 1),
             options=options, compiler=_compiler_version(target.platform), cached=False)
  if use_cache:
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.NamedTemporaryFile('w', dir=cache_dir(), delete=False, suffix='.tmp') as f:
      json.dump(out, f)
    os.replace(f.name, path)
  return out, (args, mesh, exp)


def target_report(cfg_dict, target: targets.Target, preset: str = 'pod',
                  use_cache: bool = True) -> dict:
  """The dry run on `target`'s real compiler (scripts/dry_run.py --target): bytes per device
  from the compiled program against the target's memory, the compiled program's collectives
  (bytes per step, async and overlapped ops), FLOPs and lower bounds of communication and
  compute time per step, beside the parameter accounting of the CPU dry run."""
  summary, ((state, _), mesh, exp) = compile_summary(cfg_dict, target, preset, use_cache)
  if summary.get('refused'):
    return refused_report(summary, target, mesh, exp)
  mem, hbm = summary['memory'], target.hbm_bytes_per_device
  colls = summary['collectives']
  coll_bytes = hlo.collective_bytes(colls)
  kinds = dry_run.classify(colls, state['params'])
  flops, analytic_f = dry_run.step_flops(cfg_dict, mesh.size), dry_run.analytic_flops(exp, mesh)
  per_dev = lambda tree: sharding.bytes_per_device(tree, jax.tree.map(lambda s: s.sharding, tree))
  compute_s = analytic_f / target.peak_flops_per_device
  report = {
      'target': target.name, 'compiler': target.platform, 'devices': mesh.size,
      'platform': target.platform, 'device_kind': target.devices()[0].device_kind,
      'mesh': {a: int(n) for a, n in mesh.shape.items()},
      'hbm_bytes_per_device': hbm,
      'bytes_per_device': {k: mem[k] for k in ('arguments', 'outputs', 'aliases',
                                               'temporaries', 'code', 'total')},
      'fits': mem['total'] <= hbm, 'headroom_bytes': hbm - mem['total'],
      'hbm_fraction': round(mem['total'] / hbm, 4),
      'collectives': coll_bytes, 'collective_ops': hlo.collective_ops(colls),
      'params_bytes_total': sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(state['params'])),
      'params_bytes_per_device': per_dev(state['params']),
      'params_bytes_per_device_by_group': dry_run.param_groups(state['params']),
      'opt_state_bytes_per_device': per_dev(state['opt_state']),
      'temp_bytes_per_device': mem['temporaries'],
      'temp_bytes_program': f'{target.platform} compiler for {target.name} ({summary["compiler"]})',
      'flops_per_step_per_device': flops,
      'analytic_flops_per_step_per_device': analytic_f,
      'flops_over_analytic': round(flops / analytic_f, 4),
      'compiled_flops_per_step_per_device': summary['flops'],
      'compiled_flops_over_analytic': (round(summary['flops'] / analytic_f, 4)
                                       if summary['flops'] else None),
      'remat': exp.run.remat, 'attention_impl': exp.run.attention_impl,
      'collective_bytes_per_step': coll_bytes,
      'collective_bytes_program': f'{target.platform}, compiled and scheduled',
      'act_allgather_bytes_per_step': kinds['act_allgather'],
      'param_allgather_bytes_per_step': kinds['param_allgather'],
      'grad_reduce_bytes_per_step': kinds['grad_reduce'],
      'grad_reduce_ops_per_step': kinds['grad_reduce_ops'],
      'analytic_collective_bytes_per_step': dry_run.analytic(exp, mesh, state['params']),
      'lowered_for': {'platform': target.platform,
                      'custom_calls': sum(summary['kernel_calls'].values()),
                      'kernel_calls': summary['kernel_calls'],
                      'ragged_all_to_all': summary['ragged_all_to_all']},
      'batch': [exp.data.batch_size, exp.data.seq_len], 'expert_exchange': 'ragged',
      # lower bounds: every collective byte over one direction of the chip's links, the
      # analytic FLOPs at peak; neither overlaps nor contention counted
      'time_bounds_s': time_bounds(colls, compute_s, target),
      'compile_s': summary['compile_s'], 'lower_s': summary['lower_s'],
      'cached': summary['cached'], 'compiler_options': summary['options'],
  }
  if not report['fits']:
    report['advice'] = advice(exp, mesh, mem['total'] - hbm)
  return report


def time_bounds(colls, compute_s: float, target: targets.Target) -> dict:
  """Seconds per step: `communication` (every collective byte over one direction of the
  chip's links) and `compute` (the analytic FLOPs at peak), lower bounds that count no overlap
  or contention; `latency` (every op's fixed time, targets' per-op figure); `exposed` (the
  bytes and latency of the ops the compiled program does not overlap with compute); and
  `estimated_step`: the larger of compute and the overlapped ops' time, plus the exposed."""
  link = target.chip.ici_bytes_per_s / target.devices_per_chip
  op_s = target.chip.collective_latency_s
  if not op_s:
    raise ValueError(f'target {target.name}: its chip {target.chip.name!r} has no '
                     'collective_latency_s in loopmoe_jax/targets.py CHIPS')
  cost = lambda c: c['times'] * (c['bytes'] / link + op_s)
  comm_s = sum(c['times'] * c['bytes'] for c in colls) / link
  overlapped = sum(cost(c) for c in colls if c['overlapped'])
  exposed = sum(cost(c) for c in colls if not c['overlapped'])
  return {'communication': comm_s, 'compute': compute_s,
          'communication_over_compute': round(comm_s / compute_s, 4),
          'latency': sum(c['times'] for c in colls) * op_s, 'exposed': exposed,
          'estimated_step': max(compute_s, overlapped) + exposed}


def refused_report(summary: dict, target: targets.Target, mesh, exp) -> dict:
  """The dry run's report of a program the compiler refused for its memory: what it would
  need per device (the state and batch it holds plus the temporaries the compiler asked for),
  `fits` false, and the advice; no collectives or bounds (nothing was compiled)."""
  mem, hbm = summary['memory'], target.hbm_bytes_per_device
  return {'target': target.name, 'compiler': target.platform, 'devices': mesh.size,
          'platform': target.platform, 'mesh': {a: int(n) for a, n in mesh.shape.items()},
          'hbm_bytes_per_device': hbm, 'bytes_per_device': mem, 'fits': False,
          'headroom_bytes': hbm - mem['total'], 'hbm_fraction': round(mem['total'] / hbm, 4),
          'refused': summary['refused'], 'advice': advice(exp, mesh, mem['total'] - hbm),
          'change_first': change_first(exp, mesh),
          'remat': exp.run.remat, 'attention_impl': exp.run.attention_impl,
          'batch': [exp.data.batch_size, exp.data.seq_len],
          'compile_s': summary.get('compile_s'), 'lower_s': summary.get('lower_s'),
          'cached': summary['cached']}


def does_not_fit(report: dict) -> str:
  """One line for a program its target's compiler refused for memory (`refused_report`):
  what it needs per device, of how much, over by how much, and what to change."""
  gib = lambda b: f'{b / 2**30:,.2f} GiB'
  total, hbm = report['bytes_per_device']['total'], report['hbm_bytes_per_device']
  return (f"the train step does not fit {report['target']} (its compiler refused it): it needs "
          f"{gib(total)} of {gib(hbm)} per device (over by {gib(total - hbm)}); change "
          f"{report['change_first']} first, let scripts/fit.py search remat, microbatches and "
          'loss chunk, or try scripts/plan.py to search the mesh too')


def advice(exp, mesh, over: int) -> str:
  """What does not fit, by how much, and the setting the fit finder changes first."""
  return (f'does not fit: {over / 2**30:,.2f} GiB over the device memory; '
          f'scripts/fit.py would change {change_first(exp, mesh)} first')


def change_first(exp, mesh) -> str:
  """The setting the fit finder changes first for a step that does not fit."""
  per_shard = exp.data.batch_size // sharding.batch_size_of(mesh)
  return ('run.remat (attention, pass_input or full)' if exp.run.remat == 'none' else
          'train.microbatches' if exp.train.microbatches < per_shard else
          'data.batch_size or the mesh')


def candidate(cfg_dict, target: targets.Target, settings: dict, preset: str = 'pod',
              use_cache: bool = True, flops: int | None = None) -> dict:
  """One row of a policy table, the fit finder or the planner: the config with `settings`
  ({'run.remat': ..., 'train.microbatches': ..., 'data.batch_size': ...}) compiled for
  `target`: bytes per device, fit, time bounds (`time_bounds`; None for a program the compiler
  refused), matmul FLOPs per device (`flops`, else dry_run.step_flops: the step lowered for
  one device)."""
  cfg = with_settings(cfg_dict, settings)
  summary, (_, mesh, exp) = compile_summary(cfg, target, preset, use_cache)
  mem = summary['memory']
  compute_s = dry_run.analytic_flops(exp, mesh) / target.peak_flops_per_device
  bounds = None if summary.get('refused') else time_bounds(summary['collectives'], compute_s,
                                                           target)
  return {'run': dict(settings), 'bytes_per_device': mem,
          'refused': bool(summary.get('refused')), 'time_bounds_s': bounds,
          'temp_bytes_per_device': mem['temporaries'],
          'fits': mem['total'] <= target.hbm_bytes_per_device,
          'hbm_fraction': round(mem['total'] / target.hbm_bytes_per_device, 4),
          'flops_per_step_per_device': (flops := flops or dry_run.step_flops(cfg, mesh.size)),
          'analytic_flops_per_step_per_device': (analytic := dry_run.analytic_flops(exp, mesh)),
          'flops_over_analytic': round(flops / analytic, 4),
          'batch_per_device': exp.data.batch_size // sharding.batch_size_of(mesh),
          'compile_s': summary.get('compile_s'), 'cached': summary['cached']}


def with_settings(cfg_dict, settings: dict):
  """A copy of the config with dotted keys set ('run.remat', 'data.batch_size', ...)."""
  cfg = cfg_dict.copy_and_resolve_references()
  for key, value in settings.items():
    section, _, field = key.partition('.')
    if section not in cfg or field not in cfg[section]:
      raise ValueError(f'setting {key!r}: the config has no such key')
    cfg[section][field] = value
  return cfg
