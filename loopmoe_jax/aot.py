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
import os
import tempfile
import time

import jax

from loopmoe_jax import dry_run, hlo, sharding, targets
from loopmoe_jax.experiment import build
from loopmoe_jax.job import Job
from loopmoe_jax.runtime import Runtime
from loopmoe_jax.train import compile_cache

PRESETS = {
    'tpu': {'xla_tpu_enable_latency_hiding_scheduler': True,
            'xla_tpu_enable_async_collective_fusion': True,
            'xla_tpu_enable_async_collective_fusion_fuse_all_gather': True,
            'xla_tpu_enable_async_collective_fusion_multiple_steps': True,
            'xla_tpu_overlap_compute_collective_tc': True,
            'xla_enable_async_all_gather': 'true',
            'xla_enable_async_collective_permute': 'true',
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
  try:
    job = Job.build(build(cfg_dict), target.devices(), Runtime.for_platform(target.platform))
  except ValueError as e:  # a setting the target cannot run (attention_impls.check), a mesh it refuses
    raise ValueError(f'target {target.name}: {e}') from None
  args = job.step_args()
  return job.train_step().lower(*args), args, job.mesh, job.exp


def summarize(compiled, platform: str) -> dict:
  """What the project reads of a compiled program: memory per device, collectives, kernel
  calls, the compiler's FLOPs (None where it reports none)."""
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0] if cost else None
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


def compile_summary(cfg_dict, target: targets.Target, preset: str = 'pod',
                    use_cache: bool = True):
  """(`summarize` of the config's train step compiled for `target` with 'compile_s', 'cached'
  and 'options', (abstract state and batch, mesh, experiment)); the summary is read from the
  cache (module docstring) when the same program was compiled before."""
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
  with compile_cache.off():
    compiled = lowered.compile(options)
  out = summarize(compiled, target.platform)
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
  mem, hbm = summary['memory'], target.hbm_bytes_per_device
  colls = summary['collectives']
  coll_bytes = hlo.collective_bytes(colls)
  kinds = dry_run.classify(colls, state['params'])
  flops, analytic_f = dry_run.step_flops(cfg_dict, mesh.size), dry_run.analytic_flops(exp, mesh)
  per_dev = lambda tree: sharding.bytes_per_device(tree, jax.tree.map(lambda s: s.sharding, tree))
  comm_s = sum(coll_bytes.values()) / (target.chip.ici_bytes_per_s / target.devices_per_chip)
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
      'time_bounds_s': {'communication': comm_s, 'compute': compute_s,
                        'communication_over_compute': round(comm_s / compute_s, 4)},
      'compile_s': summary['compile_s'], 'lower_s': summary['lower_s'],
      'cached': summary['cached'], 'compiler_options': summary['options'],
  }
  if not report['fits']:
    report['advice'] = advice(exp, mesh, mem['total'] - hbm)
  return report


def advice(exp, mesh, over: int) -> str:
  """What does not fit, by how much, and the setting the fit finder changes first."""
  per_shard = exp.data.batch_size // sharding.batch_size_of(mesh)
  first = ('run.remat (attention, pass_input or full)' if exp.run.remat == 'none' else
           'train.microbatches' if exp.train.microbatches < per_shard else
           'data.batch_size or the mesh')
  return (f'does not fit: {over / 2**30:,.2f} GiB over the device memory; '
          f'scripts/fit.py would change {first} first')


def candidate(cfg_dict, target: targets.Target, settings: dict, preset: str = 'pod',
              use_cache: bool = True, flops: int | None = None) -> dict:
  """One row of a policy table or the fit finder: the config with `settings` ({'run.remat':
  ..., 'train.microbatches': ..., 'data.batch_size': ...}) compiled for `target`: bytes per
  device, fit, matmul FLOPs per device (`flops`, else dry_run.step_flops: the step lowered for
  one device)."""
  cfg = with_settings(cfg_dict, settings)
  summary, (_, mesh, exp) = compile_summary(cfg, target, preset, use_cache)
  mem = summary['memory']
  return {'run': dict(settings), 'bytes_per_device': mem,
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


def target_table(report: dict) -> str:
  """The target-specific lines of the dry run's printout."""
  gib = lambda b: f'{b / 2**30:,.3f} GiB'
  b = report['bytes_per_device']
  rows = [('target', f"{report['target']}: {report['devices']} x {report['device_kind']}, "
                     f"{report['temp_bytes_program']}, compile {report['compile_s']} s"
                     + (' (cached)' if report['cached'] else '')),
          ('bytes / device', ', '.join(f'{k} {gib(b[k])}' for k in
                                       ('arguments', 'outputs', 'aliases', 'temporaries', 'code'))),
          ('total / device', f"{gib(b['total'])} of {gib(report['hbm_bytes_per_device'])} "
                             f"({100 * report['hbm_fraction']:.1f}%): "
                             + ('fits' if report['fits'] else report['advice']))]
  for kind, ops in report['collective_ops'].items():
    rows.append((f'{kind} / step', f"{gib(report['collectives'].get(kind, 0))} in {ops['ops']} ops, "
                 f"{ops['async']} async, {ops['overlapped']} overlapping compute"))
  tb = report['time_bounds_s']
  rows.append(('time bounds / step', f"communication >= {tb['communication'] * 1e3:.4g} ms, "
               f"compute >= {tb['compute'] * 1e3:.4g} ms (ratio "
               f"{tb['communication_over_compute']:.3g}; links and peak FLOP/s, no overlap)"))
  if report['compiled_flops_over_analytic']:
    rows.append(('compiled FLOPs / analytic', f"{report['compiled_flops_over_analytic']:.3f} "
                 '(custom calls not counted)'))
  rows.append(('kernels compiled', ', '.join(f'{k} {n}' for k, n in
                                             report['lowered_for']['kernel_calls'].items())))
  width = max(len(r[0]) for r in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)
