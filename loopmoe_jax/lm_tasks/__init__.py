"""The offline task pack for the LM Evaluation Harness (lm-eval): task YAMLs over local JSONL
files in this directory, built from the held-out documents of the embedded corpus (data/corpus.py),
so a checkpoint is scored on a standard harness task without a network.

    loopmoe_next_line   multiple choice, 4 choices (chance 0.25): the preceding lines of a Python
                        source (or a help topic), then the true next line among 3 distractor lines
                        drawn from the other held-out documents, each with the same indentation
                        as the true line and a length within 15% of it (so neither indentation
                        nor length gives the answer). Its score is acc_mutual_info, log p(line |
                        context) - log p(line): with real lines as distractors, the raw
                        likelihood (acc, also reported) mostly ranks how typical a line is (the
                        README main job: acc at chance, acc_mutual_info a little above it).
    loopmoe_line_end    multiple choice, 4 choices of one length (chance 0.25): the preceding
                        lines and the start of the next one, cut at a random character; the rest
                        of the line among the endings (as many characters) of 3 lines of the
                        other held-out documents. Easier: the cut line's own start (an open
                        bracket, a half-written name) constrains its end (the main job: acc about
                        0.5, acc_mutual_info about 0.85 at its 3 trained passes).
    tag loopmoe         both.

The documents are those the embedded corpus holds out at the default data.val_fraction=0.02
(corpus.is_validation: a hash of the document's name, the same on every Python), so a model
trained on the embedded corpus at that fraction has never seen them. The JSONL is generated
deterministically (`next_line_examples`, a seeded numpy generator over the documents in their
fixed order) and committed: the texts are this Python's standard library, which differs a little
between Python versions, and a committed file keeps the task the same everywhere. Rebuild it with

    python -m loopmoe_jax.lm_tasks     # rewrites next_line.jsonl, line_end.jsonl and build.json

The harness finds the pack through `lm_eval.tasks.TaskManager(include_path=PACK_DIR)`
(analysis/lm_harness.py). Each YAML loads its rows with `load_jsonl` (`custom_dataset`), which
reads `dataset_kwargs.data_files` relative to this directory, so an installed package (the files
shipped as package data) finds them from any working directory. Nothing here imports lm-eval.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

from loopmoe_jax.data import corpus

PACK_DIR = os.path.dirname(os.path.abspath(__file__))
VAL_FRACTION = 0.02  # data.val_fraction's default: the documents the main job holds out


def _lines(text: str) -> list[str]:
  return text.split('\n')


def _candidate(line: str, min_chars: int, max_chars: int) -> bool:
  """A line that can be an answer or a distractor: some content, not too long."""
  body = line.strip()
  return min_chars <= len(body) and len(line) <= max_chars and '\0' not in line


def _indent(line: str) -> str:
  return line[:len(line) - len(line.lstrip())]


def _context(lines: list[str], i: int, context_lines: int, context_chars: int) -> str:
  """Up to `context_lines` whole lines before line i (at most `context_chars` characters, at
  least one line), each with its newline."""
  context: list[str] = []
  for j in range(i - 1, max(-1, i - 1 - context_lines), -1):
    if context and len(lines[j]) + 1 + sum(len(c) + 1 for c in context) > context_chars:
      break
    context.insert(0, lines[j])
  return ''.join(c + '\n' for c in context)


def _examples(kind: str, examples: int = 400, choices: int = 4, context_lines: int = 8,
              context_chars: int = 400, min_chars: int = 12, max_chars: int = 72,
              length_slack: float = 0.15, min_tail: int = 6, seed: int = 0,
              fraction: float = VAL_FRACTION) -> list[dict]:
  """The rows of task `kind` ('next_line' or 'line_end'): {'context', 'choices', 'label',
  'source'} (see next_line_examples, line_end_examples)."""
  docs = corpus.split(fraction)['validation']
  rng = np.random.default_rng(seed)
  pool: dict[str, list[tuple[int, str]]] = {}  # indentation -> (doc index, line)
  per_doc = []
  for d, (_, text) in enumerate(docs):
    lines = _lines(text)
    ok = [i for i, line in enumerate(lines) if _candidate(line, min_chars, max_chars)]
    for i in ok:
      pool.setdefault(_indent(lines[i]), []).append((d, lines[i]))
    per_doc.append([i for i in ok if i > 0 and lines[i - 1].strip()])
  every = sorted(pool.items())
  want = [examples // len(docs) + (d < examples % len(docs)) for d in range(len(docs))]
  rows = []
  for d, (name, text) in enumerate(docs):
    lines = _lines(text)
    picks = rng.permutation(per_doc[d])
    taken = 0
    for i in picks:
      if taken >= want[d]:
        break
      line, context = lines[i], _context(lines, i, context_lines, context_chars)
      if kind == 'next_line':
        near = max(min_chars // 3, int(length_slack * len(line)))
        others = sorted({l for e, l in pool.get(_indent(line), [])
                         if e != d and l != line and abs(len(l) - len(line)) <= near})
        answer = line
      else:  # line_end: the line cut after its first 4 characters or later, >= min_tail kept
        cut = int(rng.integers(len(_indent(line)) + 4, len(line) - min_tail + 1))
        context, answer = context + line[:cut], line[cut:]
        others = sorted({l[-len(answer):] for _, group in every for e, l in group
                         if e != d and len(l.lstrip()) > len(answer) and
                         l[-len(answer):] != answer})
      if len(others) < choices - 1:
        continue
      distractors = [others[k] for k in rng.choice(len(others), choices - 1, replace=False)]
      label = int(rng.integers(choices))
      options = distractors[:label] + [answer] + distractors[label:]
      rows.append({'context': context, 'choices': [o + '\n' for o in options],
                   'label': label, 'source': f'{name}:{i + 1}'})
      taken += 1
  return rows


def next_line_examples(**kw) -> list[dict]:
  """The rows of loopmoe_next_line: {'context', 'choices', 'label', 'source'}.

  The context is up to `context_lines` whole lines before the answer (at most `context_chars`
  characters, at least one line), ending in a newline; each choice is one line with its newline;
  `label` indexes the true one. At most `examples` answers, spread evenly over the held-out
  documents (their lines drawn by `seed`; a short document gives fewer); the distractors are
  drawn from the other held-out documents' lines of the same indentation and a length within
  `length_slack` of the answer's (at least min_chars // 3 characters), all choices distinct."""
  return _examples('next_line', **kw)


