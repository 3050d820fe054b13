"""The probe set of the routing diagnostics: exactly N held-out tokens of a run's validation
split (the split evaluation.py scores), the first N read in order as windows of data.seq_len
(the tail of the last window past N is masked out of the loss and left out of the records),
and the routing records and LM loss of a checkpoint over it.

The default N follows the scale (`scripts/diagnose.py --scale`, as `scripts/reproduce.py`):
at gpu scale Foil's probe set, "We measure expert use on the recurrent core over 255,500 probe
tokens" (Foil, the diagnostics' setup, Sec. 2.3; the paper says no more of how they are
drawn, and 255,500 is no whole number of its 4,096-token contexts, hence the exact count); at
cpu scale the small default diagnose has always used.

Records are numpy arrays per segment: 'experts' [N, C, L, k] and 'logits' [N, C, L, E] (tokens,
layers, passes, choices/experts); prelude and coda layers run once, so their L is 1.
"""
from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.data import pipeline
from loopmoe_jax.model import LoopedMoE, variables
from loopmoe_jax.objective import lm_loss
from loopmoe_jax.runtime import HERE, Runtime

SEGMENTS = ('prelude', 'core', 'coda')
FOIL_PROBE_TOKENS = 255_500  # Foil's probe set (Sec. 2.3)
DEFAULT_TOKENS = {'cpu': 16_384, 'gpu': FOIL_PROBE_TOKENS}


def default_tokens(scale: str) -> int:
  """The probe-set size of a scale (DEFAULT_TOKENS)."""
  if scale not in DEFAULT_TOKENS:
    raise ValueError(f'--scale={scale!r}: must be one of {tuple(DEFAULT_TOKENS)}')
  return DEFAULT_TOKENS[scale]


def setting(tokens: int | None, scale: str = 'cpu') -> tuple[int, str]:
  """(tokens, how they were chosen): `tokens` when given, else the scale's default."""
  n = default_tokens(scale)
  if tokens is not None:
    return tokens, 'given (--tokens)'
  what = "Foil's probe-set size, Sec. 2.3" if n == FOIL_PROBE_TOKENS else 'the small default'
  return n, f'the --scale={scale} default ({what})'


def describe(info: dict) -> str:
  """One line naming a probe set: its token count, where they come from, how it was chosen."""
  return (f"{info['tokens']:,} tokens, the first of the {info['split']} split in order "
          f"({info['windows']} windows of {info['seq_len']}"
          + (f", the last {info['masked_tail']} positions read masked out"
             if info['masked_tail'] else '') + ')'
          + (f"; size {info['setting']}" if info.get('setting') else ''))


def segment_experts(cfg: ModelConfig) -> dict:
  """{segment: (layers, experts)} for the segments whose layers have routed experts."""
  return {s: (layers, e) for s, layers, e, _ in cfg.segments if e}


def probe_batches(data_config: dict, cfg: ModelConfig, tokens: int) -> tuple[list, dict]:
  """(batches, info): ceil(tokens / seq_len) validation windows, rounded up to whole batches of
  min(data.batch_size, windows) rows; the positions past the first `tokens` (window-major
  order) get mask 0, so the probe set is exactly `tokens` tokens (`run(..., tokens=)` keeps
  their records alone). More tokens than the split holds is a ValueError."""
  if tokens < 1:
    raise ValueError(f'--tokens={tokens}: must be >= 1')
  dc = pipeline.DataConfig.from_dict(data_config)
  if dc.source != 'synthetic' and pipeline.open_source(dc, 'validation') is None:
    raise ValueError('the run has no validation data (data.val_path is empty)')
  windows = pipeline.Windows(dc, 'validation', cfg.vocab_size)
  s = dc.seq_len
  n = math.ceil(tokens / s)
  rows = min(dc.batch_size, n)
  n = math.ceil(n / rows) * rows
  if n > windows.num:
    raise ValueError(f'--tokens={tokens}: the probe set would need {n} windows of {s} tokens, '
                     f'but the validation split ({windows.name}) holds {windows.num} '
                     f'({windows.num * s} tokens); use --tokens <= {windows.num * s}')
  batches = [pipeline._stack([windows(i) for i in range(b, b + rows)])  # pylint: disable=protected-access
             for b in range(0, n, rows)]
  used = math.ceil(tokens / s)  # windows holding probe tokens; the rest fill the last batch
  keep = (np.arange(n * s) < tokens).reshape(-1, rows, s)
  for b, k in zip(batches, keep):
    b['mask'] = (b['mask'] * k).astype(np.float32)
  info = {'tokens_requested': tokens, 'tokens': tokens, 'windows': used, 'windows_read': n,
          'masked_tail': n * s - tokens, 'seq_len': s, 'batch_rows': rows,
          'batch_tokens': rows * s, 'split': windows.name}
  return batches, info


@functools.lru_cache(maxsize=None)
def loss_fn(cfg: ModelConfig, record: bool, *, runtime: Runtime):
  """jit(params, routing_mask, batch) -> (NLL sum, token count, routing records or {}), the
  model built for `runtime` (a run's: its stored run settings)."""
  model = LoopedMoE(cfg, runtime=runtime)

  def fn(params, routing_mask, batch):
    logits, extras = model.apply(variables(params, routing_mask=routing_mask or None),
                                 batch['inputs'], return_routing=record)
    count = jnp.sum(batch['mask'])
    nll = lm_loss(logits, batch['targets'], batch['mask']) * count
    return nll, count, extras.get('routing', {})
  return jax.jit(fn)


def to_NCL(seg: str, a) -> np.ndarray:
  """A segment's record -> [N, C, L, last]: core [L, C, B, T, x]; prelude/coda [C, B, T, x]."""
  a = np.asarray(a)
  if seg == 'core':
    l, d, b, t, x = a.shape
    return a.transpose(2, 3, 1, 0, 4).reshape(b * t, d, l, x)
  d, b, t, x = a.shape
  return a.transpose(1, 2, 0, 3).reshape(b * t, d, 1, x)


def run(cfg: ModelConfig, params, batches, routing_mask=None, record: bool = True,
        tokens: int | None = None, *, runtime: Runtime) -> dict:
  """{'loss': mean LM loss over the probe set (the batches' mask), 'routing': {segment:
  {'experts', 'logits'}} of the first `tokens` tokens (all when None), 'timing': the first
  batch's seconds (with any compile) and the rest's}."""
  fn = loss_fn(cfg, record, runtime=runtime)
  total, count, recs, marks = 0.0, 0.0, [], [time.perf_counter()]
  for b in batches:
    nll, c, r = fn(params, routing_mask or {}, {k: jnp.asarray(v) for k, v in b.items()})
    total, count = total + float(nll), count + float(c)
    if record:
      recs.append({seg: {n: to_NCL(seg, v) for n, v in s.items()} for seg, s in r.items()})
    marks.append(time.perf_counter())
  rest = batches[1:]
  out = {'loss': total / max(count, 1.0),
         'timing': {'first_batch_s': marks[1] - marks[0] if rest or batches else 0.0,
                    'rest_s': marks[-1] - marks[1] if rest else 0.0,
                    'rest_tokens': sum(int(b['inputs'].size) for b in rest)}}
  if record:
    out['routing'] = {seg: {n: np.concatenate([r[seg][n] for r in recs])[:tokens]
                            for n in recs[0][seg]} for seg in (recs[0] if recs else {})}
  return out
