"""Our looped MoE as a Hugging Face Mixtral (loop unrolled), and a Mixtral back into ours.

Export: every executed (pass, layer) becomes one Mixtral layer, in execution order (prelude,
core pass 0 layers 0..D-1, pass 1, ..., coda); shared core weights are written once per pass,
untied per-pass attention takes its pass's slice. SMELT's 1/r residual scale is folded into
o_proj and the experts' w2 (both writes are linear in them); a gain-free RMSNorm is written
as ones; with tied embeddings the logit scale 1/sqrt(d_model) is folded into the final norm's
weight (it feeds only the head), so lm_head stays tied to embed_tokens. Our RoPE is the
rotate-half form HF uses, and our head order ((H, K) flattened, query head h reading kv head
h // (H / G)) is HF's, so q/k need no permutation. The tensors use the hub's layout
(model.layers.{i}.block_sparse_moe.experts.{j}.w1/w2/w3), which current transformers load.

A model Mixtral cannot express is refused (`unsupported`), naming the feature.
"""
from __future__ import annotations

import math

import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.core import residual_scale

ARCHITECTURE = 'MixtralForCausalLM'
SAFETENSORS_HINT = 'export it with --format safetensors instead'
# A router bias is trained state outside the parameters: neither format holds it yet.
BIAS_REFUSAL = ('the exports hold the parameters only, and this model routes with its trained '
                'bias as well; not exported (evaluate and generate read it from the checkpoint)')


def unsupported(c: ModelConfig) -> list[str]:
  """The features of `c` that a Mixtral checkpoint cannot hold (empty: exportable)."""
  out = []
  experts = {e for _, _, e, _ in c.segments}
  if len(experts) > 1 and 0 in experts:
    out.append('dense layers among MoE layers (' + ', '.join(
        f'{s}_experts={e}' for s, _, e, _ in c.segments) + ')')
  elif len(experts) > 1:
    out.append('different expert counts per layer (' + ', '.join(
        f'{s}_experts={e}' for s, _, e, _ in c.segments) + ')')
  if c.injection != 'none':
    out.append(f'input injection (model.injection={c.injection!r})')
  if not c.renormalize and experts != {0}:
    out.append('non-renormalised routing (model.renormalize=False; Mixtral renormalises the '
               'top-k weights)')
  if c.num_shared_experts:
    out.append(f'shared experts (model.num_shared_experts={c.num_shared_experts})')
  if c.router_score != 'softmax':
    out.append(f'sigmoid router scores (model.router_score={c.router_score!r}; Mixtral routes '
               'on a softmax)')
  if c.router_bias != 'none':
    out.append(f'a router selection bias (model.router_bias={c.router_bias!r})')
  if c.capacity_factor:
    out.append(f'expert capacity (model.capacity_factor={c.capacity_factor}; Mixtral is '
               'dropless)')
  return out


def check_exportable(c: ModelConfig):
  bad = unsupported(c)
  if bad:
    hint = BIAS_REFUSAL if c.router_bias != 'none' else SAFETENSORS_HINT
    raise ValueError('Mixtral cannot express ' + '; '.join(bad) + f': {hint}')


def executed_layers(c: ModelConfig, params):
  """(layer params, attention weights, write scale) per executed layer, in order."""
  out = []
  for seg, layers, _, passes in c.segments:
    scale = residual_scale(c, c.num_loops) if seg == 'core' else 1.0
    for l in range(passes):
      for i in range(layers):
        if seg == 'core':
          p = params['core']['body'][f'layer_{i}']
          attn = p['attn'] if c.tie_attention else {
              k: np.asarray(v)[l] for k, v in params['core'][f'pass_attn_{i}'].items()}
        else:
          p = params[seg][f'layer_{i}']
          attn = p['attn']
        out.append((p, attn, scale))
  return out


def _gain(p, name, d):
  return np.asarray(p[name]['scale']) if name in p else np.ones((d,), np.float32)


