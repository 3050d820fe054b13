"""Grain pipelines: fixed-length windows, seeded shuffling, process sharding, resumable state.

The batch of step s holds global examples s*B .. s*B+B-1; example g reads window
perm_e[g mod N] of epoch e = g div N, where perm_e is a permutation drawn from (seed, e).
The order therefore depends only on (seed, seq_len, batch size, data), never on the model,
so different architectures see the same batches. Each process reads only the rows of every
global batch that its devices hold (`rows`, from the batch sharding: sharding.process_rows):
all of them when a non-batch axis spans the processes, its contiguous part when only batch
axes do. The iterator's state is the next step, saved with each checkpoint.
"""
from __future__ import annotations

import functools
import logging
import threading

import grain
import numpy as np

from loopmoe_jax.config.data import DataConfig  # noqa: F401  (pipeline.DataConfig)
from loopmoe_jax.data import corpus, manifest, sources, synthetic
from loopmoe_jax.data.tokenizers import load_tokenizer

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _embedded(tokenizer: str, fraction: float):
  tok = load_tokenizer(tokenizer)
  out, lossy, total = {}, 0, 0
  for split, docs in corpus.split(fraction).items():
    pieces = []
    for _, text in docs:
      ids = tok.encode(text)
      if total % 16 == 0:  # a sample of the documents: read back exactly?
        lossy += tok.decode(ids) != text
      total += 1
      pieces += [ids, np.asarray([tok.eos_id], np.int32)]
    out[split] = sources.ArrayTokens(np.concatenate(pieces), tok.vocab_size, tok.name,
                                     f'embedded corpus ({split})')
  if lossy:  # e.g. a tokenizer without byte fallback drops characters it does not know
    log.warning(f'data.tokenizer={tokenizer!r} does not read back {lossy} of '
                f'{-(-total // 16)} sampled documents of the embedded corpus exactly (unknown '
                'characters dropped, or normalisation)')
  return out


def open_source(cfg: DataConfig, split: str):
  """The token source of a split ('train' or 'validation'); None if there is none."""
  if cfg.source == 'embedded':
    return _embedded(cfg.tokenizer, cfg.val_fraction)[split]
  path = cfg.path if split == 'train' else cfg.val_path
  if split == 'train' and not path:
    raise ValueError(f'data.path is empty: data.source={cfg.source!r} needs a path '
                     '(--config.data.path=...)')
  if cfg.source == 'manifest':
    return manifest.open_split(cfg.path, cfg.val_path, cfg.tokenizer, split)
  if not path:
    return None
  return sources.TokenFile(path) if cfg.source == 'tokens' else sources.ZarrTokens(path)


class Windows:
  """Random access to examples: (inputs, targets, mask) of seq_len tokens."""

  def __init__(self, cfg: DataConfig, split: str, model_vocab: int):
    self.cfg = cfg
    if cfg.source == 'synthetic':
      self.num, self.src, self.vocab_size = 1 << 30, None, 256
      self.name = f'synthetic {cfg.task}'
      synthetic.example(cfg.task, cfg.seed, 0, cfg.seq_len)  # fail early on a bad task
    else:
      self.src = open_source(cfg, split)
      if self.src is None:
        raise ValueError(f'no {split} data: set data.val_path')
      self.name, self.vocab_size = self.src.name, self.src.vocab_size
      self.num = (len(self.src) - 1) // cfg.seq_len
      if self.num < 1:
        raise ValueError(f'{self.name}: {len(self.src)} tokens is too short for one sequence of '
                         f'data.seq_len={cfg.seq_len} (+1 target)')
    if self.vocab_size > model_vocab:
      raise ValueError(f'{self.name}: data vocabulary {self.vocab_size} exceeds '
                       f'model.vocab_size={model_vocab}')

  def __call__(self, index: int):
    s = self.cfg.seq_len
    if self.src is None:
      tokens, mask = synthetic.example(self.cfg.task, self.cfg.seed, index, s)
    else:
      tokens = self.src.read(index * s, index * s + s + 1)
      mask = np.ones(s, np.float32)
    return tokens[:-1], tokens[1:], mask


