"""SMELT's three-budget matching: a looped twin with the baseline's FLOPs, params and KV.

    m = match(baseline_cfg, span=0.5, loops=2, context=4096)
    m.ratios   # {'flops_ratio': ..., 'params_ratio': ..., 'kv_ratio': ...}
    m.config   # a ModelConfig (validated), counted by loopmoe_jax.accounting

The twin loops the contiguous middle `span` of the baseline's layers `loops` times
(`config.middle_span`), and pays for the extra executed layers by narrowing the width
(d_model, a multiple of `d_step`), moving the expert count (the same E in every layer of the
twin, as in SMELT; the baseline's E is its core_experts), top-k, head dim and KV heads (GQA groups must divide), and
optionally the expert width. Every candidate is scored by `accounting.count` at the
baseline's context; the one with the smallest max |ratio - 1| over the three budgets wins.

Defaults: d_model from 0.75x to 1x the baseline's in steps of 32 (16 below 512), top-k from
the baseline's k to k+2, num_heads H/2, H or 2H, expert width scaled with d_model (steps of 16; 4 below 256) unless
`search_expert_width` searches 0.5x..1.25x of it.

Search: head configs (num_heads, num_kv_heads, head_dim) are chosen first by the KV budget
(which depends on nothing else); for each (d_model, top_k, expert_width) the FLOPs ratio is
checked at the baseline's E, and E is then solved from the params budget (params are linear
in E), trying the two nearest integers.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

from loopmoe_jax.accounting import count
from loopmoe_jax.config import ModelConfig, middle_span

BUDGETS = (('flops_ratio', 'flops_per_token'), ('params_ratio', 'params_total'),
           ('kv_ratio', 'kv_per_token'))
FIXABLE = ('d_model', 'core_experts', 'top_k', 'expert_width', 'num_heads', 'num_kv_heads',
           'head_dim')


@dataclasses.dataclass
class Match:
  config: ModelConfig
  ratios: dict[str, float]
  baseline: dict
  counts: dict

  @property
  def max_deviation(self) -> float:
    return max(abs(v - 1.0) for v in self.ratios.values())

  def to_json(self) -> dict:
    return {**self.ratios, 'max_deviation': self.max_deviation,
            'context': self.counts['context'], 'model': dataclasses.asdict(self.config),
            'baseline': {k: self.baseline[k] for _, k in BUDGETS},
            'matched': {k: self.counts[k] for _, k in BUDGETS}}


def ratios(cfg: ModelConfig, base: dict, context: int) -> tuple[dict, dict]:
  c = count(cfg, context)
  return {name: c[key] / base[key] for name, key in BUDGETS}, c


def _with_experts(cfg: ModelConfig, experts: int) -> ModelConfig:
  return cfg.replace(**{f'{seg}_experts': experts for seg in ('prelude', 'core', 'coda')
                        if getattr(cfg, f'{seg}_experts')})


def head_configs(baseline: ModelConfig, executed_layers: int, kv_target: float, tol: float,
                 num_heads: Sequence[int] | None = None, limit: int = 12, head_step: int = 2,
                 fixed=None):
  """(num_heads, num_kv_heads, head_dim) whose KV per token is within tol, nearest first;
  head_dim a multiple of `head_step`; `fixed` fields (num_heads, num_kv_heads, head_dim)
  held."""
  fixed = fixed or {}
  hd0 = baseline.resolved_head_dim
  out = []
  h0 = baseline.num_heads
  for h in ([fixed['num_heads']] if 'num_heads' in fixed else
            num_heads or sorted({max(1, h0 // 2), h0, 2 * h0})):
    kvs = [fixed['num_kv_heads']] if 'num_kv_heads' in fixed else range(1, h + 1)
    for kv in (g for g in kvs if h % g == 0):
      first = max(head_step, max(8, hd0 // 4) // head_step * head_step)
      hds = [fixed['head_dim']] if 'head_dim' in fixed else range(first, 2 * hd0 + 1, head_step)
      for hd in hds:
        dev = abs(executed_layers * 2 * kv * hd / kv_target - 1.0)
        if dev <= tol:
          out.append((dev, h, kv, hd))
  out.sort()
  return [o[1:] for o in out[:limit]]


def match(baseline: ModelConfig, span: float = 0.5, loops: int = 2, context: int = 2048,
          tol: float = 0.04, d_step: int | None = None, d_range=(0.75, 1.0),
          top_ks: Sequence[int] | None = None, num_heads: Sequence[int] | None = None,
          search_expert_width: bool = False, width_step: int | None = None,
          residual_scale: str = 'inverse_loops', fixed=None, head_step: int = 2) -> Match:
  """The best looped twin of an unlooped `baseline`; raises if none is within `tol`.

  `fixed` holds twin fields at given values (any of d_model, core_experts, top_k,
  expert_width, num_heads, num_kv_heads, head_dim; e.g. SMELT's published width 1056 and
  expert pool 288) and searches the rest; `d_step`, `width_step` and `head_step` make the
  width, expert width and head dim multiples of a hardware-friendly number."""
  fixed = dict(fixed or {})
  unknown = sorted(set(fixed) - set(FIXABLE))
  if unknown:
    raise ValueError(f'cannot hold {unknown} fixed; fixable fields: {list(FIXABLE)}')
  if baseline.num_loops != 1:
    raise ValueError(f'baseline has model.num_loops={baseline.num_loops}: expected an '
                     'unlooped baseline (model.num_loops=1)')
  if not baseline.core_experts:
    raise ValueError('baseline core is dense: matching pays with experts (core_experts >= 1)')
  base = count(baseline, context)
  layout = middle_span(baseline.executed_layers, span, loops)
  e0 = baseline.core_experts
  twin = baseline.replace(**{f'{s}_experts': e0 for s in ('prelude', 'core', 'coda')},
                          **layout, residual_scale=residual_scale)
  layers = twin.executed_layers
  d0, f0, k0 = baseline.d_model, baseline.expert_width, baseline.top_k
  d_step = d_step or (32 if d0 >= 512 else 16)
  width_step = width_step or (16 if f0 >= 256 else 4)
  d_values = range(max(d_step, math.ceil(d_range[0] * d0 / d_step) * d_step),
                   int(d_range[1] * d0) + 1, d_step)
  if 'd_model' in fixed:
    d_values = [fixed['d_model']]
  if 'top_k' in fixed:
    top_ks = [fixed['top_k']]
  heads = head_configs(baseline, layers, base['kv_per_token'], tol, num_heads,
                       head_step=head_step, fixed=fixed)
  if not heads:
    raise ValueError(f'no head dim / KV heads holds the KV cache within {tol:.0%} over '
                     f'{layers} executed layers')
  best = None
  for (h, kv, hd), d, k in itertools.product(heads, d_values, top_ks or range(k0, k0 + 3)):
    if search_expert_width:
      widths = range(max(width_step, int(0.5 * f0) // width_step * width_step),
                     int(1.25 * f0) + 1, width_step)
    else:
      widths = (max(width_step, round(f0 * d / d0 / width_step) * width_step),)
    if 'expert_width' in fixed:
      widths = (fixed['expert_width'],)
    for f in widths:
      try:
        cfg = twin.replace(d_model=d, num_heads=h, num_kv_heads=kv, head_dim=hd,
                           expert_width=f, top_k=k)
      except ValueError:
        continue
      r0, c0 = ratios(cfg, base, context)
      if abs(r0['flops_ratio'] - 1.0) > 1.5 * tol:
        continue
      slope = count(_with_experts(cfg, e0 + 1), context)['params_total'] - c0['params_total']
      e_star = e0 + (base['params_total'] - c0['params_total']) / slope
      experts = ({fixed['core_experts']} if 'core_experts' in fixed else
                 {math.floor(e_star), math.ceil(e_star)})
      for e in experts:
        if e < k:
          continue
        cand = _with_experts(cfg, e)
        r, c = ratios(cand, base, context)
        dev = (max(abs(v - 1.0) for v in r.values()), sum(abs(v - 1.0) for v in r.values()))
        if best is None or dev < best[0]:
          best = (dev, cand, r, c)
  if best is None or best[0][0] > tol:
    found = ''
    if best:
      off = ', '.join(f'{name.removesuffix("_ratio")} {v:.3f}' for name, v in best[2].items()
                      if abs(v - 1.0) > tol)
      found = f'; the closest is {best[0][0]:.1%} off ({off} of the baseline)'
    raise ValueError(f'no looped twin within {tol:.0%} of all three budgets{found}')
  _, cfg, r, c = best
  return Match(cfg, r, base, c)
