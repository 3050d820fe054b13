"""Tokenizers: byte-level (default, no files) and any Hugging Face `tokenizers` JSON file."""
from __future__ import annotations

import os

import numpy as np


class ByteTokenizer:
  """UTF-8 bytes; id 0 (the NUL byte, absent from text) separates documents."""
  name = 'byte'
  vocab_size = 256
  eos_id = 0

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.replace('\0', '').encode('utf-8'), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 < int(i) < 256).decode('utf-8', errors='replace')


class HFTokenizer:
  """A `tokenizers` JSON file (BPE, Unigram, ...). EOS: the first of a few usual names."""

  def __init__(self, path: str):
    if not os.path.exists(path):
      raise FileNotFoundError(f'tokenizer file {path!r} does not exist')
    from tokenizers import Tokenizer
    try:
      self._tok = Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception on bad JSON
      raise ValueError(f'tokenizer file {path!r} is not a tokenizers JSON file: {e}') from e
    self.name = os.path.abspath(path)
    self.vocab_size = self._tok.get_vocab_size()
    vocab = self._tok.get_vocab()
    ids = [vocab[t] for t in ('<|endoftext|>', '</s>', '<eos>', '[SEP]', '<|eos|>') if t in vocab]
    self.eos_id = ids[0] if ids else 0

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
  """'byte' or a path to a tokenizers JSON file."""
  return ByteTokenizer() if spec in ('', 'byte') else HFTokenizer(spec)


def train_bpe(texts, vocab_size: int, path: str):
  """Trains a byte-level BPE tokenizer on an iterable of strings and saves it to `path`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=['<|endoftext|>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  tok.save(path)
  return HFTokenizer(path)
