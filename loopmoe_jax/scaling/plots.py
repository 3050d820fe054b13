"""PNG plots of fitted laws (matplotlib, Agg backend).

- `plot_fits`: observed and predicted loss against a column, and predicted against observed.
- `plot_isoflop`: the seed's IsoFLOP curves (design.isoflop), loss against the per-pass active
  size N at fixed training compute, one curve per pass count r, each minimum marked.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from loopmoe_jax.plotting import pyplot
from loopmoe_jax.scaling.fitting import Fit, as_columns


def plot_fits(data, fits: Mapping[str, Fit], path: str, x: str = 'N', group: str | None = None,
              title: str = '') -> str:
  """Left: observed loss against column `x` (one series per value of `group`) with each
  law's prediction; right: predicted against observed loss. Writes `path` (PNG)."""
  plt = pyplot()
  cols = as_columns(data)
  xs, loss = cols[x], cols['loss']
  groups = np.unique(cols[group]) if group else [None]
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
  markers = 'osd^v<>'
  for gi, g in enumerate(groups):
    sel = np.ones_like(xs, bool) if g is None else np.isclose(cols[group], g)
    order = np.argsort(xs[sel])
    label = 'observed' if g is None else f'{group}={g:g}'
    ax.scatter(xs[sel][order], loss[sel][order], marker=markers[gi % len(markers)],
               color='k', s=18, label=label, zorder=3)
    for fi, (name, f) in enumerate(fits.items()):
      pred = f.predict({k: v[sel] for k, v in cols.items()})
      ax.plot(xs[sel][order], pred[order], color=f'C{fi}', lw=1.2,
              label=name if gi == 0 else None)
  if xs.min() > 0 and xs.max() / xs.min() > 20:
    ax.set_xscale('log')
  ax.set_xlabel(x)
  ax.set_ylabel('loss')
  ax.legend(fontsize=7)
  ax.set_title(title or 'fitted laws')
  lo, hi = loss.min(), loss.max()
  for fi, (name, f) in enumerate(fits.items()):
    ax2.scatter(loss, f.predict(cols), s=10, color=f'C{fi}',
                label=f'{name} (rmse {f.rmse:.3g})')
  ax2.plot([lo, hi], [lo, hi], 'k--', lw=0.8)
  ax2.set_xlabel('observed loss')
  ax2.set_ylabel('predicted loss')
  ax2.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_isoflop(curves: Sequence[Mapping], path: str, title: str = '') -> str:
  """One line per curve of `design.isoflop` (loss against N, log x axis), a marker at each
  curve's minimum (N_opt, loss_opt). Writes `path` (PNG)."""
  if not curves:
    raise ValueError('no IsoFLOP curves to plot')
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for i, c in enumerate(curves):
    ax.plot(c['N'], c['loss'], color=f'C{i}', lw=1.4, label=f"r={c['r']:g}")
    ax.plot([c['N_opt']], [c['loss_opt']], marker='o', color=f'C{i}', ms=6, zorder=3)
  ax.set_xscale('log')
  ax.set_xlabel('active parameters per pass N')
  ax.set_ylabel('predicted loss')
  computes = sorted({float(c['C']) for c in curves})
  ax.set_title(title or 'IsoFLOP, C = ' + ', '.join(f'{x:.3g}' for x in computes) + ' FLOPs')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
