"""Parameter, FLOP and KV-cache accounting straight from a ModelConfig (no init).

Conventions:
- `params_total`: every stored parameter (equals the real Flax param count; tested).
- `params_active`: parameters used per token, counting every executed use: each executed
  layer's attention, router, k routed experts, shared experts / dense MLP, the injection map
  on every pass, and the output head (also when tied); the input embedding lookup is free.
  Forward matmul FLOPs per token are exactly 2 * params_active.
- `flops_per_token`: forward FLOPs per token at `context` tokens: 2 * params_active plus
  4 * context * H * K per executed layer (QK^T and AV over the full context, the Chinchilla
  convention without a causal discount). Training is about 3x this.
- `kv_per_token`: cached entries per token: cached layers * 2 * kv_heads * head_dim, with
  `cached_layers` one slot per executed (pass, layer) under model.kv_cache='per_pass' and one
  per layer, the core's shared by its passes, under 'last_pass' / 'first_pass' (decode.py;
  Huginn, Geiping et al. 2025; Mixture-of-Recursions, Bae et al. 2025). Equals the real
  decode cache (decode.cache_shapes; tested).
- model.exit='gate' adds the gate's d + 1 parameters ('exit_gate') and, in training only,
  `gate_train_flops_per_token`: the forward FLOPs of the readout of every pass but the last
  (early_exit.pass_outputs: the coda's layers with their attention, and the head) and the gate's
  dot at every pass (objective.gate_lm_loss).
- SMELT sparsity S = 1 - active / total over non-embedding parameters.
- Foil counts over the core: E_real = E*D, E_comp = D*L*k, E_eq = E*D*L.
"""
from __future__ import annotations

import math
from typing import Any

import jax

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.runtime import HERE


def _attn(c: ModelConfig) -> int:
  return c.d_model * c.resolved_head_dim * (2 * c.num_heads + 2 * c.kv_heads)


def _ffn(c: ModelConfig, experts: int) -> dict[str, int]:
  """Stored and per-use parameters of one feed-forward layer, by kind."""
  dense = 3 * c.d_model * c.expert_width
  if not experts:
    return dict(experts=0, dense_mlp=dense, routers=0, active=dense)
  shared = 3 * c.d_model * c.num_shared_experts * c.shared_width
  return dict(experts=experts * dense, dense_mlp=shared, routers=c.d_model * experts,
              active=c.top_k * dense + shared + c.d_model * experts)


def count(c: ModelConfig, context: int = 2048) -> dict[str, Any]:
  """The accounting of `c` at a context length of `context` tokens."""
  d, attn = c.d_model, _attn(c)
  norm = d if c.norm_gain else 0
  inject = 2 * d * d if c.injection == 'concat' else 0
  br = dict(embeddings=c.vocab_size * d * (1 if c.tie_embeddings else 2), attention=0,
            experts=0, dense_mlp=0, routers=0, norms=norm, injection=0)
  active = c.vocab_size * d  # the output head
  for seg, layers, experts, passes in c.segments:
    ffn = _ffn(c, experts)
    attn_sets = layers * (passes if seg == 'core' and not c.tie_attention else 1)
    br['attention'] += attn_sets * attn
    for kind in ('experts', 'dense_mlp', 'routers'):
      br[kind] += layers * ffn[kind]
    br['norms'] += layers * 2 * norm
    if seg == 'core':
      br['injection'] += inject
    active += passes * (layers * (attn + ffn['active']) + (inject if seg == 'core' else 0))
  if c.exit == 'gate' and c.core_layers:
    br['exit_gate'] = d + 1
  total = sum(br.values())
  embed_stored = br['embeddings']
  nonembed_total = total - embed_stored
  nonembed_active = active - c.vocab_size * d
  attn_flops = 4 * context * c.num_heads * c.resolved_head_dim * c.executed_layers
  gate_flops = 0
  if c.exit == 'gate' and c.core_layers:
    coda = c.coda_layers * (attn + _ffn(c, c.coda_experts)['active'])
    coda_attn = 4 * context * c.num_heads * c.resolved_head_dim * c.coda_layers
    gate_flops = (c.num_loops - 1) * (2 * (coda + c.vocab_size * d) + coda_attn) + \
        c.num_loops * 2 * d
  e, dl = c.core_experts, c.core_layers
  return {
      'params_total': total,
      'params_active': active,
      'params_nonembedding': nonembed_total,
      'params_active_nonembedding': nonembed_active,
      'breakdown': br,
      'flops_per_token': 2 * active + attn_flops,
      'gate_train_flops_per_token': gate_flops,
      'context': context,
      'kv_per_token': cached_layers(c) * 2 * c.kv_heads * c.resolved_head_dim,
      'cached_layers': cached_layers(c),
      'executed_layers': c.executed_layers,
      'E_real': e * dl,
      'E_comp': dl * c.num_loops * c.top_k if e else 0,
      'E_eq': e * dl * c.num_loops,
      'sparsity': 1.0 - nonembed_active / nonembed_total if nonembed_total else 0.0,
  }


def cached_layers(c: ModelConfig) -> int:
  """K/V slots per token of the decode cache: one per executed (pass, layer) with
  model.kv_cache='per_pass', else one per layer (the core's shared by its passes)."""
  core_slots = c.num_loops if c.kv_cache == 'per_pass' else 1
  return c.prelude_layers + c.core_layers * core_slots + c.coda_layers


def param_count(params) -> int:
  """Real number of parameters in a (possibly boxed or abstract) param tree."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def init_param_count(c: ModelConfig, runtime=None) -> int:
  """Counts the real model's parameters via jax.eval_shape of init (no memory used), under
  `runtime` (runtime.Runtime; default this machine's) whose run settings change no parameter."""
  import jax.numpy as jnp
  tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
  model = for_init(LoopedMoE(c, runtime=runtime or HERE))
  shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)
  return param_count(shapes['params'])