def line_end_examples(**kw) -> list[dict]:
  """The rows of loopmoe_line_end: as next_line's, but the context runs on into the answer's
  line, cut at a random character (at least 4 into its text, at least `min_tail` left); the
  choices are the rest of that line and the last as many characters of 3 lines of the other
  held-out documents (every choice the same length, so the raw likelihood compares them)."""
  return _examples('line_end', **{'seed': 1, **kw})


FILES = {'next_line.jsonl': next_line_examples, 'line_end.jsonl': line_end_examples}


def write_pack(directory: str | None = None) -> dict:
  """Writes every task's rows as JSONL (default: into the pack) and one build record,
  build.json: per file, the rows' count and SHA-256, and the Python whose standard library
  the rows come from."""
  directory = directory or PACK_DIR
  record = {'python': sys.version.split()[0], 'files': {}}
  for name, fn in FILES.items():
    text = ''.join(json.dumps(r, ensure_ascii=False, sort_keys=True) + '\n' for r in fn())
    with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
      f.write(text)
    record['files'][name] = {'rows': text.count('\n'),
                             'sha256': hashlib.sha256(text.encode()).hexdigest()}
  with open(os.path.join(directory, 'build.json'), 'w') as f:
    json.dump(record, f, indent=1, sort_keys=True)
  return record


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def load_jsonl(data_files=None, **unused):
  """A task's `custom_dataset`: {split: datasets.Dataset} of the JSONL files named by its
  `dataset_kwargs.data_files` ({split: file}), relative to this directory. The harness also
  passes the task's metadata as keywords (ignored)."""
  del unused
  import datasets
  if not isinstance(data_files, dict) or not data_files:
    raise ValueError(f'lm_tasks.load_jsonl: data_files={data_files!r}: expected {{split: file}}')
  out = {}
  for split, name in data_files.items():
    path = name if os.path.isabs(name) else os.path.join(PACK_DIR, name)
    if not os.path.exists(path):
      raise FileNotFoundError(f'task pack file {path!r} does not exist (python -m '
                              'loopmoe_jax.lm_tasks builds it)')
    out[split] = datasets.Dataset.from_list(read_jsonl(path))
  return datasets.DatasetDict(out)
