"""Turns text and JSONL files into token files (see sources.py for the formats)."""
from __future__ import annotations

import json
import os

import numpy as np

from loopmoe_jax.data import corpus, sources
from loopmoe_jax.data.tokenizers import load_tokenizer, train_bpe


def read_texts(paths, field: str = 'text'):
  """Yields documents: a whole .txt file, each JSONL line's `field`, or the embedded corpus."""
  for path in paths:
    if path == 'embedded':
      yield from (text for _, text in corpus.documents())
      continue
    if not os.path.exists(path):
      raise FileNotFoundError(f'input file {path!r} does not exist')
    with open(path, encoding='utf-8') as f:
      if path.endswith('.jsonl'):
        for n, line in enumerate(f, 1):
          if line.strip():
            try:
              yield json.loads(line)[field]
            except (ValueError, KeyError, TypeError):
              raise ValueError(f'{path}:{n}: not a JSON object with a {field!r} field') from None
      else:
        yield f.read()


def prepare(inputs, output: str, fmt: str = 'tokens', tokenizer: str = 'byte',
            train_vocab: int = 0, field: str = 'text') -> dict:
  if train_vocab:
    if tokenizer in ('', 'byte'):
      raise ValueError('--train_bpe needs --tokenizer=PATH.json to save the tokenizer to')
    tok = train_bpe(read_texts(inputs, field), train_vocab, tokenizer)
  else:
    tok = load_tokenizer(tokenizer)
  pieces = []
  for text in read_texts(inputs, field):
    pieces += [tok.encode(text), np.asarray([tok.eos_id], np.int32)]
  if not pieces:
    raise ValueError(f'no documents in {inputs}')
  tokens = np.concatenate(pieces)
  if fmt == 'zarr':
    sources.write_zarr(output, tokens, tok.vocab_size, tok.name)
  else:
    sources.write_token_file(output, tokens, tok.vocab_size, tok.name)
  return {'output': output, 'format': fmt, 'num_tokens': int(tokens.size),
          'vocab_size': tok.vocab_size, 'tokenizer': tok.name}
