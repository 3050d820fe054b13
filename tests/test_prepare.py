"""Corpus preparation: input formats against the plain-JSONL path, output formats read back,
worker-count independence, resuming after a kill, the manifest source in the pipeline, bad
inputs."""
import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from loopmoe_jax.data import manifest, pipeline, prepare as prep, readers, shards, sources
from loopmoe_jax.data import shard_writer, tokenize_workers
from loopmoe_jax.data.prepare import prepare
from loopmoe_jax.data.tokenizers import ByteTokenizer, train_bpe

pa = pytest.importorskip('pyarrow')
pq = pytest.importorskip('pyarrow.parquet')
zstd = pytest.importorskip('zstandard')

DOCS = [f'doc {i}: ' + 'héllo wörld ' * (i % 7) + f'\nline two of {i} ' + 'x' * (3 * i % 50)
        for i in range(60)] + ['', 'last one']


def _jsonl(docs) -> str:
  return ''.join(json.dumps({'text': d, 'id': i}) + '\n' for i, d in enumerate(docs))


def _reference(docs) -> np.ndarray:
  """Byte tokens of `docs`, each followed by EOS (0): what every input format must give."""
  tok = ByteTokenizer()
  return np.concatenate([np.append(tok.encode(d), 0) for d in docs]).astype(np.int32)


def _tokens(path) -> np.ndarray:
  src = sources.TokenFile(str(path))
  return src.read(0, len(src))


def _hf_save_to_disk(directory, docs, files=2):
  """The layout `datasets.Dataset.save_to_disk` writes: arrow IPC streams + state.json."""
  os.makedirs(directory)
  names = [f'data-{i:05d}-of-{files:05d}.arrow' for i in range(files)]
  per = -(-len(docs) // files)
  for i, name in enumerate(names):
    table = pa.table({'text': docs[i * per:(i + 1) * per],
                      'id': list(range(i * per, min(len(docs), (i + 1) * per)))})
    with pa.OSFile(os.path.join(directory, name), 'wb') as sink:
      with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=7):
          writer.write_batch(batch)
  with open(os.path.join(directory, 'state.json'), 'w') as f:
    json.dump({'_data_files': [{'filename': n} for n in names], '_fingerprint': 'x',
               '_format_type': None, '_split': 'train'}, f)
  with open(os.path.join(directory, 'dataset_info.json'), 'w') as f:
    json.dump({'features': {'text': {'dtype': 'string', '_type': 'Value'},
                            'id': {'dtype': 'int64', '_type': 'Value'}}}, f)


def test_every_input_format_gives_the_plain_jsonl_tokens(tmp_path):
  (tmp_path / 'plain.jsonl').write_text(_jsonl(DOCS))
  prepare([str(tmp_path / 'plain.jsonl')], str(tmp_path / 'ref.bin'))
  ref = _tokens(tmp_path / 'ref.bin')
  np.testing.assert_array_equal(ref, _reference(DOCS))
  half = len(DOCS) // 2
  (tmp_path / 'a.jsonl.gz').write_bytes(gzip.compress(_jsonl(DOCS).encode()))
  raw = _jsonl(DOCS).encode()  # two zstd frames, split inside a line
  (tmp_path / 'a.jsonl.zst').write_bytes(zstd.ZstdCompressor().compress(raw[:1001]) +
                                         zstd.ZstdCompressor().compress(raw[1001:]))
  pq.write_table(pa.table({'id': list(range(len(DOCS))), 'text': DOCS}),
                 str(tmp_path / 'a.parquet'), row_group_size=9)
  _hf_save_to_disk(str(tmp_path / 'hf'), DOCS)
  os.makedirs(tmp_path / 'txt')
  for i, d in enumerate(DOCS):
    (tmp_path / 'txt' / f'd{i:03d}.txt').write_text(d)
  # parts of one corpus in two files, named by a list of globs
  (tmp_path / 'p1.jsonl').write_text(_jsonl(DOCS[:half]))
  (tmp_path / 'p2.jsonl.gz').write_bytes(gzip.compress(_jsonl(DOCS[half:]).encode()))
  for name, inputs in (('gz', ['a.jsonl.gz']), ('zst', ['a.jsonl.zst']),
                       ('parquet', ['a.parquet']), ('hf', ['hf']), ('txt', ['txt/*.txt']),
                       ('globs', ['p1.json*', 'p2.*'])):
    out = str(tmp_path / f'{name}.bin')
    prepare([str(tmp_path / i) for i in inputs], out)
    np.testing.assert_array_equal(_tokens(out), ref, err_msg=name)


