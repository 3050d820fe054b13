"""One shard of a prepared corpus in each output format: write it atomically, open it as a token
source, checksum its tokens.

Formats (the manifest's `format`):
  tokens        NAME.bin: a flat token file (sources.py's layout), read through numpy memmap.
  zarr          NAME.zarr: a 1-D zarr3 array (sources.write_zarr), read through tensorstore.
  array_record  NAME.array_record: an ArrayRecord file (Grain's native format) of fixed-size
                records: record r holds tokens [r*R, (r+1)*R) of the shard as little-endian
                `dtype` bytes (R = the manifest's `record_tokens`; the last record may be
                shorter), so a token offset maps to a record by arithmetic. Documents are
                not records: a shard is whole documents, each followed by EOS, cut into
                records at fixed offsets.

Every shard is written under NAME.tmp and renamed to NAME only once complete, so a file or
directory with a shard's name is always a whole shard. Its checksum (`sha256`) is of its tokens
as little-endian `dtype` bytes, the same whatever the format. Nothing here imports JAX.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import threading

import numpy as np

from loopmoe_jax import storage
from loopmoe_jax.data import sources

FORMATS = ('tokens', 'zarr', 'array_record')
SUFFIX = {'tokens': '.bin', 'zarr': '.zarr', 'array_record': '.array_record'}
RECORD_TOKENS = 4096
ZARR_CHUNK = 1 << 20
AR_WRITE_OPTIONS = 'group_size:1'                              # each record its own chunk
AR_READ_OPTIONS = 'readahead_buffer_size:0,max_parallelism:0'  # random access


def sha256(tokens, dtype) -> str:
  return hashlib.sha256(np.asarray(tokens).astype(np.dtype(dtype).newbyteorder('<'))
                        .tobytes()).hexdigest()


def remove(path: str):
  """Deletes a file or a directory (a zarr or temporary shard) if it exists."""
  if os.path.isdir(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.remove(path)


def write(fmt: str, path: str, tokens, vocab_size: int, tokenizer: str,
          before_rename=None) -> None:
  """Writes `tokens` as one shard at `path` (through `path`.tmp and a rename).
  `before_rename()` runs between the two (a test hook)."""
  tmp = path + '.tmp'
  remove(tmp)
  tokens = np.asarray(tokens)
  if fmt == 'tokens':
    sources.write_token_file(tmp, tokens, vocab_size, tokenizer)
  elif fmt == 'zarr':
    sources.write_zarr(tmp, tokens, vocab_size, tokenizer, chunk=ZARR_CHUNK)
  elif fmt == 'array_record':
    from array_record.python.array_record_module import ArrayRecordWriter
    sources.check_ids(tokens, vocab_size, path)
    data = tokens.astype(np.dtype(sources.token_dtype(vocab_size)).newbyteorder('<'))
    writer = ArrayRecordWriter(tmp, AR_WRITE_OPTIONS)
    for start in range(0, len(data), RECORD_TOKENS):
      writer.write(data[start:start + RECORD_TOKENS].tobytes())
    writer.close()
  else:
    raise ValueError(f'format {fmt!r}: must be one of {FORMATS}')
  if before_rename is not None:
    before_rename()
  remove(path)
  os.replace(tmp, path)


class ArrayRecordTokens:
  """The tokens of an ArrayRecord shard of fixed-size records (see the module docstring)."""

  def __init__(self, path: str, num_tokens: int, vocab_size: int, tokenizer: str,
               record_tokens: int = RECORD_TOKENS, check: bool = True):
    from array_record.python.array_record_module import ArrayRecordReader
    if not os.path.exists(path):
      raise FileNotFoundError(f'shard {path!r} does not exist')
    self.name, self.vocab_size, self.tokenizer = path, vocab_size, tokenizer
    self.dtype = np.dtype(sources.token_dtype(vocab_size)).newbyteorder('<')
    self.num_tokens, self.record_tokens = num_tokens, record_tokens
    try:
      self.reader = ArrayRecordReader(path, AR_READ_OPTIONS)
    except Exception as e:  # pylint: disable=broad-except  (the C++ reader's error type)
      raise ValueError(f'shard {path!r}: not a readable ArrayRecord file ({e})') from None
    want = -(-num_tokens // record_tokens)
    if self.reader.num_records() != want:
      raise ValueError(f'shard {path!r}: {self.reader.num_records()} records, the manifest '
                       f'implies {want} ({num_tokens} tokens of {record_tokens} per record)')
    self._lock = threading.Lock()
    if check:
      sources.check_ids(sources.Sliceable(self), vocab_size, path, sample=True)

  def __len__(self):
    return self.num_tokens

  def read(self, start: int, stop: int) -> np.ndarray:
    stop = min(stop, self.num_tokens)
    if stop <= start:
      return np.zeros(0, np.int32)
    r0, r1 = start // self.record_tokens, (stop - 1) // self.record_tokens
    with self._lock:
      records = self.reader.read(list(range(r0, r1 + 1)))
    data = np.frombuffer(b''.join(records), self.dtype)
    off = r0 * self.record_tokens
    return sources.checked(data[start - off:stop - off].astype(np.int32), start,
                           self.vocab_size, self.name)


def open_shard(fmt: str, path: str, num_tokens: int, vocab_size: int, tokenizer: str,
               record_tokens: int = RECORD_TOKENS, check: bool = True):
  """A token source (`__len__`, `read`) over one shard, its length checked against
  `num_tokens` and its vocabulary and tokenizer against the manifest's."""
  if fmt == 'array_record':
    if storage.is_url(path):
      raise ValueError(f'shard {path!r}: ArrayRecord shards are read from local disk only; '
                       'prepare the corpus with --format=tokens (or zarr) for object storage')
    return ArrayRecordTokens(path, num_tokens, vocab_size, tokenizer, record_tokens, check)
  src = sources.TokenFile(path, check) if fmt == 'tokens' else sources.ZarrTokens(path, check)
  if len(src) != num_tokens:
    raise ValueError(f'shard {path!r}: {len(src)} tokens, the manifest says {num_tokens} '
                     '(replaced or rewritten after the manifest?)')
  if (src.vocab_size, src.tokenizer) != (vocab_size, tokenizer):
    raise ValueError(f'shard {path!r}: vocabulary {src.vocab_size} / tokenizer '
                     f'{src.tokenizer!r}, the manifest says {vocab_size} / {tokenizer!r}')
  return src


def read_all(src, chunk: int = 1 << 24) -> np.ndarray:
  return np.concatenate([src.read(s, min(s + chunk, len(src)))
                         for s in range(0, len(src), chunk)] or [np.zeros(0, np.int32)])
