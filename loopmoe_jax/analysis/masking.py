"""Traffic-matched expert masking (Foil's masking test): remove a set of experts from one MoE
layer and measure the LM-loss change on the probe set, against random expert sets of the same
layer that carry the same token traffic.

Removal adds a logit bias of -1e9 (float32; finite, so softmax and z-loss stay free of NaN) to
the removed experts' router logits on every visit: they are never chosen and take no softmax
mass. The bias reaches MoE.__call__ as the read-only variable collection 'routing_mask'
(core/body/layer_i/moe/logit_bias, prelude/layer_i/moe/logit_bias, ...), which the core's scan
broadcasts across passes (core.BROADCAST). A model applied without it runs unchanged.

Traffic of a set = its pooled load share in that layer, sum_{i in set} q_{d,i} (docs/formulas.md).
Random sets are subsets of the other experts of the layer (every subset when there are at most
2^12 of them, else 4096 random ones) leaving at least k experts; the `4·draws` closest in traffic
form the pool from which `draws` sets are drawn at random.
"""
from __future__ import annotations

import itertools

import numpy as np

from loopmoe_jax.analysis import probe_set
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.runtime import HERE, Runtime

REMOVED = -1e9
MAX_CANDIDATES = 4096


def mask_tree(cfg: ModelConfig, removed: dict | None = None) -> dict:
  """The 'routing_mask' collection: a [E] logit bias for every MoE layer, 0 except -1e9 at the
  experts in removed[(segment, layer)]."""
  removed = removed or {}
  tree = {}
  for seg, (layers, e) in probe_set.segment_experts(cfg).items():
    for i in range(layers):
      bias = np.zeros((e,), np.float32)
      ids = list(removed.get((seg, i), ()))
      if ids:
        if min(ids) < 0 or max(ids) >= e:
          raise ValueError(f'{seg} layer {i}: expert ids {ids} outside [0, {e})')
        if e - len(set(ids)) < cfg.top_k:
          raise ValueError(f'{seg} layer {i}: removing {len(set(ids))} of {e} experts leaves '
                           f'fewer than top_k={cfg.top_k}')
        bias[ids] = REMOVED
      node = tree.setdefault(seg, {})
      if seg == 'core':
        node = node.setdefault('body', {})
      node[f'layer_{i}'] = {'moe': {'logit_bias': bias}}
  for key in removed:
    if key[0] not in tree or f'layer_{key[1]}' not in _layers(tree[key[0]]):
      raise ValueError(f'{key[0]} layer {key[1]}: no MoE layer there')
  return tree


def _layers(node):
  return node.get('body', node)


def masked_loss(cfg: ModelConfig, params, batches, removed: dict | None,
                *, runtime: Runtime) -> float:
  """Mean LM loss on the probe set with the experts in `removed` taken out (the model built
  for `runtime`)."""
  return probe_set.run(cfg, params, batches, mask_tree(cfg, removed), record=False,
                       runtime=runtime)['loss']


def candidate_sets(num_experts: int, target: tuple, top_k: int, rng) -> list[tuple]:
  """Subsets of the experts outside `target`, of 1 .. E - k experts."""
  others = [i for i in range(num_experts) if i not in target]
  most = min(len(others), num_experts - top_k)
  if 2 ** len(others) <= MAX_CANDIDATES:
    return [c for r in range(1, most + 1) for c in itertools.combinations(others, r)]
  out = set()
  for _ in range(MAX_CANDIDATES):
    r = int(rng.integers(1, most + 1))
    out.add(tuple(sorted(int(x) for x in rng.choice(others, r, replace=False))))
  return sorted(out)


def traffic_matched(cfg: ModelConfig, params, batches, segment: str, layer: int, experts,
                    share_E, draws: int = 4, seed: int = 0, base_loss: float | None = None,
                    *, runtime: Runtime) -> dict:
  """Loss change from removing `experts` of (segment, layer), and from `draws` random sets of
  the same layer matched in traffic (share_E: that layer's pooled load shares q_{d,i})."""
  share_E = np.asarray(share_E, np.float64)
  target = tuple(sorted(int(i) for i in experts))
  if base_loss is None:
    base_loss = masked_loss(cfg, params, batches, None, runtime=runtime)
  traffic = float(share_E[list(target)].sum())
  delta = masked_loss(cfg, params, batches, {(segment, layer): target}, runtime=runtime) - base_loss
  rng = np.random.default_rng(seed)
  cands = candidate_sets(len(share_E), target, cfg.top_k, rng)
  rng.shuffle(cands)
  cands.sort(key=lambda c: abs(share_E[list(c)].sum() - traffic))  # stable: ties stay shuffled
  pool = cands[:4 * draws]
  picked = [pool[i] for i in sorted(rng.choice(len(pool), min(draws, len(pool)), replace=False))]
  rand = []
  for c in picked:
    d = masked_loss(cfg, params, batches, {(segment, layer): c}, runtime=runtime) - base_loss
    rand.append({'experts': list(c), 'traffic': float(share_E[list(c)].sum()), 'delta_loss': d})
  deltas = np.array([r['delta_loss'] for r in rand])
  gaps = np.array([abs(r['traffic'] - traffic) for r in rand])
  return {
      'segment': segment, 'layer': layer, 'experts': list(target), 'traffic': traffic,
      'base_loss': base_loss, 'delta_loss': delta, 'random': rand,
      'random_delta_mean': float(deltas.mean()) if rand else None,
      'random_delta_std': float(deltas.std(ddof=1)) if len(rand) > 1 else None,
      'random_traffic_mean': float(np.mean([r['traffic'] for r in rand])) if rand else None,
      'random_traffic_max_gap': float(gaps.max()) if rand else None,
  }
