"""The fit finder: the run settings that change memory and not results (remat policy,
microbatches, loss chunk, attention implementation) and the per-device batch, searched by real
compiles for an accelerator target (aot.py), cheapest first.

    rows, best = find(cfg_dict, targets.get('h200x8'), SEARCH)

Each candidate's matmul FLOPs per step (dry_run.step_flops: a trace, no compile) orders the
search: candidates are compiled from the cheapest (fewest FLOPs; then fewer microbatches, a
larger loss chunk, the config's own attention) until one fits the device's memory; that one is
`best`, unless a candidate differing from it only in the expert exchange's settings
and the parameters' layout (STEP_KEYS: the same FLOPs, compiled next), or in a remat policy
with the same recompute (REMAT_TWINS: full_keep_exchange beside full), fits with a shorter
estimated step (aot.time_bounds). `exhaustive` compiles every candidate. Compiles are kept
on disk (aot.compile_summary), so a rerun reads them back. A per-device batch other than the
config's changes what is trained (the global batch) and is searched only when asked
(`data.batch_size` values given per device).
"""
from __future__ import annotations

import itertools
import math

from loopmoe_jax import aot, dry_run, sharding, targets
from loopmoe_jax.config import REMAT_TWINS
from loopmoe_jax.experiment import build

# the default search: keys that change memory only, each with the values tried
SEARCH = {'run.remat': ('none', 'attention', 'pass_input', 'full', 'full_keep_exchange'),
          'train.microbatches': (1, 2, 4),
          'run.loss_chunk': (8192, 2048)}  # the default chunk, then a smaller one
SEARCHABLE = ('run.remat', 'train.microbatches', 'run.loss_chunk', 'run.attention_impl',
              'data.batch_size_per_device', 'run.exchange_streams', 'run.expert_block_rows',
              'run.exchange_rows', 'run.min_shard_bytes')
# settings that keep the FLOPs and change the step time (the expert exchange's, the params'
# layout): candidates that differ only in these are all compiled once one of them fits, and
# ranked by their estimated step time
STEP_KEYS = ('run.exchange_streams', 'run.exchange_rows', 'run.min_shard_bytes')


def parse_search(items) -> dict[str, tuple]:
  """{'key': values} from 'key=v1,v2' strings (values as ints where they read as ints)."""
  out = {}
  for item in items:
    key, sep, values = item.partition('=')
    if not sep or not values:
      raise ValueError(f'--search {item!r}: expected KEY=V1,V2 (keys: {", ".join(SEARCHABLE)})')
    if key not in SEARCHABLE:
      raise ValueError(f'--search {key!r}: not a setting the fit finder changes; searchable: '
                       f'{", ".join(SEARCHABLE)}')
    out[key] = tuple(int(v) if v.lstrip('-').isdigit() else v for v in values.split(','))
  return out


