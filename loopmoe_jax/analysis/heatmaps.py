"""PNG heatmaps of the routing diagnostics: expert load share by layer and pass, MMR by layer
and pass (matplotlib, Agg backend)."""
from __future__ import annotations

import numpy as np

from loopmoe_jax.plotting import pyplot


def load_heatmap(path: str, shares: dict, title: str) -> None:
  """shares: {segment: [C, L, E] per-pass load shares}; one panel per (segment, layer), rows
  the passes, columns the experts, colour the share of the pass's choices."""
  panels = [(seg, d, np.asarray(q)[d]) for seg, q in shares.items() for d in range(len(q))]
  vmax = max(float(p.max()) for _, _, p in panels)
  width = max(6, 0.5 * max(p.shape[1] for *_, p in panels) + 3)
  heights = [p.shape[0] + 1.5 for *_, p in panels]
  plt = pyplot()
  fig, axes = plt.subplots(len(panels), 1, figsize=(width, 1.0 + 0.45 * sum(heights)),
                           squeeze=False, gridspec_kw={'height_ratios': heights})
  for ax, (seg, d, q_LE) in zip(axes[:, 0], panels):
    im = ax.imshow(q_LE, aspect='auto', cmap='viridis', vmin=0.0, vmax=vmax)
    ax.set_title(f'{seg} layer {d}' + ('' if seg == 'core' else ' (one pass)'), fontsize=9)
    ax.set_xlabel('expert')
    ax.set_ylabel('pass')
    ax.set_xticks(range(q_LE.shape[1]))
    ax.set_yticks(range(q_LE.shape[0]), [str(l + 1) for l in range(q_LE.shape[0])])
    fig.colorbar(im, ax=ax, label='load share')
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def mmr_heatmap(path: str, mmr_CL, title: str) -> None:
  """MMR [C, L] of the core: rows the layers, columns the passes, values written in the cells."""
  m = np.asarray(mmr_CL, np.float64)
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(2.0 + 1.1 * m.shape[1], max(2.8, 1.5 + 0.8 * m.shape[0])))
  im = ax.imshow(m, aspect='auto', cmap='magma')
  for (d, l), v in np.ndenumerate(m):
    light = im.norm(v) > 0.5
    ax.text(l, d, f'{v:.2f}', ha='center', va='center', color='black' if light else 'white',
            fontsize=9)
  ax.set_xlabel('pass')
  ax.set_ylabel('core layer')
  ax.set_xticks(range(m.shape[1]), [str(l + 1) for l in range(m.shape[1])])
  ax.set_yticks(range(m.shape[0]))
  fig.colorbar(im, ax=ax, label='MMR = exp(mean(z(1) - z(m)))')
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
