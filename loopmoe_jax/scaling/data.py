"""Loading law data: the Epoch AI digitisation of Chinchilla's Figure 4 and sweep CSVs."""
from __future__ import annotations

import csv
import io

import numpy as np

from loopmoe_jax import storage


def read_csv(path: str) -> dict[str, np.ndarray]:
  """A CSV (a local path or a URL such as gs://) as columns: numeric columns as float64
  arrays, others as arrays of str."""
  rows = list(csv.DictReader(io.StringIO(storage.read_text(path), newline='')))
  if not rows:
    raise ValueError(f'{path}: no rows')
  out = {}
  for key in rows[0]:
    vals = [r[key] for r in rows]
    try:
      out[key] = np.array([float(v) for v in vals])
    except ValueError:
      out[key] = np.array(vals)
  return out


def write_csv(path: str, rows: list[dict]):
  keys = list(dict.fromkeys(k for r in rows for k in r))
  text = io.StringIO(newline='')
  w = csv.DictWriter(text, fieldnames=keys)
  w.writeheader()
  w.writerows(rows)
  storage.write_text(path, text.getvalue())


def chinchilla_epoch(path: str, drop_highest: int = 5) -> dict[str, np.ndarray]:
  """Hoffmann et al.'s Figure 4 as digitised by Epoch AI: columns `Model Size`,
  `Training FLOP`, `loss`. Returns N, D = C / (6 N), C and loss, without the
  `drop_highest` highest-loss points (Besiroglu et al. 2024 drop five)."""
  raw = read_csv(path)
  n, c, loss = raw['Model Size'], raw['Training FLOP'], raw['loss']
  keep = np.argsort(loss, kind='stable')[:len(loss) - drop_highest]
  keep = np.sort(keep)
  return {'N': n[keep], 'D': c[keep] / (6.0 * n[keep]), 'C': c[keep], 'loss': loss[keep]}