def _rows(batch_size: int, rows) -> np.ndarray:
  """The global batch rows a process reads (sorted, unique): all of them when `rows` is None."""
  if rows is None:
    return np.arange(batch_size)
  rows = np.unique(np.asarray(rows, np.int64))
  if rows.size == 0 or rows[0] < 0 or rows[-1] >= batch_size:
    raise ValueError(f'rows {rows.tolist()[:8]} are not rows of data.batch_size={batch_size}')
  return rows


class StepBatches:
  """Maps a step to this process's rows of the global batch (thread-safe)."""

  def __init__(self, windows: Windows, batch_size: int, seed: int, rows=None):
    self.windows, self.batch, self.seed = windows, batch_size, seed
    self.rows = _rows(batch_size, rows)
    self._perms, self._lock = {}, threading.Lock()

  def _perm(self, epoch: int):
    with self._lock:
      if epoch not in self._perms:
        if len(self._perms) > 2:
          self._perms.pop(min(self._perms))
        n = self.windows.num
        self._perms[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(n)
                              if n < 1 << 30 else None)
      return self._perms[epoch]

  def example_ids(self, step: int) -> np.ndarray:
    g = step * self.batch + self.rows
    n = self.windows.num
    out = np.empty_like(g)
    for i, gi in enumerate(g):
      perm = self._perm(int(gi // n))
      out[i] = perm[gi % n] if perm is not None else gi
    return out

  def __call__(self, step: int):
    return _stack([self.windows(int(i)) for i in self.example_ids(step)])


def _stack(rows):
  return {'inputs': np.stack([r[0] for r in rows]).astype(np.int32),
          'targets': np.stack([r[1] for r in rows]).astype(np.int32),
          'mask': np.stack([r[2] for r in rows]).astype(np.float32)}


def check_data(cfg: DataConfig, model_vocab: int):
  """Opens the train (and validation) source as the run will: a missing file, a bad header, a
  source too short for one sequence or a vocabulary past the model's is a ValueError naming
  it, before any model is built."""
  Windows(cfg, 'train', model_vocab)
  if cfg.source != 'synthetic' and open_source(cfg, 'validation') is not None:
    Windows(cfg, 'validation', model_vocab)


def train_iterator(cfg: DataConfig, model_vocab: int, max_steps: int, rows=None, state=None):
  """A Grain iterator over steps 0..max_steps-1 (its state: {'next_index': step}) yielding the
  `rows` of each global batch (default: all)."""
  batches = StepBatches(Windows(cfg, 'train', model_vocab), cfg.batch_size, cfg.seed, rows)
  ds = grain.MapDataset.range(max_steps).map(batches)
  it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads,
                                                 prefetch_buffer_size=cfg.prefetch)))
  if state is not None:
    it.set_state(state)
  return it


def validation_batches(cfg: DataConfig, model_vocab: int, rows=None):
  """A fixed list of validation batches (in order, no shuffling; the `rows` of each, default
  all); [] if there is no split."""
  if cfg.source != 'synthetic' and open_source(cfg, 'validation') is None:
    return []
  windows = Windows(cfg, 'validation', model_vocab)
  rows = _rows(cfg.batch_size, rows)
  n = min(cfg.val_batches, windows.num // cfg.batch_size) or 1
  out = []
  for b in range(n):
    ids = [int(b * cfg.batch_size + i) % windows.num for i in rows]
    out.append(_stack([windows(i) for i in ids]))
  return out


def tokenizer_spec(cfg: DataConfig) -> str:
  """The tokenizer ('byte' or a tokenizers JSON path) that made the training tokens."""
  if cfg.source == 'synthetic':
    return 'byte'
  if cfg.source == 'embedded':
    return cfg.tokenizer
  if not cfg.path:
    raise ValueError(f'data.path is empty: data.source={cfg.source!r} needs a path '
                     '(--config.data.path=...)')
  # read from the header or the manifest: no token is read or checked here
  if cfg.source == 'manifest':
    return manifest.load(cfg.path)['tokenizer']
  if cfg.source == 'tokens':
    return sources.read_header(cfg.path)[0]['tokenizer']
  return sources.ZarrTokens(cfg.path, check=False).tokenizer


def data_tokenizer(cfg: DataConfig):
  """The tokenizer that made the training tokens, or None when it cannot be loaded."""
  try:
    return load_tokenizer(tokenizer_spec(cfg))
  except (OSError, ValueError):
    return None
