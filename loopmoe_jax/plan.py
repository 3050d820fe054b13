"""The planner: how a config's devices split between the mesh axes, with the run settings that
change memory and not results, ranked by the estimated step time of real compiles for a target.

    candidates, best = plan(cfg_dict, targets.get('v5p-128'))

Every split of the target's devices over data x fsdp x expert x tensor is a candidate mesh.
One the model or the batch cannot take (experts, heads or widths that do not divide, a batch
that does not split over the batch axes) is a row saying why, never an error. The others are
screened without compiling: their memory floor (train/preflight.py's estimate with the mesh's
shardings) against the device's memory, and an analytic step time (the train FLOPs at peak,
plus the analytic exchange, gradient-reduction, weight-gather and tensor-reduction bytes over
the links). The `compile_meshes`
best by that estimate are compiled: for each the fit finder (fit.find) searches remat,
microbatches and loss chunk cheapest first, the exchange's streams and the small params'
layout (PLAN_SEARCH), a
candidate the compiler refuses being a row that does not fit; the mesh's plan is its cheapest fitting candidate, whose compiled program gives
the estimated step time (aot.time_bounds). The best plan is the fitting one of least estimated
step time.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax import aot, dry_run, fit, sharding, targets
from loopmoe_jax.experiment import build
from loopmoe_jax.job import Job
from loopmoe_jax.runtime import Runtime
from loopmoe_jax.train import preflight

MESH_AXES = ('data', 'fsdp', 'expert', 'tensor')
# the fit finder's search plus the exchange's streams and small params whole (16 MiB), ranked
# by estimated step (fit.find)
PLAN_SEARCH = {**fit.SEARCH, 'run.exchange_streams': (1, 2), 'run.min_shard_bytes': (0, 1 << 24)}


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def meshes(num_devices: int, max_tensor: int = 8) -> list[dict[str, int]]:
  """Every split of `num_devices` over data x fsdp x expert x tensor (tensor at most
  `max_tensor`: heads and expert widths split within a node or a torus axis)."""
  out = []
  for expert in _divisors(num_devices):
    for tensor in [t for t in _divisors(num_devices // expert) if t <= max_tensor]:
      rest = num_devices // expert // tensor
      for fsdp in _divisors(rest):
        out.append({'data': rest // fsdp, 'fsdp': fsdp, 'expert': expert, 'tensor': tensor})
  return out


def _with_mesh(cfg_dict, mesh: dict):
  return aot.with_settings(cfg_dict, {f'mesh.{a}': n for a, n in mesh.items()})


def screen(cfg_dict, target: targets.Target, mesh: dict) -> dict:
  """A mesh's row before any compile: why it cannot run ('skipped'), or its memory floor per
  device, whether that floor fits, and the analytic step time (seconds)."""
  row = {'mesh': dict(mesh), 'run': {}, 'train': {}, 'fits': None, 'bytes_per_device': None,
         'estimated_step_s': None, 'compute_s': None}
  try:
    job = Job.build(build(_with_mesh(cfg_dict, mesh)), target.devices(),
                    Runtime.for_platform(target.platform))
    state = job.abstract_state
  except ValueError as e:  # experts, heads, widths or the batch do not divide
    return dict(row, skipped=str(e).splitlines()[0])
  est = preflight.estimate(job.exp, job.mesh, state)
  floor = est['params'] + est['optimizer'] + est['gradients'] + est['activations']
  compute_s = dry_run.analytic_flops(job.exp, job.mesh) / target.peak_flops_per_device
  moved = dry_run.analytic(job.exp, job.mesh, state['params'])
  link = target.chip.ici_bytes_per_s / target.devices_per_chip
  extra = weight_gathers(state['params'], job.state_sh['params']) + tensor_reductions(job.exp,
                                                                                   job.mesh)
  analytic_s = compute_s + (moved['all-to-all'] + moved['grad-reduce'] + extra) / link
  return dict(row, compute_s=compute_s, floor_bytes=int(floor),
              floor_fits=floor <= target.hbm_bytes_per_device, analytic_step_s=analytic_s)


def weight_gathers(params, shardings) -> int:
  """Bytes a device gathers of the weights split over the batch axes (fsdp, and dense
  weights' expert split), twice a step (forward and backward): each weight's whole, less its
  expert split where its experts are (those stay), less what the device holds."""
  total = 0
  for p, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    held = math.prod(sh.shard_shape(p.shape))
    first = sh.spec[0] if len(sh.spec) else None
    experts = 'expert' in (first if isinstance(first, tuple) else (first,)) and p.ndim == 3
    whole = math.prod(p.shape) // (sh.mesh.shape['expert'] if experts else 1)
    total += 2 * (whole - held) * p.dtype.itemsize
  return total


def tensor_reductions(exp, mesh) -> int:
  """Bytes a device reduces over `tensor` a step: each executed layer's attention and
  feed-forward outputs ([its tokens, d_model] in the compute dtype), forward and backward."""
  n = mesh.shape['tensor']
  if n == 1:
    return 0
  m = exp.model
  tokens = exp.data.batch_size * exp.data.seq_len // sharding.batch_size_of(mesh)
  act = np.dtype(jnp.dtype(m.dtype)).itemsize
  return int(2 * 2 * m.executed_layers * tokens * m.d_model * act * 2 * (n - 1) / n)


def _planned(row: dict, cfg_dict, target, search, preset, log) -> dict:
  """The mesh's row after the fit finder: its cheapest fitting candidate's settings, bytes
  and estimated step time, or fits false when none fits."""
  try:
    rows, best = fit.find(_with_mesh(cfg_dict, row['mesh']), target, search, preset, log=log)
  except ValueError as e:  # no searched setting divides the batch over this mesh
    return dict(row, skipped=str(e).splitlines()[0])
  if best is None:
    tried = [r for r in rows if r['bytes_per_device']]
    least = min(tried, key=lambda r: r['bytes_per_device']['total'])
    return dict(row, fits=False, bytes_per_device=least['bytes_per_device'],
                refused=least.get('refused', False))
  got = rows[best]
  return dict(row, fits=True, bytes_per_device=got['bytes_per_device'],
              run={k: v for k, v in got['run'].items() if not k.startswith('train.')},
              train={k: v for k, v in got['run'].items() if k.startswith('train.')},
              estimated_step_s=got['time_bounds_s']['estimated_step'],
              time_bounds_s=got['time_bounds_s'])


def plan(cfg_dict, target: targets.Target, search: dict | None = None, preset: str = 'pod',
         compile_meshes: int = 3, log=print):
  """(candidate rows, index of the best or None): every mesh screened (module docstring), the
  `compile_meshes` best by the analytic estimate planned by real compiles."""
  search = dict(PLAN_SEARCH if search is None else search)
  rows = [screen(cfg_dict, target, m) for m in meshes(target.num_devices)]
  for r in rows:
    log(line(r))
  ready = sorted((i for i, r in enumerate(rows) if r.get('floor_fits')),
                 key=lambda i: rows[i]['analytic_step_s'])
  for i in ready[:compile_meshes]:
    rows[i] = _planned(rows[i], cfg_dict, target, search, preset, lambda _: None)
    log(line(rows[i]))
  fitting = [i for i, r in enumerate(rows) if r['fits']]
  best = min(fitting, key=lambda i: rows[i]['estimated_step_s']) if fitting else None
  return rows, best


def line(row: dict) -> str:
  """One row of the planner's table."""
  mesh = ' x '.join(f'{a}={n}' for a, n in row['mesh'].items() if n > 1) or 'one device'
  if row.get('skipped'):
    return f'{mesh:<40} skipped: {row["skipped"]}'
  if row['fits'] is None:
    floor = f'floor {row["floor_bytes"] / 2**30:,.2f} GiB'
    verdict = 'analytic' if row['floor_fits'] else 'does not fit (floor)'
    return (f'{mesh:<40} {floor}, {verdict} step {row["analytic_step_s"] * 1e3:.4g} ms, '
            f'compute {row["compute_s"] * 1e3:.4g} ms (not compiled)')
  total = row['bytes_per_device']['total'] / 2**30
  if not row['fits']:
    return f'{mesh:<40} does not fit: at best {total:,.2f} GiB a device'
  settings = ' '.join(f'{k.split(".")[-1]}={v}' for k, v in {**row['run'], **row['train']}.items())
  return (f'{mesh:<40} {total:,.2f} GiB, estimated step {row["estimated_step_s"] * 1e3:.4g} ms '
          f'= {row["estimated_step_s"] / row["compute_s"]:.3g} x compute; {settings}')


def command(config: str, overrides: list[str], row: dict) -> str:
  """The train command of a planned row: the config as given, its mesh and settings."""
  flags = [*overrides, *(f'--config.mesh.{a}={n}' for a, n in row['mesh'].items()),
           *(f'--config.{k}={v}' for k, v in {**row['run'], **row['train']}.items())]
  return ' '.join(['python scripts/train.py', f'--config={config}', *flags])