def test_the_datasets_loader_spec_reads_a_local_dataset_folder(tmp_path):
  """hf:PATH streams through datasets.load_dataset as a hub name does (here a local folder
  of parquet files, offline): the plain-JSONL tokens; a malformed spec is refused."""
  pytest.importorskip('datasets')
  (tmp_path / 'plain.jsonl').write_text(_jsonl(DOCS))
  prepare([str(tmp_path / 'plain.jsonl')], str(tmp_path / 'ref.bin'))
  os.makedirs(tmp_path / 'ds')
  pq.write_table(pa.table({'id': list(range(len(DOCS))), 'text': DOCS}),
                 str(tmp_path / 'ds' / 'train-0.parquet'))
  prepare([f"hf:{tmp_path / 'ds'}:train"], str(tmp_path / 'hub.bin'))
  np.testing.assert_array_equal(_tokens(str(tmp_path / 'hub.bin')),
                                _tokens(str(tmp_path / 'ref.bin')))
  with pytest.raises(ValueError, match=r"'hf:': expected hf:NAME\[@CONFIG\]\[:SPLIT\]"):
    prepare(['hf:'], str(tmp_path / 'bad.bin'))


def _corpus(tmp_path, n=120, name='c.jsonl'):
  rng = np.random.default_rng(0)
  docs = [''.join(rng.choice(list('abcdefgh \n'), rng.integers(0, 200))) for _ in range(n)]
  (tmp_path / name).write_text(_jsonl(docs))
  return str(tmp_path / name), docs


@pytest.mark.parametrize('fmt', shards.FORMATS)
def test_each_output_format_reads_back_the_same_tokens(tmp_path, fmt):
  path, docs = _corpus(tmp_path)
  ref = _reference(docs)
  info = prepare([path], str(tmp_path / fmt), fmt, shard_tokens=2500)
  src = manifest.ManifestTokens(str(tmp_path / fmt))
  assert len(src.shards) == info['shards']['train'] > 3
  np.testing.assert_array_equal(src.read(0, len(src)), ref)
  rng = np.random.default_rng(1)  # reads across shard (and record) boundaries
  for start in rng.integers(0, len(ref), 20):
    stop = start + rng.integers(1, 6000)
    np.testing.assert_array_equal(src.read(start, stop), ref[start:stop])
  m = manifest.load(str(tmp_path / fmt))
  entries = m['splits']['train']['shards']
  assert sum(e['num_documents'] for e in entries) == len(docs)
  assert all(e['num_tokens'] >= 2500 for e in entries[:-1])
  ends = np.cumsum([e['num_tokens'] for e in entries])
  assert (ref[ends - 1] == 0).all()  # every shard ends at a document's EOS


def test_shards_are_the_same_whatever_the_worker_count(tmp_path, monkeypatch):
  monkeypatch.setattr(tokenize_workers, 'CHUNK_DOCS', 7)  # many chunks in flight
  path, _ = _corpus(tmp_path, 300)
  outs = []
  for workers in (0, 1, 2):
    out = tmp_path / f'w{workers}'
    prepare([path], str(out), workers=workers, shard_tokens=3000, val_fraction=0.2)
    outs.append({f: (out / f).read_bytes() for f in sorted(os.listdir(out))})
  assert len(outs[0]) > 4 and any(f.startswith('val-') for f in outs[0])
  assert outs[0] == outs[1] == outs[2]


def _files(directory):
  return {f: (directory / f).read_bytes() for f in sorted(os.listdir(directory))}


