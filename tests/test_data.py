"""Data: corpus split, tokenizers, token sources with bad-input errors, Grain pipeline order."""
import json
import logging
import os
import re
import struct

import numpy as np
import pytest

from loopmoe_jax.data import corpus, pipeline, sources, synthetic
from loopmoe_jax.data.prepare import prepare
from loopmoe_jax.data.tokenizers import ByteTokenizer, load_tokenizer, train_bpe


def test_corpus_is_stdlib_sorted_and_split_by_document():
  docs = corpus.documents()
  names = [n for n, _ in docs]
  assert not any('site-packages' in n or '/test/' in f'/{n}' or '/tests/' in f'/{n}'
                 for n in names)
  py = [n for n in names if n.endswith('.py')]
  assert 'os.py' in py and any(n.startswith('pydoc_data/') for n in names)
  split = corpus.split(0.05)
  train = {n for n, _ in split['train']}
  val = {n for n, _ in split['validation']}
  assert not train & val and len(train) + len(val) == len(docs)
  assert 0.01 < len(val) / len(docs) < 0.12
  assert [n for n, _ in corpus.split(0.05)['validation']] == [n for n, _ in split['validation']]


def test_byte_tokenizer_roundtrip_and_separator():
  tok = ByteTokenizer()
  text = 'def f(x):\n  return "héllo"'
  ids = tok.encode(text)
  assert ids.max() < 256 and 0 not in ids
  assert tok.decode(ids) == text


def test_bpe_train_roundtrip(tmp_path):
  texts = [t for _, t in corpus.documents()[:40]]
  tok = train_bpe(texts, 400, str(tmp_path / 'bpe.json'))
  assert tok.vocab_size == 400
  again = load_tokenizer(str(tmp_path / 'bpe.json'))
  sample = texts[3][:500]
  ids = again.encode(sample)
  assert len(ids) < len(sample.encode())  # BPE merges compress
  assert again.decode(ids) == sample


def test_token_file_roundtrip_and_memmap(tmp_path):
  path = str(tmp_path / 't.bin')
  toks = np.random.default_rng(0).integers(0, 1000, 5000)
  sources.write_token_file(path, toks, 1000, 'byte')
  src = sources.TokenFile(path)
  assert isinstance(src.tokens, np.memmap)
  np.testing.assert_array_equal(src.read(100, 200), toks[100:200])


def test_bad_token_id_names_file_and_offset(tmp_path):
  path = str(tmp_path / 'bad.bin')
  toks = np.arange(300) % 200
  sources.write_token_file(path, toks, 300, 'byte')
  with open(path, 'r+b') as f:  # rewrite the header's vocab to 200 so id 250 is out of range
    data = f.read()
    f.seek(0)
    f.write(data.replace(b'"vocab_size": 300', b'"vocab_size": 150'))
  with pytest.raises(ValueError, match=r'bad\.bin.*offset 150'):
    sources.TokenFile(path)
  with pytest.raises(ValueError, match='offset 3'):
    sources.write_token_file(str(tmp_path / 'x.bin'), [1, 2, 3, 400], 300, 'byte')


def test_truncated_and_foreign_files_are_reported(tmp_path):
  path = str(tmp_path / 't.bin')
  sources.write_token_file(path, np.arange(100), 256, 'byte')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) - 10)
  with pytest.raises(ValueError, match='truncated'):
    sources.TokenFile(path)
  other = tmp_path / 'o.bin'
  other.write_bytes(b'hello world, not tokens')
  with pytest.raises(ValueError, match='bad magic'):
    sources.TokenFile(str(other))


def test_bad_headers_are_reported_naming_the_file(tmp_path):
  """A header without num_tokens, or with a float dtype, is an error naming the file."""
  import struct
  for name, header, match in (
      ('nokey.bin', {'dtype': 'uint16', 'vocab_size': 256, 'tokenizer': 'byte'},
       r"nokey\.bin.*lacks \['num_tokens'\]"),
      ('float.bin', {'dtype': 'float32', 'vocab_size': 256, 'tokenizer': 'byte',
                     'num_tokens': 4}, r"float\.bin.*'float32' is not an integer type")):
    body = json.dumps(header).encode()
    head = sources.MAGIC + struct.pack('<Q', len(body)) + body
    head += b'\0' * (-len(head) % 64)
    (tmp_path / name).write_bytes(head + np.full(4, 5.5, np.float32).tobytes())
    with pytest.raises(ValueError, match=match):
      sources.TokenFile(str(tmp_path / name))


