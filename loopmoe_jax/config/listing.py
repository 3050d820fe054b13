"""Every config field with its value and one line of meaning (`scripts/describe.py --fields`).

The meaning of a field is its comment in the section's dataclass (config/*.py): the comment
after the field (continued on the aligned comment lines below it), else the comment block
right above it (one that starts with a capital letter is a heading of the fields below, not
one field's); a field with neither has its line in NOTES. So a field added to a section
with a comment is listed with it, and one added without a comment fails the listing test.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize

SECTIONS = ('model', 'run', 'train', 'data', 'mesh')

# The fields whose dataclass line carries no comment.
NOTES = {
    'model.vocab_size': 'tokens in the vocabulary (embedding and output rows)',
    'model.d_model': 'width of the residual stream (D)',
    'model.num_heads': 'attention query heads per layer',
    'model.top_k': 'experts each token is routed to in every MoE layer (k)',
    'model.prelude_layers': 'layers before the looped core, run once',
    'model.prelude_experts': 'experts per prelude layer (0: dense SwiGLU layers)',
    'model.core_layers': 'layers of the core block, run model.num_loops times over shared weights',
    'model.core_experts': 'experts per core layer (0: dense SwiGLU layers)',
    'model.num_loops': 'passes through the core (r; 1: an unlooped model)',
    'model.coda_layers': 'layers after the looped core, run once',
    'model.coda_experts': 'experts per coda layer (0: dense SwiGLU layers)',
    'model.num_shared_experts': 'always-on shared experts beside the routed ones in each MoE '
                                'layer (0: none)',
    'model.tie_embeddings': 'the output projection reuses the input embedding matrix',
    'model.norm_gain': 'RMSNorm layers have a learned gain',
    'model.norm_eps': 'epsilon of RMSNorm',
    'model.rope_theta': 'base of the rotary position embedding frequencies',
    'model.param_dtype': 'dtype the parameters are stored and updated in',
    'run.dispatch_tile': "row tile of the 'tiled' MoE dispatch",
    'train.steps': 'train steps of this run',
    'train.schedule': 'learning-rate schedule: wsd | cosine | constant',
    'train.warmup': 'steps of linear learning-rate warmup',
    'train.decay_shape': 'WSD decay curve: 1-sqrt | linear | cosine',
    'train.final_lr_fraction': 'learning rate at the end of the schedule, as a fraction of '
                               'train.lr',
    'train.b1': 'AdamW first-moment decay',
    'train.b2': 'AdamW second-moment decay',
    'train.eps': 'AdamW epsilon',
    'train.lb_coef': 'weight of the router load-balancing loss',
    'train.z_coef': 'weight of the router z-loss',
    'train.log_every': 'steps between metrics.jsonl rows and progress lines',
    'train.eval_every': 'steps between validation losses',
    'train.save_every': 'steps between checkpoints',
    'train.async_save': 'checkpoints are written in the background while training goes on',
    'train.sample_prompt': 'prompt of the text sample printed at the end',
    'data.val_fraction': 'share of the embedded corpus held out for validation',
    'data.seq_len': 'tokens per training sequence (the context)',
    'data.seed': 'seed of the data order (shuffling)',
    'data.val_batches': 'validation batches per evaluation',
    'data.num_threads': "data loader threads (the order does not depend on them)",
    'data.prefetch': 'batches the loader prepares ahead',
    'mesh.data': 'data-parallel axis size (-1: the remaining devices)',
    'mesh.fsdp': 'fully-sharded data-parallel axis size: parameters split over it',
    'mesh.expert': 'expert-parallel axis size: each MoE segment\'s experts split over it',
    'mesh.tensor': 'tensor-parallel axis size',
    'mesh.dcn_data': 'data-parallel axis across slices / hosts (the outermost)',
}


def section_classes() -> dict:
  """{section: its frozen dataclass}, in SECTIONS order."""
  from loopmoe_jax.experiment import SECTIONS as CLASSES  # pylint: disable=import-outside-toplevel
  return {name: CLASSES[name] for name in SECTIONS}


def _comments(source: str) -> dict[int, tuple[int, str, bool]]:
  """{line number: (column of '#', text, the line holds nothing but the comment)}."""
  out, code_lines = {}, set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      out[tok.start[0]] = (tok.start[1], tok.string.lstrip('#'), False)
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER, tokenize.STRING):
      code_lines.add(tok.start[0])
  return {n: (col, text, n not in code_lines) for n, (col, text, _) in out.items()}


def comment_meanings(cls) -> dict[str, str]:
  """{field: its comment} of a dataclass's fields that have one (see the module docstring)."""
  source = inspect.getsource(cls)
  lines = source.splitlines()
  comments = _comments(source)
  field_at = {}
  for n, line in enumerate(lines, 1):
    m = re.match(r'  (\w+): [^=]+=', line)
    if m and not line.startswith('   '):
      field_at[n] = m.group(1)
  out = {}
  for n, name in field_at.items():
    parts = []
    if n in comments and not comments[n][2]:
      col, text, _ = comments[n]
      parts.append(text)
      for k in range(n + 1, len(lines) + 1):  # aligned continuation lines
        c = comments.get(k)
        if not (c and c[2] and (c[0] > 2 or re.match(r' {8,}', c[1]))):
          break
        parts.append(c[1])
    else:
      k = n - 1
      while k in comments and comments[k][2] and comments[k][0] == 2:
        parts.insert(0, comments[k][1])
        k -= 1
      if parts and parts[0].strip()[:1].isupper():  # a heading
        parts = []
    if parts:
      out[name] = ' '.join(' '.join(parts).split())
  return out