def candidates(cfg_dict, search: dict, num_devices: int) -> list[dict]:
  """Every combination of the searched values that the config allows (microbatches dividing
  the batch over the batch shards), as dotted settings."""
  exp = build(cfg_dict)
  sizes = exp.mesh.sizes(num_devices)
  shards = math.prod(sizes[a] for a in sharding.BATCH_AXES)
  keys = list(search)
  out = []
  for values in itertools.product(*(search[k] for k in keys)):
    settings = dict(zip(keys, values))
    per_device = settings.pop('data.batch_size_per_device', None)
    batch = per_device * shards if per_device else exp.data.batch_size
    if per_device:
      settings['data.batch_size'] = batch
    micro = settings.get('train.microbatches', exp.train.microbatches)
    if batch % micro or (batch // micro) % shards:
      continue
    out.append(settings)
  return out


def find(cfg_dict, target: targets.Target, search: dict, preset: str = 'pod',
         exhaustive: bool = False, log=print):
  """(rows, index of the best row or None), rows cheapest first: every candidate with its
  FLOPs over remat 'none' at its batch; compiled ones with bytes per device and fit (module
  docstring)."""
  cands = candidates(cfg_dict, search, target.num_devices)
  if not cands:
    raise ValueError('fit finder: no candidate divides the batch over the mesh; search other '
                     'train.microbatches or data.batch_size_per_device values')
  traced = {}

  def flops(settings):  # depends on the remat policy, batch and attention only: one trace each
    key = (_twin(settings), settings.get('data.batch_size'), settings.get('run.attention_impl'))
    if key not in traced:
      traced[key] = dry_run.step_flops(aot.with_settings(cfg_dict, settings), target.num_devices)
    return traced[key]

  default_attention = build(cfg_dict).run.attention_impl
  exp = build(cfg_dict)
  shards = math.prod(exp.mesh.sizes(target.num_devices)[a] for a in sharding.BATCH_AXES)
  rows = []
  for settings in cands:
    exp = build(aot.with_settings(cfg_dict, settings))
    f = flops(settings)
    rows.append({'run': settings, 'batch_per_device': exp.data.batch_size // shards,
                 'bytes_per_device': None, 'fits': None, 'flops_per_step_per_device': f,
                 'flops_over_none': round(f / flops({**settings, 'run.remat': 'none'}), 4),
                 '_order': (f, exp.train.microbatches, -(exp.run.loss_chunk or 1 << 30),
                            exp.run.attention_impl != default_attention)})
  rows.sort(key=lambda r: r.pop('_order'))
  best = None
  for i, row in enumerate(rows):
    if best is not None and not exhaustive and not _step_variant(row, rows[best]):
      break
    over_none = row['flops_over_none']
    row.update(aot.candidate(cfg_dict, target, row['run'], preset,
                             flops=row['flops_per_step_per_device']), flops_over_none=over_none)
    log(line(row, target))
    if row['fits'] and (best is None or (_step_variant(row, rows[best]) and
                                         _step(row) < _step(rows[best]))):
      best = i
  return rows, best


def _step_variant(row: dict, other: dict) -> bool:
  """Whether two candidates differ in STEP_KEYS (and REMAT_TWINS) only."""
  rest = lambda r: {k: v for k, v in {**r['run'], 'run.remat': _twin(r['run'])}.items()
                    if k not in STEP_KEYS}
  return rest(row) == rest(other)


def _twin(settings: dict):
  """The run.remat of `settings`, a REMAT_TWINS policy as the one whose recompute it has."""
  remat = settings.get('run.remat')
  return REMAT_TWINS.get(remat, remat)


def _step(row: dict) -> float:
  return (row.get('time_bounds_s') or {}).get('estimated_step', float('inf'))


def line(row: dict, target: targets.Target) -> str:
  settings = ' '.join(f'{k.split(".")[-1]}={v}' for k, v in row['run'].items())
  if row['bytes_per_device'] is None:
    return f'{settings:<52} (not compiled) FLOPs/none {row["flops_over_none"]:.3f}'
  total = row['bytes_per_device']['total']
  return (f'{settings:<52} {total / 2**30:9.2f} GiB {100 * total / target.hbm_bytes_per_device:6.1f}%'
          f' {"fits" if row["fits"] else "no  "}  FLOPs/none {row["flops_over_none"]:.3f}'
          f'  batch/device {row["batch_per_device"]}'
          + ('  (refused by the compiler: over by '
             f'{(total - target.hbm_bytes_per_device) / 2**30:.2f} GiB)' if row.get('refused')
             else '')
          + ('  (cached)' if row.get('cached') else f'  ({row.get("compile_s")} s)'))


def table(rows, best, target) -> str:
  head = (f'{"candidate":<52} {"bytes/device":>13} {"HBM":>6} fit   FLOPs over remat=none '
          f'({target.name}, {target.hbm_bytes_per_device / 2**30:.1f} GiB per device)')
  lines = [head] + [('* ' if i == best else '  ') + line(r, target) for i, r in enumerate(rows)]
  lines.append(f'* cheapest that fits: {" ".join(f"--config.{k}={v}" for k, v in rows[best]["run"].items())}'
               if best is not None else 'no candidate fits: shard over more devices '
               '(mesh.fsdp, mesh.expert) or lower data.batch_size')
  return '\n'.join(lines)
