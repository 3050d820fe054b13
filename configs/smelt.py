"""SMELT (compute-matched looping): a 12-layer MoE baseline and its looped twin.

    python scripts/describe.py --config=configs/smelt.py:200m,baseline
    python scripts/describe.py --config=configs/smelt.py:200m,looped

The twin loops the middle 50% of the stack (layers 3..8) r = 2 times with every write inside
the loop scaled by 1/r, and pays for the extra 6 executed layers by narrowing the width
(1280 -> 1056) and widening the expert pool (192 -> 288 per layer), with head size and KV
heads chosen to hold the KV cache. Twin / baseline, FLOPs per token at context 2048 (4096,
this config's seq_len): FLOPs 1.0031 (1.0074), params 1.0007, KV 1.0312; the paper reports
1.029, 1.004 and 1.031 for this cell. The twin routes to 7 of 288 experts, the baseline to 6
of 192. The paper leaves unstated the baseline's heads, head size, expert width, top-k and
vocabulary; we assume 10 heads of 128 (MHA), experts of width 448, top-6 and a 65,536-token
vocabulary, and `scripts/match_budgets.py --fix=d_model=1056,core_experts=288` finds the
twin's head size 88, expert width 368 and top-7 from them. `smoke` shrinks both to CPU size.

Ablations (`loops=3`, `span=1.0`, `layers=8`, ...) are matched too: a looped variant of
another shape gets its own twin from the three-budget matcher (`scaling/matching.py`) against
the baseline of its depth, within 4% on FLOPs, params and KV, or is refused naming the
budget that fails. `python scripts/describe.py --config=configs/smelt.py:200m,looped,loops=3`
prints the three ratios against that baseline.
"""
from loopmoe_jax.config import middle_span, model_config_dict, parse_arg
from loopmoe_jax.experiment import experiment_config

VARIANTS = ('200m,baseline', '200m,looped', 'smoke,baseline', 'smoke,looped', '200m', 'looped',
            'size=smoke,variant=baseline')
SIZES = {
    # name: (baseline fields, looped-twin fields)
    '200m': (dict(d_model=1280, num_heads=10, head_dim=128, num_kv_heads=10,
                  core_experts=192, expert_width=448, top_k=6),
             dict(d_model=1056, num_heads=10, head_dim=88, num_kv_heads=10,
                  core_experts=288, expert_width=368, top_k=7)),
    'smoke': (dict(d_model=64, num_heads=4, head_dim=16, num_kv_heads=4, core_experts=16,
                   expert_width=32, top_k=2),
              # found by scripts/match_budgets.py: 1.020x FLOPs, 1.005x params, 1.031x KV
              dict(d_model=48, num_heads=2, head_dim=22, num_kv_heads=2, core_experts=31,
                   expert_width=24, top_k=3)),
}


# The published twin's shape (layers, span, loops); any other looped variant is matched anew.
PUBLISHED = (12, 0.5, 2)
MATCH_CONTEXT = {'200m': 2048, 'smoke': 128}  # the context its three budgets are counted at


def _model(size, variant, layers, span, loops):
  fields = dict(SIZES[size][variant == 'looped'])
  experts = fields['core_experts']
  if variant == 'looped':
    layout = middle_span(layers, span, loops)
  else:
    layout = dict(prelude_layers=0, core_layers=layers, coda_layers=0, num_loops=1)
  return model_config_dict(
      vocab_size=256 if size == 'smoke' else 65536,
      prelude_experts=experts, coda_experts=experts, tie_attention=True,
      residual_scale='inverse_loops', tie_embeddings=False, **layout, **fields)


def matched_twin(size, layers, span, loops):
  """A looped variant other than the published one (another loop count, span or depth) gets
  its own twin from the three-budget matcher against the baseline of the same depth (SMELT
  runs every ablation under the match); a ValueError names the budget that cannot be met."""
  from loopmoe_jax.config import ModelConfig
  from loopmoe_jax.scaling.matching import match
  base = ModelConfig.from_dict(_model(size, 'baseline', layers, span, loops))
  try:
    twin = match(base, span, loops, context=MATCH_CONTEXT[size]).config
  except ValueError as e:
    raise ValueError(f'configs/smelt.py {size},looped with layers={layers}, span={span}, '
                     f'loops={loops}: {e}') from None
  model = _model(size, 'looped', layers, span, loops)
  for key in ('d_model', 'num_heads', 'num_kv_heads', 'head_dim', 'expert_width', 'top_k',
              'prelude_experts', 'core_experts', 'coda_experts'):
    model[key] = getattr(twin, key)
  return model


def get_config(arg=None):
  opts = parse_arg(arg, {'variant': 'looped', 'size': '200m', 'smoke': False, 'layers': 12,
                         'span': 0.5, 'loops': 2},
                   choices={'variant': ('baseline', 'looped'), 'size': tuple(SIZES)})
  size = 'smoke' if opts['smoke'] else opts['size']
  shape = (opts['layers'], opts['span'], opts['loops'])
  if opts['variant'] == 'looped' and shape != PUBLISHED:
    model = matched_twin(size, *shape)
  else:
    model = _model(size, opts['variant'], *shape)
  if size == 'smoke':
    return experiment_config(model, train=dict(steps=200, warmup=20, lr=3e-3),
                             data=dict(seq_len=128, batch_size=8))
  return experiment_config(model, train=dict(steps=20_000, lr=3e-4, warmup=1000),
                           data=dict(seq_len=4096, batch_size=256, source='tokens'))
