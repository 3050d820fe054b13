"""Paired comparison of two runs trained on the same data order (SMELT-style matched pairs).

Both runs see the same batch at every step (the order depends only on the `data` section,
data/pipeline.py), so the step-wise difference d_t = loss_A(t) - loss_B(t) removes the
batch-to-batch noise both share. Over the final window of shared logged steps (default: the
last 20%), with n steps:

  mean difference  m = mean_t d_t
  standard error   SE = sd(d) / sqrt(n)                    (sd with ddof=1; i.i.d. textbook)
  lag-1 autocorr.  rho = sum_t (d_t - m)(d_{t+1} - m) / sum_t (d_t - m)^2
  effective n      n_eff = n (1 - rho) / (1 + rho)         (AR(1) approximation, within [1, n])
  SE with n_eff    SE_eff = sd(d) / sqrt(n_eff)

Consecutive training losses are correlated (the same weights a step apart), so SE
understates the uncertainty when rho > 0; report SE_eff beside it. A negative rho would give
n_eff > n (an SE_eff below the i.i.d. SE, more information than n independent steps hold):
n_eff is capped at n, so SE_eff is never below SE. The runs must share the
data order: their `data` sections (seed, source, paths, seq_len, batch size, task,
tokenizer, val split; not the loader's threads or prefetch) must agree, else a ValueError
names both directories and the differing fields. Architecture and train settings may
differ (train.seed only draws the initial weights).
"""
from __future__ import annotations

import math
import os

import numpy as np

from loopmoe_jax.plotting import pyplot
from loopmoe_jax.train.run import RunDir

# Loader performance settings: they do not change which tokens a step reads.
NOT_DATA_ORDER = ('num_threads', 'prefetch')


def load_losses(workdir: str, key: str = 'loss') -> dict[int, float]:
  """{step: value} from workdir/metrics.jsonl (train/run.RunDir.series; a torn last line
  skipped with a note)."""
  return RunDir(workdir).series(key)


def run_config(workdir: str) -> dict:
  """The resolved config of the newest checkpoint step that reads back (RunDir.stored_config);
  without one the data order cannot be checked."""
  try:
    return RunDir(workdir).stored_config()
  except FileNotFoundError as e:
    raise FileNotFoundError(f'{e} (its data order cannot be checked)') from None


def data_order(config: dict) -> dict:
  return {k: v for k, v in config['data'].items() if k not in NOT_DATA_ORDER}


def check_same_data_order(dir_a: str, dir_b: str, config_a: dict, config_b: dict) -> None:
  """ValueError naming both runs and every differing data field, if their orders differ."""
  a, b = data_order(config_a), data_order(config_b)
  diff = [f'data.{k}: {a.get(k)!r} vs {b.get(k)!r}' for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k)]
  if diff:
    raise ValueError(f'runs {dir_a!r} and {dir_b!r} were trained on different data orders '
                     f'({"; ".join(diff)}): a paired comparison needs the same batches')


def paired_difference(loss_a, loss_b) -> dict:
  """Mean of d = a - b with its i.i.d. SE, lag-1 autocorrelation, n_eff and SE_eff."""
  d = np.asarray(loss_a, np.float64) - np.asarray(loss_b, np.float64)
  n = d.size
  if n < 2:
    raise ValueError(f'{n} paired steps: need at least 2 for a standard error')
  m = float(d.mean())
  sd = float(d.std(ddof=1))
  c = d - m
  denom = float(c @ c)
  rho = float(c[:-1] @ c[1:]) / denom if denom > 0 else 0.0
  n_eff = min(float(n), max(1.0, n * (1 - rho) / (1 + rho))) if rho > -1 else float(n)
  return {'n': n, 'mean_diff': m, 'sd': sd, 'se': sd / math.sqrt(n), 'lag1_autocorr': rho,
          'n_eff': n_eff, 'se_eff': sd / math.sqrt(n_eff)}


def _gaps(steps) -> list[int]:
  """Steps missing between the first and last of `steps` (sorted)."""
  have = set(steps)
  return [s for s in range(steps[0], steps[-1] + 1) if s not in have] if steps else []


