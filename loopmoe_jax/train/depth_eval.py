"""Adaptive depth at evaluation (scripts/evaluate.py --exit / --kv_cache): the validation loss
and average passes of per-token early exit per threshold (early_exit.py), and the loss of the
validation text decoded token by token under each KV-cache layout (decode.py)."""
from __future__ import annotations

import jax
import numpy as np

from loopmoe_jax import early_exit
from loopmoe_jax.decode import decode_nll
from loopmoe_jax.model import LoopedMoE, check_loops, variables
from loopmoe_jax.objective import token_nll_of_logits
from loopmoe_jax.plotting import pyplot
from loopmoe_jax.train.evaluation import validation_batches
from loopmoe_jax.train.run import as_loaded


def _masked_means(batches, fn) -> list[float]:
  """The means of the [B, T] arrays fn(batch) returns (a tuple) over the unmasked targets of
  `batches` (float64 sums)."""
  totals, count = None, 0.0
  for b in batches:
    mask = np.asarray(b['mask'], np.float64)
    sums = [float(np.sum(np.asarray(v, np.float64) * mask)) for v in fn(b)]
    totals = sums if totals is None else [t + v for t, v in zip(totals, sums)]
    count += float(mask.sum())
  return [t / max(count, 1.0) for t in totals]


def exit_tradeoff(workdir, rule: str, thresholds, num_loops=(None,), step=None) -> dict:
  """{'step', 'exit', 'passes': {passes: [{threshold, loss, mean_passes}]}} on the validation
  batches for each count in `num_loops` (None: the trained one): the full forward with early_exit=True
  (exited tokens frozen), the no-exit model as threshold None. One checkpoint read; one
  compiled forward per (count, threshold): the threshold is part of the model's config."""
  if not thresholds:
    raise ValueError('--exit needs --thresholds=a,b,c (model.exit_threshold values)')
  try:
    values = [float(t) for t in thresholds]
  except ValueError:
    raise ValueError(f'--thresholds={",".join(map(str, thresholds))}: must be numbers') from None
  loaded = as_loaded(workdir, step)
  base = loaded.model_cfg
  configs = [(None, base.replace(exit='none'))] + [
      (t, base.replace(exit=rule, exit_threshold=t)) for t in values]  # bad ones fail here
  for n in num_loops:
    check_loops(base, n)
  early_exit.check_params(configs[-1][1], loaded.params)  # a gate-less checkpoint, before compute
  batches = validation_batches(loaded)
  out = {'step': loaded.step, 'exit': rule, 'passes': {}}
  for n in num_loops:
    rows = []
    for t, cfg in configs:
      fn = jax.jit(lambda p, b, x, cfg=cfg, t=t: LoopedMoE(cfg, runtime=loaded.runtime).apply(
          variables(p, router_bias=b), x, num_loops=n, early_exit=t is not None))
      def loss_and_passes(b, fn=fn):
        logits, extras = fn(loaded.params, loaded.router_bias, b['inputs'])
        passes = (extras['exit']['passes_BT'] if 'exit' in extras else
                  np.full(b['targets'].shape, n or base.num_loops))
        return token_nll_of_logits(logits, b['targets']), passes
      loss, passes = _masked_means(batches, loss_and_passes)
      rows.append({'threshold': t, 'loss': loss, 'mean_passes': passes})
    out['passes'][str(n or base.num_loops)] = rows
  return out


def tradeoff_table(result: dict) -> str:
  """`exit_tradeoff`'s result as a markdown table: loss / average passes per threshold."""
  lines = ['| passes | threshold | loss | average passes |', '|---|---|---|---|']
  for n, rows in result['passes'].items():
    for r in rows:
      t = 'none' if r['threshold'] is None else f"{result['exit']} {r['threshold']:g}"
      lines.append(f"| {n} | {t} | {r['loss']:.4f} | {r['mean_passes']:.3f} |")
  return '\n'.join(lines)


def plot_tradeoff(result: dict, path: str) -> str:
  """Loss against average passes per threshold (one series per pass count), the no-exit
  model as a square (PNG)."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for n, rows in result['passes'].items():
    ex = [r for r in rows if r['threshold'] is not None]
    ax.plot([r['mean_passes'] for r in ex], [r['loss'] for r in ex], 'o-',
            label=f"exit={result['exit']}, {n} passes")
    for r in ex:
      ax.annotate(f"{r['threshold']:g}", (r['mean_passes'], r['loss']), fontsize=8)
    ax.scatter([rows[0]['mean_passes']], [rows[0]['loss']], color='k', marker='s', zorder=3)
  ax.set_xlabel('average passes per token (square: no exit)')
  ax.set_ylabel('validation loss (nats)')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def kv_cache_losses(workdir, layouts, num_loops=(None,), step=None, scale_passes=None) -> dict:
  """{passes: {'full_forward': loss, 'decode': {layout: loss}}}: the mean next-token NLL over
  the validation batches' unmasked targets, the text fed token by token under each layout."""
  loaded = as_loaded(workdir, step)
  cfg, params, bias = loaded.model_cfg, loaded.params, loaded.router_bias
  if scale_passes:
    cfg = cfg.replace(scale_passes=scale_passes)
  configs = {k: cfg.replace(kv_cache=k) for k in layouts}  # a bad layout fails here, naming it
  for n in num_loops:
    check_loops(cfg, n)
  batches = validation_batches(loaded)
  forward = jax.jit(lambda p, b, t, n: LoopedMoE(cfg, runtime=loaded.runtime).apply(
      variables(p, router_bias=b), t, num_loops=n)[0],
                    static_argnums=3)
  out = {'step': loaded.step, 'tokens': int(sum(np.asarray(b['mask']).sum() for b in batches))}
  for n in num_loops:
    row = {'full_forward': _masked_means(batches, lambda b: (token_nll_of_logits(
        forward(params, bias, b['inputs'], n), b['targets']),))[0]}
    row['decode'] = {k: _masked_means(batches, lambda b, c=c: (decode_nll(
        c, params, b['inputs'], b['targets'], n, bias, runtime=loaded.runtime),))[0]
                     for k, c in configs.items()}
    out[str(n or cfg.num_loops)] = row
  return out
