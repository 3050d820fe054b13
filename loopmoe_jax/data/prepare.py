"""Prepares a corpus: reads the inputs (readers.py), tokenizes them in worker processes and writes
sharded output with a manifest (manifest.py, shards.py), or one token file / zarr array.

Order and determinism: documents are numbered in input order (each glob's matches sorted);
every document is followed by EOS; a document goes to the 'val' split when a hash of its
number falls below `val_fraction` (`is_validation`), else to 'train'. Each split's stream of
documents is cut into shards at the first document end where a shard reaches `shard_tokens`
(the last shard holds the rest). Workers tokenize chunks of documents that are collected in
order, so the shards depend only on the inputs, the tokenizer, `shard_tokens` and
`val_fraction`, never on the number of workers.

Resumable: each shard is written under a temporary name and renamed when complete, then a
record of it (tokens, documents, checksum) goes to DIR/.prepare/; the manifest is written last
and DIR/.prepare removed. Run again after an interruption with the same arguments: shards whose
record verifies (the file's tokens hash to its checksum) are kept, tokenizing restarts at the
first document of the first missing shard, and the result is byte-identical to an
uninterrupted run. With a 'val' split the restart is the earlier of the two splits' first
missing shards: the small val split's first shard finishes late (after about shard_tokens /
val_fraction tokens of input), so an interruption before it re-tokenizes the input from the
start (the finished train shards are kept, not rewritten). A finished preparation run again is verified and left as it is.

Tokenizing in worker processes: tokenize_workers.py; writing shards and their records:
shard_writer.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from loopmoe_jax import storage
from loopmoe_jax.data import manifest as manifests
from loopmoe_jax.data import readers, shards, sources
from loopmoe_jax.data.shard_writer import STATE_DIR, Progress, SplitWriter
from loopmoe_jax.data.tokenize_workers import tokenized
from loopmoe_jax.data.tokenizers import load_tokenizer, train_bpe

SINGLE_SUFFIXES = ('.bin', '.zarr')


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
  inputs: tuple[str, ...]          # paths, globs, or 'embedded'
  output: str                      # DIR (sharded, with manifest.json), or FILE.bin / X.zarr
  format: str = 'tokens'           # tokens | zarr | array_record (shards.FORMATS)
  tokenizer: str = 'byte'          # 'byte' or a tokenizers JSON file
  train_vocab: int = 0             # train a BPE of this vocabulary to `tokenizer` first
  text_field: str = 'text'         # JSONL field / parquet or arrow column
  workers: int = 0                 # tokenizing processes (0: in this process)
  shard_tokens: int = 1 << 27      # a shard ends at the first document end past this
  val_fraction: float = 0.0        # share of documents held out in the 'val' split
  progress: bool = False           # a progress line on stderr

  def __post_init__(self):
    if self.format not in shards.FORMATS:
      raise ValueError(f'--format={self.format!r}: must be one of {shards.FORMATS}')
    if self.workers < 0:
      raise ValueError(f'--workers={self.workers}: must be >= 0 (0: tokenize in this process)')
    if self.shard_tokens < 1:
      raise ValueError(f'--shard_tokens={self.shard_tokens}: must be >= 1')
    if not 0.0 <= self.val_fraction < 1.0:
      raise ValueError(f'--val_fraction={self.val_fraction}: must lie in [0, 1)')
    if self.single and self.val_fraction:
      raise ValueError(f'--val_fraction={self.val_fraction} needs a directory --output (one '
                       f'file {self.output!r} holds one split)')
    if self.single and self.format == 'array_record':
      raise ValueError(f'--format=array_record writes a directory of shards: give '
                       f'--output=DIR, not {self.output!r}')
    if self.single and self.output.endswith(SINGLE_SUFFIXES):
      want = 'zarr' if self.output.endswith('.zarr') else 'tokens'
      if want != self.format:
        raise ValueError(f'--output={self.output!r} names a {want} file but --format='
                         f'{self.format}: give --format={want} or another --output')
    if self.train_vocab < 0:
      raise ValueError(f'--train_bpe={self.train_vocab}: must be >= 0 (0: no training)')

  @property
  def single(self) -> bool:
    """One token file / zarr array (the output ends in .bin / .zarr, or is a kvstore spec)
    rather than a directory of shards with a manifest (a gs:// URL too, unless it ends in
    .bin / .zarr)."""
    out = self.output.rstrip('/')
    return (out.endswith(SINGLE_SUFFIXES) or self.output.lstrip().startswith('{')) and \
        not self.output.endswith('/')


def is_validation(doc_ids, fraction: float) -> np.ndarray:
  """Whether each document number goes to the 'val' split (splitmix64 of the number)."""
  z = np.asarray(doc_ids, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  z ^= z >> np.uint64(31)
  return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def _verified(cfg: PrepareConfig, tok, record: dict) -> bool:
  path = os.path.join(cfg.output, record['file'])
  if not os.path.exists(path):
    return False
  try:
    src = shards.open_shard(cfg.format, path, record['num_tokens'], tok.vocab_size, tok.name,
                            check=False)
    tokens = shards.read_all(src)
  except (OSError, ValueError):
    return False
  return shards.sha256(tokens, sources.token_dtype(tok.vocab_size)) == record['sha256']


def _settings(cfg: PrepareConfig, tok, inputs) -> dict:
  """What the shards depend on; a resumed preparation must have the same."""
  def size(inp):
    if inp.kind in ('embedded', 'hub'):
      return None
    files = readers.hf_files(inp.path) if inp.kind == 'hf' else [inp.path]
    return sum(os.path.getsize(f) for f in files)
  tok_hash = 'byte' if tok.name == 'byte' else manifests.file_sha256(tok.name)
  return {'inputs': [[i.path if i.kind in ('embedded', 'hub') else os.path.abspath(i.path),
                      size(i)]
                     for i in inputs],
          'tokenizer': tok.name, 'tokenizer_sha256': tok_hash, 'vocab_size': tok.vocab_size,
          'eos_id': int(tok.eos_id), 'format': cfg.format, 'shard_tokens': cfg.shard_tokens,
          'val_fraction': cfg.val_fraction, 'text_field': cfg.text_field,
          'record_tokens': shards.RECORD_TOKENS if cfg.format == 'array_record' else None}


def _check_same(out: str, old: dict, new: dict):
  for key in sorted(set(old) | set(new)):
    if old.get(key) != new.get(key):
      raise ValueError(f'--output={out} holds a preparation with other settings ({key}: '
                       f'{old.get(key)!r} there, {new.get(key)!r} now): use another --output '
                       'or remove it')


def _finished(cfg: PrepareConfig, tok, settings: dict, splits) -> tuple[dict, bool]:
  """({split: the records of its verified finished shards}, whether the manifest is whole)."""
  out, state = cfg.output, os.path.join(cfg.output, STATE_DIR)
  file = os.path.join(out, manifests.MANIFEST)
  if os.path.exists(file):
    m = manifests.load(file)
    _check_same(out, m.get('settings', {}), settings)
    records = {s: m['splits'].get(s, {'shards': []})['shards'] for s in splits}
    if all(_verified(cfg, tok, r) for rs in records.values() for r in rs):
      return records, True
    os.makedirs(state, exist_ok=True)
    manifests.write_json(os.path.join(state, 'settings.json'), settings)
    for rs in records.values():
      for r in rs:
        manifests.write_json(os.path.join(state, f'{r["file"]}.json'), r)
    os.remove(file)
  os.makedirs(state, exist_ok=True)
  settings_file = os.path.join(state, 'settings.json')
  if os.path.exists(settings_file):
    with open(settings_file) as f:
      _check_same(out, json.load(f), settings)
  else:
    manifests.write_json(settings_file, settings)
  records = {}
  for s in splits:
    records[s] = []
    while True:
      rec_file = os.path.join(state, f'{s}-{len(records[s]):05d}{shards.SUFFIX[cfg.format]}.json')
      if not os.path.exists(rec_file):
        break
      with open(rec_file) as f:
        record = json.load(f)
      if not _verified(cfg, tok, record):
        break
      records[s].append(record)
  return records, False


def _remove_temporaries(out: str):
  """Deletes the unfinished shards an interrupted preparation left ('train-*.tmp',
  'val-*.tmp'), nothing else of `out`."""
  for name in os.listdir(out):
    if name.endswith('.tmp') and name.startswith(('train-', 'val-')):
      shards.remove(os.path.join(out, name))


def _manifest(cfg: PrepareConfig, tok, settings: dict, records: dict) -> dict:
  return {'version': manifests.VERSION, 'format': cfg.format, 'tokenizer': tok.name,
          'vocab_size': tok.vocab_size, 'eos_id': int(tok.eos_id),
          'dtype': np.dtype(sources.token_dtype(tok.vocab_size)).name,
          'record_tokens': settings['record_tokens'], 'settings': settings,
          'splits': {s: {'num_tokens': sum(r['num_tokens'] for r in rs),
                         'num_documents': sum(r['num_documents'] for r in rs), 'shards': rs}
                     for s, rs in records.items()}}


def _prepare_dir(cfg: PrepareConfig, tok, tok_spec: str, inputs) -> dict:
  out = cfg.output
  os.makedirs(out, exist_ok=True)
  splits = ('train', 'val') if cfg.val_fraction else ('train',)
  settings = _settings(cfg, tok, inputs)
  done, whole = _finished(cfg, tok, settings, splits)
  resumed = sum(len(r) for r in done.values())
  if not whole:
    _remove_temporaries(out)
    progress = Progress(cfg.progress)
    writers = {s: SplitWriter(cfg, tok, s, done[s], progress) for s in splits}
    next_doc = {s: done[s][-1]['documents'][1] if done[s] else 0 for s in splits}
    for ids, lengths, tokens in tokenized(inputs, tok_spec, cfg.text_field, cfg.workers,
                                              min(next_doc.values())):
      val = is_validation(ids, cfg.val_fraction)
      for s in splits:
        keep = (val if s == 'val' else ~val) & (ids >= next_doc[s])
        writers[s].add(ids[keep], lengths[keep], tokens[np.repeat(keep, lengths)])
      progress.update(len(ids), tokens.size)
    for w in writers.values():
      w.finish()
    progress.update(final=True)
    done = {s: w.records for s, w in writers.items()}
    if not done['train']:
      raise ValueError(f'no training documents in {list(cfg.inputs)}')
    m = _manifest(cfg, tok, settings, done)
    manifests.write(out, m)
    shutil.rmtree(os.path.join(out, STATE_DIR), ignore_errors=True)
  else:
    m = _manifest(cfg, tok, settings, done)
  return {'output': out, 'manifest': os.path.join(out, manifests.MANIFEST),
          'format': cfg.format, 'num_tokens': m['splits']['train']['num_tokens'],
          'val_tokens': m['splits'].get('val', {}).get('num_tokens', 0),
          'shards': {s: len(r) for s, r in done.items()}, 'resumed_shards': resumed,
          'vocab_size': tok.vocab_size, 'tokenizer': tok.name}


def _prepare_single(cfg: PrepareConfig, tok, tok_spec: str, inputs) -> dict:
  progress = Progress(cfg.progress)
  pieces = []
  for ids, _, tokens in tokenized(inputs, tok_spec, cfg.text_field, cfg.workers):
    pieces.append(tokens)
    progress.update(len(ids), tokens.size)
  progress.update(final=True)
  if not pieces:
    raise ValueError(f'no documents in {list(cfg.inputs)}')
  tokens = np.concatenate(pieces)
  if cfg.format == 'zarr':
    sources.write_zarr(cfg.output, tokens, tok.vocab_size, tok.name)
  else:
    sources.write_token_file(cfg.output, tokens, tok.vocab_size, tok.name)
  return {'output': cfg.output, 'format': cfg.format, 'num_tokens': int(tokens.size),
          'vocab_size': tok.vocab_size, 'tokenizer': tok.name}


def read_texts(inputs, field: str = 'text'):
  """Yields the documents' texts of `inputs` (readers.expand's), in order."""
  for doc in readers.documents(inputs, field):
    yield readers.text_of(doc, field)


def run(cfg: PrepareConfig) -> dict:
  """Prepares `cfg.inputs` into `cfg.output`; returns a summary dict."""
  inputs = readers.expand(cfg.inputs)
  if cfg.train_vocab:
    if cfg.tokenizer in ('', 'byte'):
      raise ValueError('--train_bpe needs --tokenizer=PATH.json to save the tokenizer to')
    tok = train_bpe(read_texts(inputs, cfg.text_field), cfg.train_vocab, cfg.tokenizer)
  else:
    tok = load_tokenizer(cfg.tokenizer)
  if cfg.single:
    return _prepare_single(cfg, tok, cfg.tokenizer, inputs)
  if storage.is_url(cfg.output):  # shards made on local disk, uploaded when complete
    with tempfile.TemporaryDirectory() as tmp:
      out = _prepare_dir(dataclasses.replace(cfg, output=tmp), tok, cfg.tokenizer, inputs)
      storage.upload_tree(tmp, cfg.output)
    return dict(out, output=cfg.output, manifest=storage.join(cfg.output, manifests.MANIFEST))
  return _prepare_dir(cfg, tok, cfg.tokenizer, inputs)


def prepare(inputs, output: str, fmt: str = 'tokens', tokenizer: str = 'byte',
            train_vocab: int = 0, field: str = 'text', **kw) -> dict:
  """`run` with PrepareConfig's fields as arguments (kw: workers, shard_tokens, val_fraction,
  progress)."""
  return run(PrepareConfig(tuple(inputs), output, fmt, tokenizer, train_vocab, field, **kw))
