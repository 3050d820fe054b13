"""A prepared corpus (scripts/prepare_data.py): DIR/manifest.json and its shards, read as one
token source.

manifest.json (written last, once every shard is complete):
  {"version": 1, "format": "tokens" | "zarr" | "array_record", "tokenizer": NAME,
   "vocab_size": V, "eos_id": ID, "dtype": "uint16" | "uint32", "record_tokens": R,
   "settings": {the preparation's inputs, shard_tokens, val_fraction, text_field, ...},
   "splits": {"train": {"num_tokens": N, "num_documents": M, "shards": [SHARD, ...]},
              "val": {...}}}
  SHARD = {"file": "train-00000.bin", "num_tokens": n, "num_documents": m,
           "sha256": hex of the tokens as little-endian dtype bytes,
           "documents": [first, end) (indices of the input documents it holds, with gaps
           where a document went to the other split)}
A split's tokens are its shards' in order; every document is followed by EOS.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np

from loopmoe_jax import storage
from loopmoe_jax.data import shards

MANIFEST = 'manifest.json'
VERSION = 1
KEYS = ('format', 'tokenizer', 'vocab_size', 'eos_id', 'splits')


def manifest_path(path: str) -> str:
  """DIR or DIR/manifest.json -> DIR/manifest.json."""
  return path if path.endswith('.json') else storage.join(path, MANIFEST)


def load(path: str) -> dict:
  """The manifest at `path` (DIR or DIR/manifest.json), its keys checked."""
  file = manifest_path(path)
  if not storage.exists(file):
    raise FileNotFoundError(f'manifest {file!r} does not exist; write one with '
                            'scripts/prepare_data.py --output=DIR')
  try:
    m = json.loads(storage.read_text(file))
  except ValueError as e:
    raise ValueError(f'manifest {file!r}: not JSON ({e})') from None
  missing = [k for k in KEYS if k not in m]
  if missing:
    raise ValueError(f'manifest {file!r}: lacks {missing} (has {sorted(m)})')
  if m['format'] not in shards.FORMATS:
    raise ValueError(f'manifest {file!r}: format {m["format"]!r} is not one of {shards.FORMATS}')
  return m


def write_json(path: str, obj) -> str:
  """Writes `obj` as JSON to `path` atomically (a temporary file renamed); returns `path`."""
  storage.write_text(path, json.dumps(obj, indent=1) + '\n')
  return path


def write(directory: str, manifest: dict) -> str:
  """Writes DIR/manifest.json atomically; returns its path."""
  return write_json(storage.join(directory, MANIFEST), manifest)


def file_sha256(path: str) -> str:
  """The sha256 of a file's bytes (a tokenizer file), read in chunks."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(1 << 20):
      digest.update(chunk)
  return digest.hexdigest()


class ManifestTokens:
  """The shards of one split of a manifest as ONE token source: `read(start, stop)` spans
  shard boundaries; `__len__`, `vocab_size`, `tokenizer`, `eos_id`, `name` as the other
  sources (sources.py). Opening checks every shard's length and vocabulary against the
  manifest (and, with `check`, its ids)."""

  def __init__(self, path: str, split: str = 'train', check: bool = True):
    m = load(path)
    file = manifest_path(path)
    if split not in m['splits']:
      raise ValueError(f'manifest {file!r}: no split {split!r} (splits: {sorted(m["splits"])})')
    entries = m['splits'][split]['shards']
    if not entries:
      raise ValueError(f'manifest {file!r}: the {split!r} split has no shards')
    self.name = f'{file} ({split})'
    self.vocab_size, self.tokenizer, self.eos_id = m['vocab_size'], m['tokenizer'], m['eos_id']
    self.format, self.split = m['format'], split
    self.tokenizer_sha256 = m.get('settings', {}).get('tokenizer_sha256')
    base = storage.dirname(storage.absolute(file))
    self.shards = [shards.open_shard(m['format'], storage.join(base, s['file']),
                                     s['num_tokens'], self.vocab_size, self.tokenizer,
                                     m.get('record_tokens', shards.RECORD_TOKENS), check)
                   for s in entries]
    self.starts = np.cumsum([0] + [len(s) for s in self.shards])

  def __len__(self):
    return int(self.starts[-1])

  def read(self, start: int, stop: int) -> np.ndarray:
    stop = min(stop, len(self))
    if stop <= start:
      return np.zeros(0, np.int32)
    first = int(np.searchsorted(self.starts, start, side='right')) - 1
    parts = []
    while start < stop:
      s0 = int(self.starts[first])
      end = min(stop, int(self.starts[first + 1]))
      parts.append(self.shards[first].read(start - s0, end - s0))
      start, first = end, first + 1
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@functools.lru_cache(maxsize=8)
def _opened(file: str, split: str, mtime_ns: int) -> ManifestTokens:
  del mtime_ns  # part of the key: a manifest written again is opened (and checked) again
  return ManifestTokens(file, split)


def opened(path: str, split: str) -> ManifestTokens:
  """ManifestTokens(path, split), opened and id-checked once per manifest version (the
  pipeline opens a source several times: check_data, the iterator, the tokenizer)."""
  file = storage.absolute(manifest_path(path))
  if storage.is_url(file):  # one open per process per split: the sample check is cheap
    return _opened(file, split, 0)
  mtime = os.stat(file).st_mtime_ns if os.path.exists(file) else 0
  return _opened(file, split, mtime) if mtime else ManifestTokens(path, split)


def _same_tokenizer(src, spec: str) -> bool:
  """data.tokenizer `spec` is the manifest's: the same name (its absolute path), or a file
  with the same bytes (a corpus and its tokenizer moved together)."""
  name = 'byte' if spec in ('', 'byte') else os.path.abspath(spec)
  if name == src.tokenizer:
    return True
  if name == 'byte' or not src.tokenizer_sha256 or not os.path.exists(name):
    return False
  return file_sha256(name) == src.tokenizer_sha256


def open_split(path: str, val_path: str, tokenizer: str, split: str):
  """The pipeline's manifest source for `split` ('train' or 'validation'); None when there is
  no validation data. Validation reads `val_path`'s 'val' split (its 'train' split when it has
  no 'val' shards: a corpus prepared whole for validation), or, with no `val_path`, the 'val'
  split of `path`'s manifest if it has one. The manifest's tokenizer must be `tokenizer`
  (data.tokenizer): tokens made by another one are an error, as is a vocabulary larger than
  the model's (pipeline.Windows, as for every source)."""
  if split == 'train':
    src = opened(path, 'train')
  else:
    m = load(val_path or path)
    has_val = bool(m['splits'].get('val', {}).get('shards'))
    if not has_val and not val_path:
      return None
    src = opened(val_path or path, 'val' if has_val else 'train')
  if not _same_tokenizer(src, tokenizer):
    raise ValueError(f'{src.name}: tokens made by tokenizer {src.tokenizer!r} (vocabulary '
                     f'{src.vocab_size}), but data.tokenizer={tokenizer!r}: set '
                     f'--config.data.tokenizer={src.tokenizer} or prepare the corpus again')
  return src
