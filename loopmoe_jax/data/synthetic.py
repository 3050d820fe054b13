"""Synthetic reasoning tasks, generated from (seed, index), answers masked for scoring.

Each example is text encoded byte-level: a prompt, '=', the answer, then NUL padding.
`example(task, seed, index, seq_len, **kw)` returns (tokens [seq_len + 1], answer_mask
[seq_len]) where answer_mask marks target positions (next-token predictions) inside the
answer. Tasks:
- dyck: a prefix of a Dyck-k word (k bracket types, depth <= max_depth); the answer closes it.
- parity: a bit string; the answer is the parity of its ones.
- addition: n numbers of up to `digits` digits; the answer is their sum.
- induction: p-hop induction over random letters: start from the last letter, p times jump to
  the letter after the previous occurrence of the current letter; the answer is where it ends.
"""
from __future__ import annotations

import numpy as np

BRACKETS = '()[]{}<>'
LETTERS = 'abcdefghijklmnop'


def dyck(rng, k: int = 2, max_depth: int = 4, length: int = 16):
  if not 1 <= k <= len(BRACKETS) // 2:
    raise ValueError(f'dyck k={k}: must be in 1..{len(BRACKETS) // 2}')
  stack, out = [], []
  for _ in range(length):
    if stack and (len(stack) >= max_depth or rng.random() < 0.5):
      out.append(BRACKETS[2 * stack.pop() + 1])
    else:
      b = int(rng.integers(k))
      stack.append(b)
      out.append(BRACKETS[2 * b])
  if not stack:  # make sure there is something to close
    b = int(rng.integers(k))
    stack.append(b)
    out.append(BRACKETS[2 * b])
  return 'D:' + ''.join(out), ''.join(BRACKETS[2 * b + 1] for b in reversed(stack))


def parity(rng, length: int = 16):
  bits = rng.integers(0, 2, length)
  return 'P:' + ''.join(map(str, bits)), str(int(bits.sum()) % 2)


def addition(rng, n: int = 2, digits: int = 3):
  nums = [int(rng.integers(0, 10 ** digits)) for _ in range(n)]
  return 'A:' + '+'.join(map(str, nums)), str(sum(nums))


def induction(rng, p: int = 2, length: int = 24, alphabet: int = 8):
  seq = [LETTERS[i] for i in rng.integers(0, alphabet, length)]
  pos = len(seq) - 1
  for _ in range(p):
    prev = [i for i in range(pos) if seq[i] == seq[pos]]
    if not prev:
      break
    pos = prev[-1] + 1
  return f'H{p}:' + ''.join(seq), seq[pos]


TASKS = {'dyck': dyck, 'parity': parity, 'addition': addition, 'induction': induction}


def example(task: str, seed: int, index: int, seq_len: int, **kw):
  if task not in TASKS:
    raise ValueError(f'data.task={task!r}: must be one of {sorted(TASKS)}')
  rng = np.random.default_rng([seed, index])
  prompt, answer = TASKS[task](rng, **kw)
  text = (prompt + '=' + answer).encode()
  if len(text) + 1 > seq_len + 1:
    raise ValueError(f'data.task={task!r}: an example of {len(text) + 1} tokens does not fit '
                     f'data.seq_len={seq_len}')
  tokens = np.zeros(seq_len + 1, np.int32)
  tokens[:len(text)] = np.frombuffer(text, np.uint8)
  mask = np.zeros(seq_len, np.float32)
  start = len(prompt) + 1  # token index of the first answer byte
  mask[start - 1:start - 1 + len(answer)] = 1.0
  return tokens, mask