def to_hf(c: ModelConfig, params, max_positions: int = 4096):
  """(config.json dict, generation_config.json dict, {hub tensor name: array}); float32."""
  check_exportable(c)
  f32 = lambda x: np.asarray(x, np.float32)
  params = {k: v for k, v in params.items()}
  d, h, g, k = c.d_model, c.num_heads, c.kv_heads, c.resolved_head_dim
  t = {'model.embed_tokens.weight': f32(params['embed'])}
  layers = executed_layers(c, params)
  num_experts = max(e for _, _, e, _ in c.segments) or 1
  for n, (p, attn, scale) in enumerate(layers):
    pre = f'model.layers.{n}.'
    t[pre + 'input_layernorm.weight'] = f32(_gain(p, 'attn_norm', d) if c.norm_gain else np.ones(d))
    t[pre + 'post_attention_layernorm.weight'] = f32(
        _gain(p, 'mlp_norm', d) if c.norm_gain else np.ones(d))
    t[pre + 'self_attn.q_proj.weight'] = f32(attn['q']).reshape(d, h * k).T
    t[pre + 'self_attn.k_proj.weight'] = f32(attn['k']).reshape(d, g * k).T
    t[pre + 'self_attn.v_proj.weight'] = f32(attn['v']).reshape(d, g * k).T
    t[pre + 'self_attn.o_proj.weight'] = (f32(attn['o']).reshape(h * k, d) * scale).T
    moe = pre + 'block_sparse_moe.'
    if 'moe' in p:
      m = p['moe']
      t[moe + 'gate.weight'] = f32(m['router']).T
      gate, up, down = f32(m['gate']), f32(m['up']), f32(m['down'])
    else:  # an all-dense model: one expert, chosen with weight 1
      t[moe + 'gate.weight'] = np.zeros((1, d), np.float32)
      gate, up, down = (f32(p['mlp'][n_])[None] for n_ in ('gate', 'up', 'down'))
    for j in range(gate.shape[0]):
      t[f'{moe}experts.{j}.w1.weight'] = gate[j].T
      t[f'{moe}experts.{j}.w3.weight'] = up[j].T
      t[f'{moe}experts.{j}.w2.weight'] = (down[j] * scale).T
  final = _gain(params, 'final_norm', d) if c.norm_gain else np.ones(d)
  if c.tie_embeddings:
    final = final / math.sqrt(d)
  else:
    t['lm_head.weight'] = f32(params['head']).T
  t['model.norm.weight'] = f32(final)
  t = {n: np.ascontiguousarray(a, np.float32) for n, a in t.items()}
  config = {
      'architectures': [ARCHITECTURE], 'model_type': 'mixtral',
      'vocab_size': c.vocab_size, 'hidden_size': d, 'intermediate_size': c.expert_width,
      'num_hidden_layers': len(layers), 'num_attention_heads': h, 'num_key_value_heads': g,
      'head_dim': k, 'hidden_act': 'silu', 'max_position_embeddings': max_positions,
      'rms_norm_eps': c.norm_eps, 'rope_theta': c.rope_theta,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': c.rope_theta},
      'num_local_experts': num_experts, 'num_experts_per_tok': c.top_k if num_experts > 1 else 1,
      'tie_word_embeddings': c.tie_embeddings, 'sliding_window': None, 'attention_dropout': 0.0,
      'router_aux_loss_coef': 0.0, 'output_router_logits': False, 'use_cache': True,
      'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None,
      'dtype': 'float32', 'torch_dtype': 'float32',
  }
  generation = {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None,
                'do_sample': False}
  return config, generation, t


def check_hf_config(config: dict, where: str):
  """ValueError unless `config` is a Mixtral we can read (names what is not)."""
  arch = config.get('architectures') or []
  if config.get('model_type') != 'mixtral' or ARCHITECTURE not in arch:
    raise ValueError(f'{where}: architecture {arch or config.get("model_type")!r} is not '
                     f'{ARCHITECTURE} (model_type mixtral)')
  if config.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'{where}: hidden_act={config["hidden_act"]!r} (only silu is supported)')
  if config.get('sliding_window'):
    raise ValueError(f'{where}: sliding_window={config["sliding_window"]} (our attention is '
                     'full causal)')
  rope = config.get('rope_parameters') or config.get('rope_scaling') or {}
  if rope.get('rope_type', rope.get('type', 'default')) != 'default':
    raise ValueError(f'{where}: rope scaling {rope!r} (only the default RoPE is supported)')


def hf_rope_theta(config: dict) -> float:
  rope = config.get('rope_parameters') or {}
  return float(rope.get('rope_theta', config.get('rope_theta', 1e6)))


def hub_tensors(t: dict[str, np.ndarray], n_layers: int, n_experts: int) -> dict:
  """The hub layout of `t`; transformers' own fused expert layout
  (mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F], mlp.gate.weight)
  is split into it."""
  t = dict(t)
  for n in range(n_layers):
    pre = f'model.layers.{n}.mlp.'
    if pre + 'experts.gate_up_proj' in t:
      gate_up = t.pop(pre + 'experts.gate_up_proj')
      down = t.pop(pre + 'experts.down_proj')
      f = gate_up.shape[1] // 2
      for j in range(n_experts):
        moe = f'model.layers.{n}.block_sparse_moe.experts.{j}.'
        t[moe + 'w1.weight'], t[moe + 'w3.weight'] = gate_up[j, :f], gate_up[j, f:]
        t[moe + 'w2.weight'] = down[j]
    if pre + 'gate.weight' in t:
      t[f'model.layers.{n}.block_sparse_moe.gate.weight'] = t.pop(pre + 'gate.weight')
  return t


