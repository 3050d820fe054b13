"""Ahead-of-time check of a config on a target mesh: lower and compile the train step from
abstract shapes (no arrays are made), then read per-device bytes and collective traffic.

    report = dry_run(config_dict)     # on as many (fake CPU) devices as the mesh needs

Per device: parameter and optimizer-state bytes (their shardings' shard shapes), temporaries
(the compiled program's memory analysis). Collectives: bytes of every collective's result
per train step by kind, read from the compiled HLO, with ops inside while loops (the scan over
passes, gradient accumulation) counted once per iteration (XLA's known trip counts).

On CPU the expert exchange is the padded all_to_all (expert_parallel.py), which moves n
(= mesh.expert) times what the ragged exchange of GPU/TPU sends: `all-to-all (ragged)`
reports that share, the figure for those platforms.
"""
from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax import sharding
from loopmoe_jax.experiment import build
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.train import step as steps
from loopmoe_jax.train.optimizer import make_optimizer

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute',
               'ragged-all-to-all')
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
                'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
_SHAPE = re.compile(r'\b(pred|[sufb]f?\d+)\[([\d,]*)\]')
_OP = re.compile(r'=\s*(.*?)\s(' + '|'.join(sorted(COLLECTIVES, key=len, reverse=True)) +
                 r')(-start)?\(')


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(',') if d]))
  return total


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r'^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$', line)
    if head and not line.startswith(' '):
      name = 'ENTRY' if head.group(1) else head.group(2)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  return comps


def collective_bytes(hlo: str) -> dict[str, int]:
  """Bytes of the results of each collective kind per execution of the HLO module's entry,
  while-loop bodies multiplied by their known trip counts."""
  comps = _computations(hlo)
  mult = collections.defaultdict(int, {'ENTRY': 1})
  for _ in range(8):  # nesting depth: propagate multiplicities outward-in
    for name, lines in comps.items():
      for line in lines:
        called = re.findall(r'(?:body|to_apply|calls|condition)=%?([\w.\-]+)', line)
        trip = re.search(r'known_trip_count[^0-9]*(\d+)', line)
        times = int(trip.group(1)) if trip and ' while(' in line else 1
        for c in called:
          if c in comps and mult[name]:
            mult[c] = max(mult[c], mult[name] * times)
  out = collections.Counter()
  for name, lines in comps.items():
    for line in lines:
      m = _OP.search(line)
      if m and mult[name]:
        out[m.group(2)] += mult[name] * _shape_bytes(m.group(1))
  return dict(out)


def train_step_program(cfg_dict):
  """(lowered train step, state shapes with shardings, mesh, experiment) for the config, on
  its mesh, from abstract shapes."""
  exp = build(cfg_dict)
  mesh = sharding.make_mesh(exp.mesh)
  sharding.check_batch(exp.data.batch_size, exp.train.microbatches, mesh)
  model = LoopedMoE(exp.model)
  tx, schedule = make_optimizer(exp.train)
  state_sh, batch_sh = steps.shardings(mesh, model, tx, exp.data.seq_len)
  state = steps.abstract_state(model, tx, exp.data.seq_len, state_sh)
  batch = {k: jax.ShapeDtypeStruct((exp.data.batch_size, exp.data.seq_len), jnp.int32,
                                   sharding=batch_sh) for k in ('inputs', 'targets')}
  step = steps.make_train_step(model, tx, schedule, exp.train.lb_coef, exp.train.z_coef,
                               state_sh, batch_sh, exp.train.microbatches)
  return step.lower(state, batch), state, mesh, exp


def dry_run(cfg_dict) -> dict:
  lowered, state, mesh, exp = train_step_program(cfg_dict)
  compiled = lowered.compile()
  mem = compiled.memory_analysis()
  coll = collective_bytes(compiled.as_text())
  n_exp = mesh.shape['expert']
  if n_exp > 1 and 'all-to-all' in coll:
    coll['all-to-all (ragged)'] = coll['all-to-all'] // n_exp
  per_dev = lambda tree: sharding.bytes_per_device(tree, jax.tree.map(lambda s: s.sharding, tree))
  total = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
              for s in jax.tree.leaves(state['params']))
  return {
      'devices': mesh.size,
      'mesh': {a: int(n) for a, n in mesh.shape.items()},
      'params_bytes_total': total,
      'params_bytes_per_device': per_dev(state['params']),
      'opt_state_bytes_per_device': per_dev(state['opt_state']),
      'temp_bytes_per_device': int(getattr(mem, 'temp_size_in_bytes', 0)) if mem else None,
      'collective_bytes_per_step': coll,
      'batch': [exp.data.batch_size, exp.data.seq_len],
      'expert_exchange': 'padded' if jax.default_backend() == 'cpu' else 'ragged',
  }


def table(report: dict) -> str:
  gib = lambda b: f'{b / 2**30:.3f} GiB'
  mesh = ' x '.join(f'{a}={n}' for a, n in report['mesh'].items() if n > 1) or 'one device'
  rows = [('devices', f"{report['devices']} ({mesh})"),
          ('params (total)', gib(report['params_bytes_total'])),
          ('params / device', gib(report['params_bytes_per_device'])),
          ('optimizer state / device', gib(report['opt_state_bytes_per_device'])),
          ('temporaries / device', gib(report['temp_bytes_per_device'] or 0))]
  rows += [(f'{kind} / step', gib(b)) for kind, b in
           sorted(report['collective_bytes_per_step'].items())]
  width = max(len(r[0]) for r in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)