def compare_runs(dir_a: str, dir_b: str, window: float | None = None, key: str = 'loss',
                 allow_gaps: bool = False) -> dict:
  """Paired comparison of runs A and B (difference A - B). JSON-ready; 'curves' holds both
  loss series on their shared logged steps.

  By default (`window` None, the LM loss) the window is Foil's: every step of the runs' final
  windows (train.final_window, recorded per step in final_steps.jsonl whatever
  train.log_every is), the steps both hold. With a `window` fraction, or for runs without that
  record, it is the last `window` (default 0.2) of their shared logged steps (metrics.jsonl).
  A window with skipped steps (coarse logging) is refused unless `allow_gaps`."""
  if window is not None and not 0 < window <= 1:
    raise ValueError(f'window={window}: must be in (0, 1]')
  config_a, config_b = run_config(dir_a), run_config(dir_b)
  check_same_data_order(dir_a, dir_b, config_a, config_b)
  la, lb = load_losses(dir_a, key), load_losses(dir_b, key)
  shared = sorted(set(la) & set(lb))
  if not shared:
    raise ValueError(f'runs {dir_a!r} (steps {_span(la)}) and {dir_b!r} (steps {_span(lb)}) '
                     f'share no logged step of {key!r}')
  fa, fb = (RunDir(dir_a).final_steps(), RunDir(dir_b).final_steps()) \
      if window is None and key == 'loss' else ({}, {})
  per_step = sorted(set(fa) & set(fb))
  if per_step:
    source, win, ra, rb = 'final_steps.jsonl (every step of the final window)', per_step, fa, fb
  else:
    window = window or 0.2
    n = max(2, math.ceil(window * len(shared)))
    source, win, ra, rb = 'metrics.jsonl (logged steps)', shared[-n:], la, lb
  missing = _gaps(win)
  if missing and not allow_gaps:
    raise ValueError(
        f'the paired window (steps {win[0]}..{win[-1]}, from {source}) skips {len(missing)} '
        f'steps (e.g. {missing[:3]}): the runs logged every train.log_every steps and hold no '
        'per-step record of that window (final_steps.jsonl, written by the trainer for the '
        'last train.final_window steps). Compare runs that have it, or pass allow_gaps '
        '(--allow_gaps) to compare the logged steps')
  a = np.array([ra[s] for s in win])
  b = np.array([rb[s] for s in win])
  out = {'run_a': os.path.abspath(dir_a), 'run_b': os.path.abspath(dir_b), 'metric': key,
         'difference': 'A - B', 'shared_steps': len(shared), 'window_fraction': window,
         'window_source': source, 'skipped_steps': len(missing),
         'window_steps': [win[0], win[-1]], 'final_window_loss_a': float(a.mean()),
         'final_window_loss_b': float(b.mean()), **paired_difference(a, b)}
  va, vb = load_losses(dir_a, 'val_loss'), load_losses(dir_b, 'val_loss')
  out['val_loss'] = {str(s): [va[s], vb[s]] for s in sorted(set(va) & set(vb))}
  out['curves'] = {'steps': shared, 'a': [la[s] for s in shared], 'b': [lb[s] for s in shared]}
  return out


def _span(losses: dict) -> str:
  return f'{min(losses)}..{max(losses)}' if losses else 'none'


def plot_comparison(result: dict, path: str, labels=('A', 'B')) -> str:
  """Both loss curves on shared steps (window shaded) and their difference (PNG)."""
  plt = pyplot()
  cv = result['curves']
  steps, a, b = np.array(cv['steps']), np.array(cv['a']), np.array(cv['b'])
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  ax1.plot(steps, a, label=f'{labels[0]}: {os.path.basename(result["run_a"])}', lw=1)
  ax1.plot(steps, b, label=f'{labels[1]}: {os.path.basename(result["run_b"])}', lw=1)
  lo, hi = result['window_steps']
  for ax in (ax1, ax2):
    ax.axvspan(lo, hi, color='gray', alpha=0.15, label='final window')
    ax.set_xlabel('step')
  ax1.set_ylabel(f'train {result["metric"]} (nats/token)')
  ax1.set_ylim(min(a.min(), b.min()) - 0.05, np.percentile(np.r_[a, b], 97) + 0.1)
  ax1.set_title('loss curves (same data order)')
  ax1.legend(fontsize=8)
  ax2.plot(steps, a - b, lw=0.8, c='k')
  ax2.axhline(0, c='gray', lw=0.5)
  ax2.set_ylabel('loss A - loss B (nats/token)')
  ax2.set_title(f"window mean {result['mean_diff']:+.4f} "
                f"(SE {result['se']:.4f}, SE_eff {result['se_eff']:.4f})")
  ax2.set_ylim(*np.percentile(a - b, [1, 99]) + np.array([-0.05, 0.05]))
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
