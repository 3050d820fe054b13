"""Writing a prepared corpus's shards for data/prepare.py: one split's documents cut into
shards at the first document end past `shard_tokens`, each written under a temporary name and
renamed when complete (shards.py), then its record (tokens, documents, checksum) in
OUT/.prepare/, which a resumed preparation verifies; and the progress line.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from loopmoe_jax.data import manifest as manifests
from loopmoe_jax.data import shards, sources

STATE_DIR = '.prepare'         # records of finished shards while a preparation runs
KILL_ENV = 'LOOPMOE_PREPARE_KILL_AT'  # 'N:tmp' | 'N:renamed': SIGKILL at this run's Nth shard


class Progress:
  """A progress line on stderr: documents, tokens, their rates, shards written."""

  def __init__(self, enabled: bool):
    self.enabled, self.t0, self.last = enabled, time.perf_counter(), 0.0
    self.docs = self.tokens = self.shards = 0

  def update(self, docs: int = 0, tokens: int = 0, shards_: int = 0, final: bool = False):
    self.docs, self.tokens, self.shards = (self.docs + docs, self.tokens + tokens,
                                           self.shards + shards_)
    now = time.perf_counter()
    if not self.enabled or (now - self.last < 0.5 and not final):
      return
    self.last, dt = now, max(now - self.t0, 1e-9)
    print(f'\rprepare: {self.docs:,} documents ({self.docs / dt:,.0f}/s), {self.tokens:,} '
          f'tokens ({self.tokens / dt:,.0f}/s), {self.shards} shards, {dt:.1f}s',
          end='\n' if final else '', file=sys.stderr, flush=True)


def _kill_point(count: int, point: str):
  """The test hook: SIGKILL this process at shard `count` of this run, at `point`."""
  spec = os.environ.get(KILL_ENV, '')
  if spec and spec == f'{count}:{point}':
    os.kill(os.getpid(), signal.SIGKILL)


class SplitWriter:
  """Cuts one split's documents into shards, writes each, then its record. `cfg`: the
  PrepareConfig (output, format, shard_tokens); `records`: the split's finished shards'."""

  def __init__(self, cfg, tok, split: str, records: list, progress: Progress):
    self.cfg, self.tok, self.split, self.progress = cfg, tok, split, progress
    self.records, self.pending, self.n = list(records), [], 0

  def add(self, ids, lengths, tokens):
    if len(ids):
      self.pending.append((ids, lengths, tokens))
      self.n += tokens.size
    while self.n >= self.cfg.shard_tokens:
      self._cut()

  def finish(self):
    if self.n:
      self._cut(final=True)

  def _cut(self, final: bool = False):
    ids, lengths, tokens = (np.concatenate(p) for p in zip(*self.pending))
    cum = np.cumsum(lengths)
    k = len(ids) if final else int(np.searchsorted(cum, self.cfg.shard_tokens)) + 1
    n = int(cum[k - 1])
    self._write(ids[:k], tokens[:n])
    self.pending = [(ids[k:], lengths[k:], tokens[n:])] if k < len(ids) else []
    self.n = tokens.size - n

  def _write(self, ids, tokens):
    out, fmt = self.cfg.output, self.cfg.format
    name = f'{self.split}-{len(self.records):05d}{shards.SUFFIX[fmt]}'
    count = self.progress.shards
    shards.write(fmt, os.path.join(out, name), tokens, self.tok.vocab_size, self.tok.name,
                 before_rename=lambda: _kill_point(count, 'tmp'))
    _kill_point(count, 'renamed')
    record = {'file': name, 'num_tokens': int(tokens.size), 'num_documents': int(ids.size),
              'sha256': shards.sha256(tokens, sources.token_dtype(self.tok.vocab_size)),
              'documents': [int(ids[0]), int(ids[-1]) + 1]}
    manifests.write_json(os.path.join(out, STATE_DIR, f'{name}.json'), record)
    self.records.append(record)
    self.progress.update(shards_=1)
