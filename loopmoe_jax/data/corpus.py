"""The embedded default corpus: real text that needs no download.

The running Python's own standard library sources (not site-packages, not test suites) and
the `pydoc_data` help topics, read in a fixed sorted order, split into train and validation
by document (a stable hash of the document name).
"""
from __future__ import annotations

import os
import sysconfig
import zlib

SKIP_DIRS = frozenset({'site-packages', 'dist-packages', 'test', 'tests', 'idle_test',
                       '__pycache__'})


def documents() -> list[tuple[str, str]]:
  """(name, text) for every document, in a fixed order."""
  root = sysconfig.get_paths()['stdlib']
  docs = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith('config-'))
    for name in sorted(filenames):
      if name.endswith('.py'):
        path = os.path.join(dirpath, name)
        with open(path, encoding='utf-8', errors='replace') as f:
          docs.append((os.path.relpath(path, root), f.read()))
  from pydoc_data import topics
  docs.extend((f'pydoc_data/{k}', topics.topics[k]) for k in sorted(topics.topics))
  if not docs:
    raise RuntimeError(f'the embedded corpus is empty: no .py files under {root}')
  return docs


def is_validation(name: str, fraction: float) -> bool:
  return zlib.crc32(name.encode()) % 10_000 < fraction * 10_000


def split(fraction: float) -> dict[str, list[tuple[str, str]]]:
  """{'train': docs, 'validation': docs}; the split depends only on names and `fraction`."""
  out = {'train': [], 'validation': []}
  for name, text in documents():
    out['validation' if is_validation(name, fraction) else 'train'].append((name, text))
  return out
