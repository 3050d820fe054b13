"""Token sources: a flat token file (numpy memmap), a tensorstore zarr array, an in-memory array.

Every source is a 1-D sequence of token ids with `vocab_size`, `tokenizer` and `name`, read
by `read(start, stop)`. Ids are checked against the vocabulary when a corpus is written
(prepare_data); opening a file checks its header and a bounded sample of its ids
(`SAMPLE_CHUNKS` chunks spread over it: no host reads a whole corpus to start), and every read
checks the ids it returns, so a bad id is still an error naming the file and offset. Token
files may live on object storage (gs://...): read by ranged reads (storage.read_range).

Token file layout: b'LOOPMOE1', a little-endian uint64 header length, a JSON header
{"dtype", "vocab_size", "tokenizer", "num_tokens"}, zero padding to a multiple of 64 bytes,
then the raw tokens.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

import numpy as np

from loopmoe_jax import storage

MAGIC = b'LOOPMOE1'
CHECK_CHUNK = 1 << 22
SAMPLE_CHUNKS = 4  # chunks of CHECK_CHUNK ids checked when a source is opened


def token_dtype(vocab_size: int):
  return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def check_ids(tokens, vocab_size: int, name: str, sample: bool = False):
  """Raises naming `name` and the first offset whose id is outside [0, vocab_size): every id,
  or with `sample` SAMPLE_CHUNKS chunks spread from the first to the last."""
  starts = range(0, len(tokens), CHECK_CHUNK)
  if sample and len(starts) > SAMPLE_CHUNKS:
    starts = sorted({starts[int(i)] for i in np.linspace(0, len(starts) - 1, SAMPLE_CHUNKS)})
  for start in starts:
    checked(np.asarray(tokens[start:start + CHECK_CHUNK]), start, vocab_size, name)


def checked(chunk: np.ndarray, start: int, vocab_size: int, name: str) -> np.ndarray:
  """`chunk` (the ids from offset `start` of `name`), or a ValueError naming the first id
  outside [0, vocab_size) and its offset."""
  bad = np.flatnonzero((chunk >= vocab_size) | (chunk < 0))
  if bad.size:
    off = start + int(bad[0])
    raise ValueError(f'{name}: token id {int(chunk[bad[0]])} at offset {off} is outside the '
                     f'vocabulary of {vocab_size}')
  return chunk


class ArrayTokens:
  """Tokens held in memory (the embedded corpus, synthetic data)."""

  def __init__(self, tokens, vocab_size: int, tokenizer: str, name: str):
    self.tokens = np.asarray(tokens)
    self.vocab_size, self.tokenizer, self.name = vocab_size, tokenizer, name
    check_ids(self.tokens, vocab_size, name)

  def __len__(self):
    return len(self.tokens)

  def read(self, start: int, stop: int) -> np.ndarray:
    return np.asarray(self.tokens[start:stop], np.int32)


def write_token_file(path: str, tokens, vocab_size: int, tokenizer: str):
  tokens = np.asarray(tokens)
  check_ids(tokens, vocab_size, path)
  dtype = token_dtype(vocab_size)
  header = json.dumps({'dtype': np.dtype(dtype).name, 'vocab_size': int(vocab_size),
                       'tokenizer': tokenizer, 'num_tokens': int(tokens.size)}).encode()
  head = MAGIC + struct.pack('<Q', len(header)) + header
  head += b'\0' * (-len(head) % 64)
  storage.write_bytes(path, head + tokens.astype(dtype).tobytes())


def read_header(path: str) -> tuple[dict[str, Any], int]:
  """(header, byte offset of the tokens) of a token file, with clear errors."""
  if not storage.exists(path):
    raise FileNotFoundError(f'token file {path!r} does not exist')
  size = storage.size(path)
  head = storage.read_range(path, 0, min(size, 4096))
  magic = head[:8]
  if magic != MAGIC:
    raise ValueError(f'token file {path!r}: not a loopmoe token file (bad magic {magic!r})')
  (n,) = struct.unpack('<Q', head[8:16])
  if 16 + n > size:
    raise ValueError(f'token file {path!r}: its header length field says {n} bytes, but the '
                     f'file has {size} bytes (corrupt or truncated)')
  body = head[16:16 + n] if 16 + n <= len(head) else storage.read_range(path, 16, 16 + n)
  try:
    header = json.loads(body)
  except ValueError as e:
    raise ValueError(f'token file {path!r}: corrupt JSON header ({e})') from None
  missing = [k for k in ('num_tokens', 'dtype', 'vocab_size', 'tokenizer') if k not in header]
  if missing:
    raise ValueError(f'token file {path!r}: header lacks {missing} (has {sorted(header)})')
  try:
    dtype = np.dtype(header['dtype'])
  except TypeError:
    dtype = None
  if dtype is None or dtype.kind not in 'iu':
    raise ValueError(f'token file {path!r}: header dtype {header["dtype"]!r} is not an '
                     'integer type (token ids are integers)')
  for key in ('num_tokens', 'vocab_size'):
    if not isinstance(header[key], int) or header[key] < 0:
      raise ValueError(f'token file {path!r}: header {key}={header[key]!r} must be an '
                       'integer >= 0')
  offset = 16 + n + (-(16 + n) % 64)
  expected = offset + header['num_tokens'] * dtype.itemsize
  if size != expected:
    raise ValueError(f'token file {path!r}: {size} bytes, header implies {expected} (truncated?)')
  return header, offset


class TokenFile:
  """A flat token file: a numpy memmap of a local file, ranged reads of an object (gs://).
  `check`: a sample of its ids at opening (module docstring); every read is checked."""

  def __init__(self, path: str, check: bool = True):
    header, self.offset = read_header(path)
    self.name, self.vocab_size, self.tokenizer = path, header['vocab_size'], header['tokenizer']
    self.dtype, self.num = np.dtype(header['dtype']), header['num_tokens']
    self.tokens = None if storage.is_url(path) else np.memmap(
        path, dtype=self.dtype, mode='r', offset=self.offset, shape=(self.num,))
    if check:
      check_ids(Sliceable(self), self.vocab_size, path, sample=True)

  def __len__(self):
    return self.num

  def read(self, start: int, stop: int) -> np.ndarray:
    stop = min(stop, self.num)
    if self.tokens is not None:
      ids = np.asarray(self.tokens[start:stop])
    else:
      item = self.dtype.itemsize
      ids = np.frombuffer(storage.read_range(self.name, self.offset + start * item,
                                             self.offset + stop * item), self.dtype)
    return checked(ids.astype(np.int32), start, self.vocab_size, self.name)


def zarr_spec(path_or_spec: str) -> dict:
  """A local path, or a JSON kvstore spec (e.g. {"driver": "gcs", "bucket": ..., "path": ...})."""
  if path_or_spec.lstrip().startswith('{'):
    kv = json.loads(path_or_spec)
  elif storage.is_url(path_or_spec):
    kv = path_or_spec
  else:
    kv = {'driver': 'file', 'path': os.path.abspath(path_or_spec)}
  return {'driver': 'zarr3', 'kvstore': kv}


def write_zarr(path_or_spec: str, tokens, vocab_size: int, tokenizer: str, chunk: int = 1 << 20):
  import tensorstore as ts
  tokens = np.asarray(tokens)
  check_ids(tokens, vocab_size, path_or_spec)
  dtype = np.dtype(token_dtype(vocab_size)).name
  spec = dict(zarr_spec(path_or_spec), create=True, delete_existing=True, metadata={
      'shape': [int(tokens.size)], 'data_type': dtype,
      'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': [chunk]}},
      'attributes': {'vocab_size': int(vocab_size), 'tokenizer': tokenizer}})
  arr = ts.open(spec).result()
  arr[:].write(tokens.astype(dtype)).result()


class ZarrTokens:
  """A 1-D zarr3 token array through tensorstore: a local path or any kvstore spec, so many
  hosts can read the same array (e.g. from a cloud bucket)."""

  def __init__(self, path_or_spec: str, check: bool = True):
    import tensorstore as ts
    try:
      self.arr = ts.open(zarr_spec(path_or_spec), read=True).result()
    except Exception as e:
      # tensorstore appends the whole resolved spec in brackets: keep the message before it
      why = re.sub(r'\s*\[tensorstore_spec=.*$', '', str(e), flags=re.S)
      raise ValueError(f'zarr token array {path_or_spec!r} cannot be opened ({why}); write one '
                       'with scripts/prepare_data.py --format=zarr') from e
    attrs = self.arr.spec(retain_context=False).to_json().get('metadata', {}).get('attributes', {})
    if 'vocab_size' not in attrs:
      raise ValueError(f'zarr token array {path_or_spec!r}: no vocab_size attribute')
    self.name, self.vocab_size = path_or_spec, int(attrs['vocab_size'])
    self.tokenizer = attrs.get('tokenizer', '')
    if check:
      check_ids(Sliceable(self), self.vocab_size, path_or_spec, sample=True)

  def __len__(self):
    return self.arr.shape[0]

  def read(self, start: int, stop: int) -> np.ndarray:
    return checked(np.asarray(self.arr[start:stop].read().result(), np.int32), start,
                   self.vocab_size, self.name)


class Sliceable:
  """A token source (`read`) indexed by slices, as check_ids reads it."""

  def __init__(self, src):
    self.src = src

  def __len__(self):
    return len(self.src)

  def __getitem__(self, s):
    return self.src.read(s.start, min(s.stop, len(self.src)))
