"""Loop scaling laws: middle-cycle looping with 2 prelude and 2 coda layers.

    python scripts/describe.py --config=configs/loop_laws.py:loops=4,experts=16
    python scripts/train.py --config=configs/loop_laws.py:smoke,loops=2 --workdir=/tmp/ll

The core of `core_layers` MoE layers (`experts` experts, top-`top_k`, tied attention) runs
`loops` times between 2 prelude and 2 coda layers with the same experts; `experts=0` gives
the dense law's points. `smoke` shrinks the widths to CPU size. Parameters stay fixed as
`loops` grows; FLOPs per token grow by the core's share per pass.

    python scripts/sweep.py --config=configs/loop_laws.py:smoke --root=/tmp/ll_sweep

runs the grid of `get_sweep()` (passes 1, 2, 4; `--sweep model.FIELD=v1,v2` replaces it).
"""
from loopmoe_jax.config import model_config_dict, parse_arg
from loopmoe_jax.experiment import experiment_config

VARIANTS = ('loops=1', 'loops=4,experts=16', 'experts=0,loops=2', 'smoke,loops=8,experts=32')


def get_config(arg=None):
  opts = parse_arg(arg, {'loops': 2, 'experts': 8, 'top_k': 2, 'core_layers': 4,
                         'd_model': 512, 'smoke': False})
  e = opts['experts']
  model = model_config_dict(
      smoke=opts['smoke'], vocab_size=32768, d_model=opts['d_model'], num_heads=8,
      expert_width=opts['d_model'] // 2 if e else 4 * opts['d_model'], top_k=opts['top_k'] if e else 1,
      prelude_layers=2, prelude_experts=e, core_layers=opts['core_layers'], core_experts=e,
      num_loops=opts['loops'], coda_layers=2, coda_experts=e, tie_attention=True)
  if opts['smoke']:
    return experiment_config(model, train=dict(steps=200, warmup=20, lr=3e-3),
                             data=dict(seq_len=128, batch_size=8))
  return experiment_config(model, train=dict(steps=20_000, lr=1e-3, warmup=500),
                           data=dict(seq_len=2048, batch_size=128, source='tokens'))


def get_sweep(arg=None):
  """The default grid of scripts/sweep.py for this family: passes 1, 2 and 4."""
  del arg
  return {'model.num_loops': [1, 2, 4]}