def clauses(text: str) -> list[str]:
  """`text` split after each `;` and sentence end outside parentheses and quotes."""
  out, depth, start, quote = [], 0, 0, ''
  for i, ch in enumerate(text):
    if quote:
      quote = '' if ch == quote else quote
    elif ch in '\'"' and (i == 0 or not text[i - 1].isalnum()):
      quote = ch
    elif ch in '([':
      depth += 1
    elif ch in ')]':
      depth = max(0, depth - 1)
    elif depth == 0 and text[i:i + 2] in ('; ', '. ') and (ch == ';' or text[i - 1].islower()):
      out.append(text[start:i + 1])
      start = i + 2
  return out + [text[start:]] if text[start:].strip() else out


def one_line(text: str, width: int = 110) -> str:
  """The whole clauses of `text` that fit in `width` characters (at least the first, cut at a
  word), ` ...` ending a line that leaves some out."""
  parts = clauses(text)
  kept = ''
  for part in parts:
    if kept and len(kept) + 1 + len(part) > width:
      break
    kept = f'{kept} {part}' if kept else part
  if len(kept) > width:
    kept = kept[:width].rsplit(' ', 1)[0]
  return kept if kept == text else kept.rstrip(';.,') + ' ...'


def field_rows(config=None) -> list[tuple[str, object, str]]:
  """(section.field, value, meaning) for every field of every section: the value is the
  config's (a ConfigDict or dict, e.g. --config's) or else the dataclass default."""
  rows = []
  for section, cls in section_classes().items():
    meanings = comment_meanings(cls)
    given = {}
    if config is not None and section in config:
      given = dict(config[section].to_dict() if hasattr(config[section], 'to_dict')
                   else config[section])
    if section == 'run' and config is not None and 'model' in config:
      given = {**given, **{k: v for k, v in dict(config['model']).items()
                           if k in {f.name for f in dataclasses.fields(cls)}}}
    for f in dataclasses.fields(cls):
      key = f'{section}.{f.name}'
      meaning = meanings.get(f.name) or NOTES.get(key, '')
      rows.append((key, given.get(f.name, f.default), one_line(meaning) if meaning else ''))
  return rows


def format_rows(rows) -> str:
  """`section.field = value   meaning` lines, the columns aligned."""
  shown = [(k, repr(v) if isinstance(v, str) else str(v), m) for k, v, m in rows]
  kw = max(len(k) for k, _, _ in shown)
  vw = min(24, max(len(v) for _, v, _ in shown))
  return '\n'.join(f'{k:<{kw}} = {v:<{vw}}  {m}' for k, v, m in shown)
