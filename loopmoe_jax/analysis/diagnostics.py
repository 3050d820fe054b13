"""Routing diagnostics of shared-across-pass experts (Foil, Section 2.3 / Appendix; formula
sheet in docs/formulas.md, 'Routing diagnostics'), computed with numpy from routing records.

`sel_NCLk` holds the experts chosen for token n in core layer d on pass l (k choices; C core
layers, which the formulas call D as the paper does); S_{t,d}^(l)
is its row. Definitions (docs/formulas.md):
- distinct experts U_t = sum_d |union_l S_{t,d}^(l)|, k·D <= U_t <= D·min(E, kL); reported as
  mean U and U / (D·min(E, kL));
- load share q_{d,i} = (N·L·k)^-1 sum_{t,l} 1{i in S_{t,d}^(l)} (pooled over passes), per pass
  q_{d,l,i} = (N·k)^-1 sum_t 1{i in S_{t,d}^(l)}; N2 = 1 / sum_i q_i^2 (inverse Simpson),
  B2 = N2 / E (Jain's index), k/E <= B2 <= 1;
- MaxVio = (max_i load_i - mean load) / mean load, over the whole probe set and per batch;
- MMR: z_(1) >= ... >= z_(E), m = E/2 for even E (ceil(E/2) otherwise);
  MMR = exp(mean over decisions of (z_(1) - z_(m))), a geometric mean of p_(1)/p_(m).
"""
from __future__ import annotations

import math

import numpy as np

from loopmoe_jax.moe import max_vio


def _check_sel(sel, num_experts: int) -> np.ndarray:
  sel = np.asarray(sel)
  if sel.ndim != 4:
    raise ValueError(f'sel must be [N, C, L, k] (tokens, layers, passes, choices); got shape '
                     f'{sel.shape}')
  if sel.size and (sel.min() < 0 or sel.max() >= num_experts):
    raise ValueError(f'sel holds expert ids outside [0, {num_experts})')
  return sel


def counts(sel_NCLk, num_experts: int) -> np.ndarray:
  """[C, L, E] number of choices of each expert per layer and pass."""
  sel = _check_sel(sel_NCLk, num_experts)
  n, d, l, k = sel.shape
  onehot = np.zeros((d, l, num_experts), np.int64)
  flat = sel.transpose(1, 2, 0, 3).reshape(d, l, n * k)
  for i in range(d):
    for j in range(l):
      onehot[i, j] = np.bincount(flat[i, j], minlength=num_experts)
  return onehot


def distinct_experts(sel, num_experts: int) -> dict:
  """U_t = sum_d |union_l S_{t,d}^(l)|: 'per_token' [N], 'mean', 'normalized' (mean U /
  (D·min(E, kL))), 'per_layer' [C] mean distinct experts per layer, and the bounds."""
  sel = _check_sel(sel, num_experts)
  n, d, l, k = sel.shape
  hit = np.zeros((n, d, num_experts), bool)
  idx_n = np.arange(n)[:, None, None, None]
  idx_d = np.arange(d)[None, :, None, None]
  hit[np.broadcast_to(idx_n, sel.shape), np.broadcast_to(idx_d, sel.shape), sel] = True
  per_layer_ND = hit.sum(-1)
  u_N = per_layer_ND.sum(-1)
  cap = d * min(num_experts, k * l)
  mean = float(u_N.mean()) if n else float('nan')
  return {'per_token': u_N, 'mean': mean, 'normalized': mean / cap,
          'per_layer': per_layer_ND.mean(0), 'lower_bound': k * d, 'upper_bound': cap}


def _n2(q):
  return 1.0 / np.sum(q * q, axis=-1)


def balance(sel, num_experts: int) -> dict:
  """Load shares, N2 and B2 per layer, pooled over passes and per pass: 'share_pooled' [C, E],
  'share_per_pass' [C, L, E], 'N2' [C] and 'N2_per_pass' [C, L], 'B2_pooled' [C],
  'B2_per_pass' [C, L]."""
  c_CLE = counts(sel, num_experts).astype(np.float64)
  pooled_CE = c_CLE.sum(1)
  q_CE = pooled_CE / pooled_CE.sum(-1, keepdims=True)
  q_CLE = c_CLE / c_CLE.sum(-1, keepdims=True)
  n2, n2_pass = _n2(q_CE), _n2(q_CLE)
  return {'share_pooled': q_CE, 'share_per_pass': q_CLE, 'N2': n2, 'N2_per_pass': n2_pass,
          'B2_pooled': n2 / num_experts, 'B2_per_pass': n2_pass / num_experts}


def maxvio(sel, num_experts: int, batch_size: int | None = None) -> dict:
  """MaxVio of the expert loads (counts of choices): 'global' [C] over the probe set pooled over
  passes, 'global_per_pass' [C, L]; with `batch_size` (tokens per batch) also 'per_batch'
  [num_batches, C] (pooled over passes) and its mean 'per_batch_mean' [C]."""
  sel = _check_sel(sel, num_experts)
  c_CLE = counts(sel, num_experts).astype(np.float64)
  out = {'global': max_vio(c_CLE.sum(1)), 'global_per_pass': max_vio(c_CLE)}
  if batch_size:
    n = sel.shape[0]
    if batch_size < 1 or n % batch_size:
      raise ValueError(f'batch_size={batch_size} does not divide the {n} tokens')
    per = np.stack([max_vio(counts(sel[i:i + batch_size], num_experts).sum(1).astype(np.float64))
                    for i in range(0, n, batch_size)])
    out['per_batch'] = per
    out['per_batch_mean'] = per.mean(0)
  return out


def median_rank(num_experts: int) -> int:
  """m = E/2 for even E, ceil(E/2) otherwise (1-based descending rank)."""
  return math.ceil(num_experts / 2)


def mmr(logits) -> dict:
  """Per decision (row of logits [..., E]): 'gap' z_(1) - z_(m) and 'mmr' exp(gap) = p_(1)/p_(m);
  'mean' exp(mean gap) over all rows (the aggregate MMR)."""
  z = np.asarray(logits, np.float64)
  e = z.shape[-1]
  z_sorted = -np.sort(-z, axis=-1)
  gap = z_sorted[..., 0] - z_sorted[..., median_rank(e) - 1]
  return {'gap': gap, 'mmr': np.exp(gap), 'mean': float(np.exp(gap.mean())) if gap.size
          else float('nan')}


def mmr_aggregates(logits_NCLE) -> dict:
  """MMR from logits [N, C, L, E] per layer and pass [C, L], per layer [C], per pass [L] and
  overall (every N·C·L decision weighted equally)."""
  gap = mmr(logits_NCLE)['gap']
  return {'per_layer_pass': np.exp(gap.mean(0)), 'per_layer': np.exp(gap.mean((0, 2))),
          'per_pass': np.exp(gap.mean((0, 1))), 'overall': float(np.exp(gap.mean()))}