@pytest.mark.parametrize('kill_at,workers,kept', [('1:tmp', 0, 1), ('3:renamed', 2, 3)])
def test_killed_preparation_restarts_to_byte_identical_shards(tmp_path, kill_at, workers, kept):
  path, _ = _corpus(tmp_path, 200)
  kw = dict(shard_tokens=2000, val_fraction=0.3)
  prepare([path], str(tmp_path / 'whole'), **kw)
  out = tmp_path / 'killed'
  code = (f'from loopmoe_jax.data.prepare import prepare; '
          f'prepare([{path!r}], {str(out)!r}, workers={workers}, **{kw!r})')
  run = subprocess.run([sys.executable, '-c', code], env={**os.environ, shard_writer.KILL_ENV: kill_at},
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == -9, run.stderr
  names = os.listdir(out)
  assert 'manifest.json' not in names
  n = int(kill_at.split(':')[0])
  # the shard being written when killed: under its temporary name only, or renamed whole
  # (same bytes as the uninterrupted run's) but without a record
  assert len([f for f in names if f.endswith('.bin')]) == n + kill_at.endswith('renamed')
  for f in names:
    if f.endswith('.bin'):
      assert (out / f).read_bytes() == (tmp_path / 'whole' / f).read_bytes()
  info = prepare([path], str(out), workers=workers, **kw)
  assert info['resumed_shards'] == kept
  assert _files(out) == _files(tmp_path / 'whole')


def test_a_finished_preparation_is_verified_and_a_damaged_shard_rewritten(tmp_path):
  path, _ = _corpus(tmp_path)
  out = tmp_path / 'o'
  prepare([path], str(out), 'array_record', shard_tokens=2500)
  whole = _files(out)
  assert prepare([path], str(out), 'array_record', shard_tokens=2500)['resumed_shards'] == len(
      whole) - 1
  shard = out / 'train-00002.array_record'
  shard.write_bytes(b'not a shard')
  info = prepare([path], str(out), 'array_record', shard_tokens=2500)
  assert info['resumed_shards'] == 2 and _files(out) == whole
  with pytest.raises(ValueError, match=r"other settings \(shard_tokens: 2500 there, 999 now\)"):
    prepare([path], str(out), 'array_record', shard_tokens=999)


def _cfg(source, path, **kw):
  return pipeline.DataConfig(source=source, path=path, seq_len=16, batch_size=8, **kw)


def test_pipeline_over_a_manifest_of_three_shards_matches_the_concatenated_file(tmp_path):
  path, docs = _corpus(tmp_path, 150)
  prepare([path], str(tmp_path / 'one.bin'))
  total = _reference(docs).size
  prepare([path], str(tmp_path / 'm'), shard_tokens=total // 3 - 50)
  assert len(manifest.ManifestTokens(str(tmp_path / 'm')).shards) == 3
  flat, sharded = _cfg('tokens', str(tmp_path / 'one.bin')), _cfg('manifest', str(tmp_path / 'm'))
  a, b = pipeline.train_iterator(flat, 256, 60), pipeline.train_iterator(sharded, 256, 60)
  for _ in range(25):  # more than an epoch of windows
    x, y = next(a), next(b)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  state = b.get_state()
  rest = [next(a)['inputs'] for _ in range(3)]
  resumed = pipeline.train_iterator(sharded, 256, 60, state=json.loads(json.dumps(state)))
  for r in rest:
    np.testing.assert_array_equal(next(resumed)['inputs'], r)
  parts = [pipeline.train_iterator(_cfg('manifest', str(tmp_path / 'm' / 'manifest.json')),
                                   256, 5, rows=range(4 * p, 4 * p + 4)) for p in range(2)]
  whole = pipeline.train_iterator(flat, 256, 5)
  for _ in range(5):
    np.testing.assert_array_equal(np.concatenate([next(p)['inputs'] for p in parts]),
                                  next(whole)['inputs'])
  assert pipeline.tokenizer_spec(sharded) == 'byte'


def test_val_split_holds_the_hashed_documents_once(tmp_path):
  path, docs = _corpus(tmp_path, 200)
  prepare([path], str(tmp_path / 'm'), shard_tokens=3000, val_fraction=0.25)
  val = prep.is_validation(np.arange(len(docs)), 0.25)
  assert 0.15 < val.mean() < 0.35
  for split, want in (('train', ~val), ('val', val)):
    src = manifest.ManifestTokens(str(tmp_path / 'm'), split)
    np.testing.assert_array_equal(src.read(0, len(src)),
                                  _reference([d for d, v in zip(docs, want) if v]))
  cfg = _cfg('manifest', str(tmp_path / 'm'))
  assert pipeline.open_source(cfg, 'validation').split == 'val'
  assert pipeline.validation_batches(cfg, 256)
  # a val_path manifest without a 'val' split validates on its 'train' split
  prepare([path], str(tmp_path / 'v'), shard_tokens=3000)
  cfg = _cfg('manifest', str(tmp_path / 'm'), val_path=str(tmp_path / 'v'))
  assert pipeline.open_source(cfg, 'validation').name.endswith('(train)')


def test_tokenizing_imports_no_jax():
  code = ('import sys; import loopmoe_jax.data.prepare, loopmoe_jax.data.manifest; '
          'print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax")))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]'


# Bad input ---------------------------------------------------------------------------------------

def test_parquet_without_the_text_column_names_its_columns(tmp_path):
  pq.write_table(pa.table({'body': ['a'], 'id': [1]}), str(tmp_path / 'x.parquet'))
  with pytest.raises(ValueError, match=r"x\.parquet: no column 'text' \(its columns: "
                                       r"\['body', 'id'\]\)"):
    prepare([str(tmp_path / 'x.parquet')], str(tmp_path / 'o'))


@pytest.mark.parametrize('suffix', ['.gz', '.zst'])
def test_truncated_compressed_file_names_file_and_line_and_writes_no_shard(tmp_path, suffix):
  rng = np.random.default_rng(0)  # text that compresses little: many compressed blocks
  lines = _jsonl([f'document {i} {rng.bytes(30).hex()}' for i in range(20000)]).encode()
  data = gzip.compress(lines) if suffix == '.gz' else zstd.ZstdCompressor().compress(lines)
  name = f'cut.jsonl{suffix}'
  (tmp_path / name).write_bytes(data[:len(data) // 2])
  lines_read = []
  with pytest.raises(ValueError, match=rf'cut\.jsonl\{suffix}: compressed data ends early or '
                                       r'is corrupt at line (\d+)') as e:
    for n, _ in readers.lines(str(tmp_path / name), suffix):
      lines_read.append(n)
  assert f'at line {len(lines_read) + 1} ' in str(e.value) and len(lines_read) > 10
  out = tmp_path / 'o'
  with pytest.raises(ValueError, match=rf'cut\.jsonl\{suffix}: .* at line'):
    prepare([str(tmp_path / name)], str(out))
  assert not [f for f in os.listdir(out) if f.endswith('.bin') or f == 'manifest.json']
  with pytest.raises(ValueError, match='at line'):  # the single-file form writes nothing
    prepare([str(tmp_path / name)], str(tmp_path / 'one.bin'))
  assert not (tmp_path / 'one.bin').exists()


def test_manifest_of_another_tokenizer_or_a_larger_vocabulary_is_refused(tmp_path):
  path, docs = _corpus(tmp_path)
  prepare([path], str(tmp_path / 'byte'))
  bpe = str(tmp_path / 'bpe.json')
  train_bpe(docs, 300, bpe)
  prepare([path], str(tmp_path / 'bpe'), tokenizer=bpe)
  with pytest.raises(ValueError, match=r"\(train\): tokens made by tokenizer 'byte' "
                                       r"\(vocabulary 256\), but data.tokenizer="):
    pipeline.check_data(_cfg('manifest', str(tmp_path / 'byte'), tokenizer=bpe), 300)
  with pytest.raises(ValueError, match='data vocabulary 300 exceeds model.vocab_size=256'):
    pipeline.check_data(_cfg('manifest', str(tmp_path / 'bpe'), tokenizer=bpe), 256)
  pipeline.check_data(_cfg('manifest', str(tmp_path / 'bpe'), tokenizer=bpe), 300)
  # the same tokenizer file at another path (moved with its corpus) is the same tokenizer;
  # another BPE of the same vocabulary is not
  moved, other = str(tmp_path / 'moved.json'), str(tmp_path / 'other.json')
  shutil.copy(bpe, moved)
  pipeline.check_data(_cfg('manifest', str(tmp_path / 'bpe'), tokenizer=moved), 300)
  train_bpe(docs[::-1][:3], 300, other)
  with pytest.raises(ValueError, match=r"tokens made by tokenizer .*bpe\.json"):
    pipeline.check_data(_cfg('manifest', str(tmp_path / 'bpe'), tokenizer=other), 300)
  with pytest.raises(FileNotFoundError, match=r'manifest .*nowhere/manifest\.json'):
    pipeline.check_data(_cfg('manifest', str(tmp_path / 'nowhere')), 256)


def test_glob_matching_nothing_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"--inputs glob '.*/none/\*\.jsonl' matches no file"):
    prepare([str(tmp_path / 'none' / '*.jsonl')], str(tmp_path / 'o'))


def test_a_shard_replaced_after_the_manifest_is_caught(tmp_path):
  """A shard replaced after the manifest (a different length) is an error naming it."""
  path, _ = _corpus(tmp_path)
  prepare([path], str(tmp_path / 'm'), shard_tokens=2500)
  sources.write_token_file(str(tmp_path / 'm' / 'train-00001.bin'), np.arange(10), 256, 'byte')
  with pytest.raises(ValueError, match=r'train-00001\.bin.*10 tokens, the manifest says'):
    manifest.ManifestTokens(str(tmp_path / 'm'))


def test_progress_line_reports_rates_on_stderr(tmp_path, capsys):
  path, docs = _corpus(tmp_path, 30)
  prepare([path], str(tmp_path / 'm'), progress=True)
  err = capsys.readouterr().err
  assert f'prepare: {len(docs)} documents (' in err and '/s), ' in err and ' tokens (' in err


def test_an_output_whose_name_contradicts_its_format_is_refused(tmp_path):
  path, _ = _corpus(tmp_path, 5)
  with pytest.raises(ValueError, match=r"--output='.*x\.zarr' names a zarr file but --format=tokens"):
    prepare([path], str(tmp_path / 'x.zarr'))
  with pytest.raises(ValueError, match=r"--output='.*x\.bin' names a tokens file but --format=zarr"):
    prepare([path], str(tmp_path / 'x.bin'), 'zarr')
  with pytest.raises(ValueError, match=r'--train_bpe=-5: must be >= 0'):
    prepare([path], str(tmp_path / 'y.bin'), tokenizer=str(tmp_path / 't.json'), train_vocab=-5)
  assert not any(p.name.startswith(('x.', 'y.')) for p in tmp_path.iterdir())  # nothing written