def test_zarr_source_matches_token_file(tmp_path):
  toks = np.random.default_rng(1).integers(0, 70000, 3000)
  sources.write_zarr(str(tmp_path / 'z'), toks, 70000, 'byte', chunk=512)
  src = sources.ZarrTokens(str(tmp_path / 'z'))
  assert src.vocab_size == 70000
  np.testing.assert_array_equal(src.read(1000, 1600), toks[1000:1600])
  spec = json.dumps({'driver': 'file', 'path': str(tmp_path / 'z')})
  np.testing.assert_array_equal(sources.ZarrTokens(spec).read(0, 10), toks[:10])


def _file_cfg(path, **kw):
  return pipeline.DataConfig(source='tokens', path=path, seq_len=8, batch_size=4, **kw)


def test_too_short_and_vocab_mismatch(tmp_path):
  path = str(tmp_path / 's.bin')
  sources.write_token_file(path, np.arange(8), 256, 'byte')
  with pytest.raises(ValueError, match='too short'):
    pipeline.train_iterator(_file_cfg(path), 256, 10)
  sources.write_token_file(path, np.arange(100) % 50, 512, 'byte')
  with pytest.raises(ValueError, match='exceeds model.vocab_size=256'):
    pipeline.train_iterator(_file_cfg(path), 256, 10)


def test_windows_are_contiguous_text_with_shifted_targets(tmp_path):
  path = str(tmp_path / 'w.bin')
  toks = np.arange(1000) % 251
  sources.write_token_file(path, toks, 256, 'byte')
  b = next(pipeline.train_iterator(_file_cfg(path), 256, 10))
  np.testing.assert_array_equal(b['targets'][:, :-1], b['inputs'][:, 1:])
  starts = b['inputs'][:, 0]
  for row, s in zip(b['inputs'], starts):
    idx = int(np.flatnonzero(toks[:-8] == s)[0])  # windows start at multiples of seq_len
    np.testing.assert_array_equal(row, toks[idx:idx + 8])


def test_order_depends_on_seed_only_and_covers_every_window_per_epoch(tmp_path):
  path = str(tmp_path / 'o.bin')
  sources.write_token_file(path, np.arange(8 * 40 + 1) % 256, 256, 'byte')
  cfg = _file_cfg(path)
  w = pipeline.Windows(cfg, 'train', 256)
  a = pipeline.StepBatches(w, 4, seed=3)
  ids = np.concatenate([a.example_ids(s) for s in range(10)])  # one epoch = 40 windows
  assert sorted(ids) == list(range(40))
  assert np.array_equal(ids, np.concatenate([pipeline.StepBatches(w, 4, 3).example_ids(s)
                                             for s in range(10)]))
  other = np.concatenate([pipeline.StepBatches(w, 4, 4).example_ids(s) for s in range(10)])
  assert not np.array_equal(ids, other)
  epoch2 = np.concatenate([a.example_ids(s) for s in range(10, 20)])
  assert sorted(epoch2) == list(range(40)) and not np.array_equal(epoch2, ids)


def test_process_shards_concatenate_to_the_global_batch(tmp_path):
  path = str(tmp_path / 'p.bin')
  sources.write_token_file(path, np.random.default_rng(0).integers(0, 256, 4000), 256, 'byte')
  cfg = _file_cfg(path)
  whole = pipeline.train_iterator(cfg, 256, 5)
  parts = [pipeline.train_iterator(cfg, 256, 5, rows=range(2 * p, 2 * p + 2))
           for p in range(2)]
  for _ in range(5):
    g = next(whole)
    local = [next(it) for it in parts]
    np.testing.assert_array_equal(np.concatenate([l['inputs'] for l in local]), g['inputs'])


def test_iterator_state_resumes_exactly():
  cfg = pipeline.DataConfig(seq_len=32, batch_size=4)
  it = pipeline.train_iterator(cfg, 256, 20)
  for _ in range(3):
    next(it)
  state = it.get_state()
  rest = [next(it)['inputs'] for _ in range(4)]
  resumed = pipeline.train_iterator(cfg, 256, 20, state=json.loads(json.dumps(state)))
  for r in rest:
    np.testing.assert_array_equal(next(resumed)['inputs'], r)


