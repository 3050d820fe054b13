"""Tokenizing a corpus for data/prepare.py: documents read in order (readers.py), cut into
chunks, tokenized in `spawn`ed worker processes (or in this one) and collected in document
order, so the result never depends on the number of workers.

The workers import this module (no JAX) and never the caller's script; each exits if the
preparing process dies.
"""
from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import types

import numpy as np

from loopmoe_jax.data import readers, sources
from loopmoe_jax.data.tokenizers import load_tokenizer

CHUNK_CHARS = 1 << 18          # a worker's task: documents up to this many characters ...
CHUNK_DOCS = 512               # ... or this many documents


class _Tokenize:
  """chunk (first document number, [Doc]) -> (first, lengths incl. EOS, tokens incl. EOS)."""

  def __init__(self, tokenizer: str, field: str):
    self.tok, self.field = load_tokenizer(tokenizer), field
    self.dtype = sources.token_dtype(self.tok.vocab_size)
    self.eos = np.asarray([self.tok.eos_id], np.int32)

  def __call__(self, chunk):
    first, docs = chunk
    pieces, lengths = [], np.empty(len(docs), np.int64)
    for i, doc in enumerate(docs):
      ids = self.tok.encode(readers.text_of(doc, self.field))
      pieces += [ids, self.eos]
      lengths[i] = len(ids) + 1
    return first, lengths, np.concatenate(pieces).astype(self.dtype)


_WORKER: dict[str, _Tokenize] = {}  # this worker process's tokenizer, set by its initializer


def _init_worker(tokenizer: str, field: str):
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'  # one core per worker
  parent = multiprocessing.parent_process()
  if parent is not None:  # exit with the preparing process, even when it is killed
    threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
  _WORKER['tokenize'] = _Tokenize(tokenizer, field)


def _exit_with(sentinel):
  multiprocessing.connection.wait([sentinel])
  os._exit(1)  # pylint: disable=protected-access


def _run_chunk(chunk):
  return _WORKER['tokenize'](chunk)


@contextlib.contextmanager
def _pool(workers: int, tokenizer: str, field: str):
  """`workers` spawned processes. While they start, __main__ is a blank module, so they do not
  re-import the caller's script (which may import JAX, or run a benchmark)."""
  ctx = multiprocessing.get_context('spawn')
  main = sys.modules.get('__main__')
  sys.modules['__main__'] = types.ModuleType('__main__')
  try:
    pool = ctx.Pool(workers, _init_worker, (tokenizer, field))
  finally:
    sys.modules['__main__'] = main
  try:
    yield pool
  finally:
    pool.terminate()
    pool.join()


def _chunks(docs, start: int):
  """(first document number, documents) in order, from document number `start` on."""
  batch, chars, first = [], 0, start
  for i, doc in enumerate(docs):
    if i < start:
      continue
    batch.append(doc)
    chars += len(doc.payload) if isinstance(doc.payload, str) else 0  # (null: an error later)
    if chars >= CHUNK_CHARS or len(batch) >= CHUNK_DOCS:
      yield first, batch
      first, batch, chars = i + 1, [], 0
  if batch:
    yield first, batch


def tokenized(inputs, tokenizer: str, field: str, workers: int, start: int = 0):
  """(document numbers, lengths, tokens) per chunk, in document order, from document `start`
  on: `inputs` (readers.expand's) read here, tokenized by `workers` spawned processes (0: in
  this one) with the tokenizer `tokenizer` ('byte' or a JSON file), text from `field`."""
  chunks = _chunks(readers.documents(inputs, field), start)
  with contextlib.ExitStack() as stack:
    if workers:
      pool = stack.enter_context(_pool(workers, tokenizer, field))
      results = _ordered(pool, chunks, 2 * workers + 2)
    else:
      results = map(_Tokenize(tokenizer, field), chunks)
    for first, lengths, tokens in results:
      yield first + np.arange(len(lengths)), lengths, tokens


def _ordered(pool, chunks, window: int):
  """pool results in submission order, at most `window` chunks in flight."""
  pending = collections.deque()
  for chunk in chunks:
    pending.append(pool.apply_async(_run_chunk, (chunk,)))
    if len(pending) >= window:
      yield pending.popleft().get()
  while pending:
    yield pending.popleft().get()
