"""Text generation from a checkpoint: one prompt or a JSON-lines file of them, batched or
loop-draft speculative (scripts/generate.py).

    rows = generate_texts('/tmp/run', ['def ', 'class '], Options(tokens=64, batch_size=8))
    rows[0]   # {'prompt': 'def ', 'text': '...', 'tokens': 64, 'stopped': False}

Prompts file: one JSON value a line, an object with a "prompt" string or a bare string.
Output rows keep the input order. Plain decoding runs batched.generate_batch (prompts of any
lengths in one batch, each row its single-prompt decode); `speculative` = (d, g) runs
speculative.generate_speculative one prompt at a time and adds the round statistics.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import jax
import numpy as np

from loopmoe_jax import attention_impls
from loopmoe_jax.batched import generate_batch
from loopmoe_jax.data import pipeline
from loopmoe_jax.model import check_loops
from loopmoe_jax.sampling import Sampling
from loopmoe_jax.speculative import check_speculative, generate_speculative, stats_summary
from loopmoe_jax.train.run import as_loaded

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Options:
  """What to generate: `tokens` new tokens at most per prompt, drawn by `sampling`, stopping
  after any of `stop` (strings of one token each), `batch_size` prompts a batch, or with
  `speculative` = (draft_loops, lookahead) the loop-draft decode (batch 1); `attention_impl`
  the run's run.attention_impl replaced (on a TPU 'xla' keeps XLA's decode products instead
  of the Pallas decode kernels)."""
  tokens: int = 200
  sampling: Sampling = Sampling()
  seed: int = 0
  batch_size: int = 8
  num_loops: int | None = None
  step: int | None = None
  scale_passes: str | None = None
  kv_cache: str | None = None
  stop: tuple[str, ...] = ()
  speculative: tuple[int, int] | None = None
  attention_impl: str | None = None


def read_prompts(path: str) -> list[str]:
  """The prompts of a JSON-lines file (module docstring), or a ValueError naming the line."""
  out = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        value = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{n}: not JSON ({e.msg})') from None
      text = value.get('prompt') if isinstance(value, dict) else value
      if not isinstance(text, str) or not text:
        raise ValueError(f'{path}:{n}: want a non-empty string or {{"prompt": "..."}}')
      out.append(text)
  if not out:
    raise ValueError(f'{path}: no prompts')
  return out


def write_rows(path: str, rows: list[dict]) -> None:
  with open(path, 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')


def _stop_ids(tok, stop: tuple[str, ...]) -> list[int]:
  """The token id of each stop string (each must be one token)."""
  ids = []
  for s in stop:
    enc = np.asarray(tok.encode(s)).tolist()
    if len(enc) != 1:
      raise ValueError(f'--stop={s!r}: encodes to {len(enc)} tokens under {tok.name!r}; a stop '
                       'string must be one token')
    ids.append(enc[0])
  return ids


def _encode(tok, prompts: list[str]) -> list[list[int]]:
  ids = []
  for p in prompts:
    enc = np.asarray(tok.encode(p)).tolist()
    if not enc:
      raise ValueError(f'prompt {p!r}: the tokenizer {tok.name!r} encodes none of it')
    ids.append(enc)
  return ids


def generate_texts(workdir, prompts: list[str], opts: Options) -> list[dict]:
  """Continuations of `prompts` from a checkpoint (a workdir or a run.Loaded): one row each
  (module docstring); every setting is checked before anything is decoded."""
  run = as_loaded(workdir, opts.step)
  cfg, params, bias = run.model_cfg, run.params, run.router_bias
  if opts.scale_passes:
    cfg = cfg.replace(scale_passes=opts.scale_passes)
  if opts.kv_cache:
    cfg = cfg.replace(kv_cache=opts.kv_cache)
  check_loops(cfg, opts.num_loops)
  if opts.speculative:
    check_speculative(cfg, opts.num_loops, *opts.speculative)
  runtime = run.runtime
  if opts.attention_impl:
    runtime = runtime.with_run(attention_impl=opts.attention_impl)
    attention_impls.check(runtime, cfg)
  tok = pipeline.data_tokenizer(run.exp.data)
  if tok is None:
    raise ValueError(f'{run.workdir}: the tokenizer of its training data '
                     f'({pipeline.tokenizer_spec(run.exp.data)!r}) cannot be loaded')
  ids, stops = _encode(tok, prompts), _stop_ids(tok, opts.stop)
  longest = max(len(i) for i in ids) + opts.tokens
  if longest > run.exp.data.seq_len:
    log.warning(f'prompts of up to {longest - opts.tokens} tokens + {opts.tokens} new run past '
                f'the {run.exp.data.seq_len} tokens the model was trained on')
  key = jax.random.key(opts.seed)
  if opts.speculative:
    made = _speculative_rows(cfg, params, bias, runtime, ids, stops, key, opts)
  else:
    made = [(g.tokens, g.stopped, {}) for g in generate_batch(
        cfg, params, ids, opts.tokens, key, opts.sampling, stops, opts.batch_size,
        opts.num_loops, bias, runtime)]
  return [{'prompt': p, 'text': tok.decode(np.asarray(t, np.int32)), 'tokens': len(t),
           'stopped': s, **extra} for p, (t, s, extra) in zip(prompts, made)]


def _speculative_rows(cfg, params, bias, runtime, ids, stops, key, opts: Options):
  """(tokens, stopped, round statistics) of each prompt under the loop-draft decode."""
  d, g = opts.speculative
  loops = check_loops(cfg, opts.num_loops)
  rows = []
  for i, prompt in enumerate(ids):
    out = generate_speculative(cfg, params, np.asarray([prompt], np.int32), opts.tokens,
                               jax.random.fold_in(key, i), draft_loops=d, lookahead=g,
                               sampling=opts.sampling, num_loops=opts.num_loops,
                               router_bias=bias, runtime=runtime, stop_tokens=stops or None)
    new = np.asarray(out.tokens[0, len(prompt):len(prompt) + int(out.length)]).tolist()
    cut = next((j + 1 for j, t in enumerate(new) if t in stops), None)
    rows.append((new[:cut] if cut else new, cut is not None,
                 stats_summary(jax.device_get(out.stats), d, g, loops)))
  return rows