@pytest.mark.parametrize('task', sorted(synthetic.TASKS))
def test_synthetic_answers_are_correct_and_masked(task):
  for i in range(20):
    tokens, mask = synthetic.example(task, 0, i, 64)
    text = bytes(tokens[tokens > 0].astype(np.uint8)).decode()
    prompt, answer = text.split('=')
    body = prompt.split(':', 1)[1]
    if task == 'dyck':
      stack = []
      for ch in body:
        if ch in '([{<':
          stack.append(ch)
        else:
          assert '([{<'[')]}>'.index(ch)] == stack.pop()
      assert answer == ''.join(')]}>'['([{<'.index(c)] for c in reversed(stack))
    elif task == 'parity':
      assert int(answer) == body.count('1') % 2
    elif task == 'addition':
      assert int(answer) == sum(int(x) for x in body.split('+'))
    else:
      p = int(prompt[1:prompt.index(':')])
      pos = len(body) - 1
      for _ in range(p):
        prev = [j for j in range(pos) if body[j] == body[pos]]
        if not prev:
          break
        pos = prev[-1] + 1
      assert answer == body[pos]
    # the mask marks exactly the positions whose target is an answer byte
    marked = bytes(tokens[1:][mask > 0].astype(np.uint8)).decode()
    assert marked == answer
  assert np.array_equal(synthetic.example(task, 0, 5, 64)[0], synthetic.example(task, 0, 5, 64)[0])


def test_synthetic_bad_inputs():
  with pytest.raises(ValueError, match='data.task'):
    synthetic.example('sorting', 0, 0, 64)
  with pytest.raises(ValueError, match='data.seq_len=4'):
    synthetic.example('addition', 0, 0, 4)


def test_prepare_jsonl_and_text(tmp_path):
  (tmp_path / 'a.jsonl').write_text('{"text": "hello"}\n{"text": "world"}\n')
  (tmp_path / 'b.txt').write_text('plain text')
  info = prepare([str(tmp_path / 'a.jsonl'), str(tmp_path / 'b.txt')], str(tmp_path / 'o.bin'))
  src = sources.TokenFile(str(tmp_path / 'o.bin'))
  assert ByteTokenizer().decode(src.read(0, len(src))) == 'helloworldplain text'
  assert info['num_tokens'] == len('hello') + len('world') + len('plain text') + 3
  (tmp_path / 'bad.jsonl').write_text('{"text": "ok"}\n{"body": "x"}\n')
  with pytest.raises(ValueError, match=r'bad\.jsonl:2'):
    prepare([str(tmp_path / 'bad.jsonl')], str(tmp_path / 'x.bin'))


def test_lossy_tokenizer_on_the_embedded_corpus_warns(tmp_path, caplog):
  """A tokenizer that cannot encode the corpus's characters (no byte fallback) is reported,
  naming it, rather than silently training on text with characters missing."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(['abc def ghi ' * 50],
                          trainers.BpeTrainer(vocab_size=60, special_tokens=['<|endoftext|>']))
  path = str(tmp_path / 'ascii.json')
  tok.save(path)
  pipeline._embedded(path, 0.02)  # pylint: disable=protected-access
  err = '\n'.join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
  assert f"data.tokenizer='{path}' does not read back" in err


def test_a_bad_id_is_found_by_the_read_that_meets_it_not_by_a_scan_at_start(tmp_path,
                                                                            monkeypatch):
  """Opening a token file checks its header and a sample of its ids (first and last chunk
  here), not every id; the read whose window holds a bad id fails with one line naming the
  file and the offset."""
  monkeypatch.setattr(sources, 'CHECK_CHUNK', 64)
  monkeypatch.setattr(sources, 'SAMPLE_CHUNKS', 2)
  path = str(tmp_path / 'bad.bin')
  tokens = np.random.default_rng(0).integers(0, 200, 640)
  sources.write_token_file(path, tokens, 256, 'byte')
  raw = bytearray(open(path, 'rb').read())
  _, offset = sources.read_header(path)
  struct.pack_into('<H', raw, offset + 2 * 300, 999)  # id 999 at offset 300 (chunk 4 of 10)
  open(path, 'wb').write(bytes(raw))
  src = sources.TokenFile(path)  # the sampled chunks (0 and 9) are clean: it opens
  np.testing.assert_array_equal(src.read(0, 100), tokens[:100])
  with pytest.raises(ValueError, match=rf"{re.escape(path)}: token id 999 at offset 300 is "
                                       r'outside the vocabulary of 256'):
    src.read(290, 310)
  raw_last = bytearray(raw)
  struct.pack_into('<H', raw_last, offset + 2 * 630, 999)  # in the last chunk: found at open
  open(path, 'wb').write(bytes(raw_last))
  with pytest.raises(ValueError, match=r'token id 999 at offset 300'):  # the first bad one
    sources.check_ids(sources.Sliceable(sources.TokenFile(path, check=False)), 256, path)
  with pytest.raises(ValueError, match=r'token id 999 at offset 630'):
    sources.TokenFile(path)
