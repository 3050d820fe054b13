"""Reading XLA's HLO text: the collectives a program sends and the FLOPs of its matmuls, with
while-loop bodies counted once per iteration (trip counts read off the loop conditions).

`collectives(hlo)` lists every collective op with its bytes (its result's; a ragged
all-to-all moves at most min(operand, result) rows, counted so), its group size and its
multiplicity; ops over single-device groups are skipped. `collective_bytes` sums them by kind.
Compiled (scheduled) programs split a collective into `X-start` / `X-done`: its bytes are the
start's output (the last element of its tuple, a collective-permute's second; an all-reduce's
whole result), and the pair is `async`, `overlapped` when the schedule puts compute (a fusion,
dot, convolution, custom call, loop or call) between start and done; TPU's async collective
fusions (a collective inside an `async_collective_fusion` computation, run beside that fusion's
compute) count as async and overlapped. `collective_ops` counts them per kind.
`dot_flops(hlo)` counts 2 x result elements x contracted size per `dot` and `ragged-dot`.
dry_run.py reads programs with these; the tests check them against hand counts.
"""
from __future__ import annotations

import collections
import math
import re

import numpy as np

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute',
               'ragged-all-to-all')
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
                'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
_SHAPE = re.compile(r'\b(pred|[sufb]f?\d+)\[([\d,]*)\]')
_OP = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s(' +
                 '|'.join(sorted(COLLECTIVES, key=len, reverse=True)) + r')(-start)?\((.*)$')
_DEF = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?\[[\d,]*\])')


def _shapes(text: str):
  return [(dt, tuple(int(d) for d in dims.split(',') if d)) for dt, dims in _SHAPE.findall(text)
          if dt in _DTYPE_BYTES]


def _shape_bytes(text: str) -> int:
  return sum(_DTYPE_BYTES[dt] * int(np.prod(dims, dtype=np.int64)) for dt, dims in _shapes(text))


def _tuple_elements(text: str) -> list[str]:
  """The top-level elements of a tuple shape text '(a, (b, c), d)' (a lone shape: itself)."""
  text = text.strip()
  if not text.startswith('('):
    return [text]
  out, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in '({[':
      depth += 1
    elif ch in ')}]':
      depth -= 1
      if depth == 0 and ch == ')':
        out.append(text[start:i])
    elif ch == ',' and depth == 1:
      out.append(text[start:i])
      start = i + 1
  return [re.sub(r'/\*index=\d+\*/', '', e).strip() for e in out if e.strip()]


def _start_output(kind: str, result: str) -> str:
  """The output part of an async start's result: an all-reduce's whole result; else the
  second element of (operand(s), output(s), contexts...)."""
  if kind == 'all-reduce':
    return result
  parts = _tuple_elements(result)
  return parts[1] if len(parts) > 1 else parts[0]


_COMPUTE = re.compile(r'\s(fusion|dot|convolution|custom-call|while|call|conditional)\(')


def _overlapped(lines, index: int, name: str) -> bool:
  """Whether compute is scheduled between the start at lines[index] and its done (whose
  operand may be printed with its shape: `-done((f32[2], f32[8]) %start)`)."""
  done = re.compile(r'-done\(.*?[\s(%]' + re.escape(name) + r'\)')
  for line in lines[index + 1:]:
    if done.search(line):
      return False
    if _COMPUTE.search(line):
      return True
  return False


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


def _trip_count(line: str, comps) -> int:
  """A while loop's trip count: XLA's known_trip_count when annotated, else read off a
  `compare(counter, constant N), direction=LT` condition (jax's scans); 1 if unknown."""
  known = re.search(r'known_trip_count[^0-9]*(\d+)', line)
  if known:
    return int(known.group(1))
  cond = re.search(r'condition=%?([\w.\-]+)', line)
  lines = comps.get(cond.group(1), []) if cond else []
  consts = {}
  for l in lines:
    m = re.match(r'^\s*%?([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((-?\d+)\)', l)
    if m:
      consts[m.group(1)] = int(m.group(2))
  for l in lines:
    if ' compare(' in l and 'direction=LT' in l:
      args = re.search(r'compare\(([^)]*)\)', l).group(1)
      names = [a.strip().split(' ')[-1].lstrip('%') for a in args.split(',')]
      if len(names) == 2 and names[1] in consts:
        return consts[names[1]]
  return 1


def _multiplicities(comps) -> dict[str, int]:
  mult = collections.defaultdict(int, {'ENTRY': 1})
  for _ in range(10):  # nesting depth: propagate multiplicities outward-in
    for name, lines in comps.items():
      for line in lines:
        called = re.findall(r'(?:body|to_apply|calls|condition)=%?([\w.\-]+)', line)
        called += re.findall(r'(?:branch_computations|called_computations)=\{([^}]*)\}', line)
        called = [c.strip().lstrip('%') for group in called for c in group.split(',')]
        times = _trip_count(line, comps) if ' while(' in line else 1
        for c in called:
          if c in comps and mult[name]:
            mult[c] = max(mult[c], mult[name] * times)
  return mult


