"""Reading a run's JSON-lines logs (metrics.jsonl, final_steps.jsonl) for an analysis that
must not stop at what a crash leaves: a last line cut short (the trainer killed mid-write; it
moves such a line aside itself on resume, train/metrics.py) is skipped with a note naming the
file and line, and the rows before it are read. A line that does not parse anywhere else is
damage, not a torn write: a ValueError naming the file and the line number."""
from __future__ import annotations

import json
import logging

from loopmoe_jax import storage
from loopmoe_jax.train.metrics import FINAL_STEPS, METRICS

log = logging.getLogger(__name__)
_NOTED: set[tuple[str, int]] = set()  # (file, line) of the torn lines noted in this process


def read_rows(path: str) -> list[dict]:
  """The JSON objects of a JSON-lines file in order, a torn last line skipped (noted)."""
  lines = storage.read_text(path).splitlines()
  numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
  rows = []
  for i, (number, line) in enumerate(numbered):
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise ValueError(f'a JSON {type(row).__name__}, not an object')
    except ValueError as e:
      if i == len(numbered) - 1:
        if (path, number) not in _NOTED:
          _NOTED.add((path, number))
          log.info(f'{path}: line {number} is not a whole row (a write cut short); skipped')
        break
      raise ValueError(f'{path}: line {number} is not a JSON row ({e}): the file is damaged '
                       'there') from None
    rows.append(row)
  return rows


def _rows(workdir: str, name: str, required: bool) -> list[dict]:
  path = storage.join(workdir, name)
  if not storage.exists(path):
    if required:
      raise FileNotFoundError(f'{workdir}: no {name} (not a run directory?)')
    return []
  return read_rows(path)


def _number(row: dict, key: str, path: str):
  try:
    return int(row['step']), float(row[key])
  except (KeyError, TypeError, ValueError):
    raise ValueError(f'{path}: a row without a numeric step and {key!r}: {row}') from None


def series(workdir: str, key: str = 'loss') -> dict[int, float]:
  """{step: value} of one metrics.jsonl key (the last row of a step wins, as on resume)."""
  path = storage.join(workdir, METRICS)
  return dict(_number(r, key, path) for r in _rows(workdir, METRICS, True) if key in r)


def final_steps(workdir: str, train: dict) -> dict[int, float]:
  """{step: LM loss} of final_steps.jsonl, the rows of the final window that the stored
  config's `train` section names (its last train.final_window steps of train.steps); {} for
  a run without the record."""
  path = storage.join(workdir, FINAL_STEPS)
  rows = dict(_number(r, 'loss', path) for r in _rows(workdir, FINAL_STEPS, False))
  first = train.get('steps', 0) - train.get('final_window', 0)
  return {s: v for s, v in rows.items() if s > first}