def hub_names(config: dict) -> set[str]:
  names = {'model.embed_tokens.weight', 'model.norm.weight'}
  if not config.get('tie_word_embeddings', False):
    names.add('lm_head.weight')
  for n in range(config['num_hidden_layers']):
    pre = f'model.layers.{n}.'
    names |= {pre + s for s in ('input_layernorm.weight', 'post_attention_layernorm.weight',
                                'self_attn.q_proj.weight', 'self_attn.k_proj.weight',
                                'self_attn.v_proj.weight', 'self_attn.o_proj.weight',
                                'block_sparse_moe.gate.weight')}
    names |= {f'{pre}block_sparse_moe.experts.{j}.{w}.weight'
              for j in range(config['num_local_experts']) for w in ('w1', 'w2', 'w3')}
  return names


def from_hf(config: dict, t: dict[str, np.ndarray], span: tuple[int, int, int] | None = None,
            where: str = 'the Mixtral checkpoint'):
  """(ModelConfig, params) of a Mixtral: L = 1 (core = every layer), or with
  span=(start, stop, loops) layers [start, stop) replaced by a core of (stop - start) / loops
  shared layers looped `loops` times, each shared layer the average of the layers it replaces
  (the loop's layer i on pass l was layer start + l * D + i)."""
  check_hf_config(config, where)
  n, e = config['num_hidden_layers'], config['num_local_experts']
  t = hub_tensors(t, n, e)
  missing = sorted(hub_names(config) - set(t))
  extra = sorted(set(t) - hub_names(config) - {'lm_head.weight'})
  if missing or extra:
    raise ValueError(f'{where}: ' + '; '.join(
        p for p in (missing and f'missing tensors {missing[:8]}{" ..." if len(missing) > 8 else ""}',
                    extra and f'extra tensors {extra[:8]}{" ..." if len(extra) > 8 else ""}') if p))
  start, stop, loops = span or (0, n, 1)
  if not (0 <= start < stop <= n) or loops < 1 or (stop - start) % loops:
    raise ValueError(f'loop span {start}:{stop}:{loops}: needs 0 <= start < stop <= '
                     f'{n} layers and loops dividing stop - start')
  d, h = config['hidden_size'], config['num_attention_heads']
  g = config.get('num_key_value_heads') or h
  k = config.get('head_dim') or d // h
  depth = (stop - start) // loops
  cfg = ModelConfig(
      vocab_size=config['vocab_size'], d_model=d, num_heads=h, num_kv_heads=g, head_dim=k,
      expert_width=config['intermediate_size'], top_k=config['num_experts_per_tok'],
      renormalize=True, prelude_layers=start, prelude_experts=e, core_layers=depth,
      core_experts=e, num_loops=loops, coda_layers=n - stop, coda_experts=e,
      tie_attention=True, tie_embeddings=False, norm_gain=True,
      norm_eps=float(config.get('rms_norm_eps', 1e-5)), rope_theta=hf_rope_theta(config))
  f32 = lambda x: np.asarray(x, np.float32)

  def layer(i):
    pre, moe = f'model.layers.{i}.', f'model.layers.{i}.block_sparse_moe.'
    w = lambda name: f32(t[pre + name])
    experts = lambda name: np.stack([f32(t[f'{moe}experts.{j}.{name}.weight']).T
                                     for j in range(e)])
    return {
        'attn': {'q': w('self_attn.q_proj.weight').T.reshape(d, h, k),
                 'k': w('self_attn.k_proj.weight').T.reshape(d, g, k),
                 'v': w('self_attn.v_proj.weight').T.reshape(d, g, k),
                 'o': w('self_attn.o_proj.weight').T.reshape(h, k, d)},
        'attn_norm': {'scale': w('input_layernorm.weight')},
        'mlp_norm': {'scale': w('post_attention_layernorm.weight')},
        'moe': {'router': f32(t[moe + 'gate.weight']).T, 'gate': experts('w1'),
                'up': experts('w3'), 'down': experts('w2')}}

  def average(trees):
    import jax
    return jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0).astype(np.float32), *trees)

  embed = f32(t['model.embed_tokens.weight'])
  params = {'embed': embed, 'final_norm': {'scale': f32(t['model.norm.weight'])},
            'head': f32(t.get('lm_head.weight', embed)).T.copy()}
  if start:
    params['prelude'] = {f'layer_{i}': layer(i) for i in range(start)}
  params['core'] = {'body': {f'layer_{i}': average([layer(start + l * depth + i)
                                                    for l in range(loops)])
                             for i in range(depth)}}
  if stop < n:
    params['coda'] = {f'layer_{i}': layer(stop + i) for i in range(n - stop)}
  return cfg, params