def _group_size(line: str) -> int:
  """Devices in one replica group of a collective (1: a no-op on every device)."""
  explicit = re.search(r'replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}', line)
  if explicit:
    return max(len(g.split(',')) for g in re.findall(r'\{([\d,]*)\}', explicit.group(1)))
  iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=', line)
  if iota:
    return int(iota.group(2))
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if mesh:
    sizes = dict((k.strip("' "), int(v)) for k, v in
                 (kv.split('=') for kv in mesh.group(1).split(',')))
    return math.prod(sizes[a.strip("' ")] for a in mesh.group(2).split(',') if a.strip())
  return 2  # no groups written: every device


def _definitions(lines) -> dict[str, str]:
  """{value name: its result shape text} of one computation's lines."""
  return {d.group(1): d.group(2) for d in map(_DEF.match, lines) if d}


def collectives(hlo: str):
  """Every collective of an HLO module that moves data: dicts of kind, bytes per execution,
  executions per run of the entry, result shapes, op name, group size."""
  comps = _computations(hlo)
  mult = _multiplicities(comps)
  out = []
  for name, lines in comps.items():
    defs = _definitions(lines)
    for i, line in enumerate(lines):
      m = _OP.search(line)
      if not m or not mult[name]:
        continue
      group = _group_size(line)
      if group == 1:
        continue
      kind, result = m.group(3), m.group(2)
      start = bool(m.group(4)) and '"is_sync":true' not in line  # GPU: a start/done pair
      # the scheduler made synchronous is no async op
      fused = name.startswith('async_collective_fusion')  # TPU: run beside its fusion's compute
      out_shape = _start_output(kind, result) if m.group(4) else result
      nbytes = _shape_bytes(out_shape)
      if kind == 'ragged-all-to-all':  # rows moved <= min(operand, output) rows
        operand = m.group(5).split(',')[0].strip().split(' ')[-1].lstrip('%')
        if operand in defs:
          nbytes = min(nbytes, _shape_bytes(defs[operand]))
      op_name = re.search(r'op_name="([^"]*)"', line)
      out.append({'kind': kind, 'bytes': nbytes, 'times': mult[name],
                  'shapes': _shapes(out_shape),
                  'op_name': op_name.group(1) if op_name else '', 'group': group,
                  'async': start or fused,
                  'overlapped': fused or (start and _overlapped(lines, i, m.group(1)))})
  return out


def collective_ops(colls) -> dict[str, dict[str, int]]:
  """Per kind: ops per step (loop trip counts applied), how many of them are async
  (start/done pairs) and how many of those overlap compute."""
  out = collections.defaultdict(collections.Counter)
  for c in colls:
    row = out[c['kind']]
    row['ops'] += c['times']
    row['async'] += c['times'] * c['async']
    row['overlapped'] += c['times'] * c['overlapped']
  return {k: {f: int(v[f]) for f in ('ops', 'async', 'overlapped')}
          for k, v in sorted(out.items())}


def collective_bytes(hlo_or_colls) -> dict[str, int]:
  """Bytes of the results of each collective kind per execution of the HLO module's entry
  (an HLO text or its `collectives`), while-loop bodies multiplied by their trip counts,
  single-device groups skipped."""
  colls = collectives(hlo_or_colls) if isinstance(hlo_or_colls, str) else hlo_or_colls
  out = collections.Counter()
  for c in colls:
    out[c['kind']] += c['times'] * c['bytes']
  return dict(out)


_DOT = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+?\[[\d,]*\])\S*\s+'
                  r'(dot|ragged-dot)\((.*?)\),(.*)$')


def dot_flops(hlo: str) -> int:
  """FLOPs of the module's matmuls per run of its entry: 2 x result elements x contracted
  size for every `dot` and `ragged-dot` (a ragged-dot contracting its ragged dimension, the
  grouped weight gradient, counts each row once: result elements / groups), while-loop bodies
  multiplied by their trip counts (XLA's own cost analysis counts a loop body once; a loop of
  data-dependent length counts once). Matmuls are the model's FLOPs but for softmax, norms and
  activations (a few percent)."""
  comps = _computations(hlo)
  mult = _multiplicities(comps)
  total = 0
  for name, lines in comps.items():
    if not mult[name]:
      continue
    defs = _definitions(lines)
    for line in lines:
      m = _DOT.match(line)
      if not m:
        continue
      lhs = m.group(3).split(',')[0].strip().split(' ')
      lhs_shape = lhs[0] if len(lhs) > 1 else defs.get(lhs[-1].lstrip('%'), '')
      dims = _shapes(lhs_shape)
      contract = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', m.group(4))
      if not dims or not contract:
        continue
      axes = [int(i) for i in contract.group(1).split(',') if i]
      k = math.prod(dims[0][1][i] for i in axes)
      out = _shapes(m.group(1))[0][1]
      flops = 2 * math.prod(out) * k
      ragged = re.search(r'lhs_ragged_dims=\{(\d+)\}', m.group(4))
      if m.group(2) == 'ragged-dot' and ragged and int(ragged.group(1)) in axes:
        flops //= out[0]  # [groups, ...] result: each contracted row belongs to one group
      total += mult[name] * flops
  return int(total)


