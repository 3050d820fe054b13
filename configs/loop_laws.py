"""Loop scaling laws: middle-cycle looping with 2 prelude and 2 coda layers.

    python scripts/describe.py --config=configs/loop_laws.py:loops=4,experts=16
    python scripts/train.py --config=configs/loop_laws.py:smoke,loops=2 --workdir=/tmp/ll

The core of `core_layers` MoE layers (`experts` experts, top-`top_k`, tied attention) runs
`loops` times between 2 prelude and 2 coda layers with the same experts; `experts=0` gives
the dense law's points. `smoke` shrinks the widths to CPU size. Parameters stay fixed as
`loops` grows; FLOPs per token grow by the core's share per pass.

    python scripts/sweep.py --config=configs/loop_laws.py:smoke --root=/tmp/ll_sweep

runs the grid of `get_sweep()` (passes 1, 2, 4; `--sweep model.FIELD=v1,v2` replaces it).
`laws` selects the recipe that fits the loop laws (`get_sweep('laws')`: sizes x token counts
x passes 1-4 x expert counts; README, "Scaling laws and the papers"):

    python scripts/sweep.py --config=configs/loop_laws.py:smoke,laws,core_layers=1 \
        --config.train.compile_cache=/tmp/ll_laws/compile_cache --root=/tmp/ll_laws

Its points train with a constant learning rate (the two token counts of a model share one
compiled program, through the shared compile cache), no text sample and, at smoke scale, the
plain XLA dispatch and attention (half the compile time on CPU); the README fits it.
"""
from loopmoe_jax.config import model_config_dict, parse_arg
from loopmoe_jax.experiment import experiment_config

VARIANTS = ('loops=1', 'loops=4,experts=16', 'experts=0,loops=2', 'smoke,loops=8,experts=32',
            'smoke,laws,core_layers=1')
_DEFAULTS = {'loops': 2, 'experts': 8, 'top_k': 2, 'core_layers': 4, 'd_model': 512,
             'smoke': False, 'laws': False}

# The law recipe's grid: two sizes x two token counts x passes 1-4 x two expert counts. With
# r = 4 held out the fit keeps passes 1-3 (two looped counts: the bounded mapping's gamma and
# beta_r need both) and both values of every other axis. What it cannot identify the README's
# fit holds: two token counts give the data term's size, not its exponent beta; two expert
# counts one expert exponent (delta_e), not the interaction terms or Clark's saturation.
LAWS = {'smoke': {'model.d_model': [32, 64], 'model.num_experts': [4, 8],
                  'model.num_loops': [1, 2, 3, 4], 'train.steps': [30, 60]},
        'full': {'model.d_model': [512, 1024], 'model.num_experts': [8, 16],
                 'model.num_loops': [1, 2, 3, 4], 'train.steps': [10_000, 20_000]}}


def get_config(arg=None):
  opts = parse_arg(arg, _DEFAULTS)
  e = opts['experts']
  model = model_config_dict(
      smoke=opts['smoke'], vocab_size=32768, d_model=opts['d_model'], num_heads=8,
      expert_width=opts['d_model'] // 2 if e else 4 * opts['d_model'], top_k=opts['top_k'] if e else 1,
      prelude_layers=2, prelude_experts=e, core_layers=opts['core_layers'], core_experts=e,
      num_loops=opts['loops'], coda_layers=2, coda_experts=e, tie_attention=True)
  # the law recipe: a constant rate (the program does not depend on train.steps) and the
  # loss of the last steps only
  laws = dict(schedule='constant', sample_tokens=0) if opts['laws'] else {}
  if opts['smoke']:
    run = {}
    if opts['laws']:  # on CPU the plain XLA dispatch and attention compile in half the time
      laws.update(warmup=10, final_window=10)
      run = dict(dispatch='xla', attention_impl='xla')
    return experiment_config(model, train={'steps': 200, 'warmup': 20, 'lr': 3e-3, **laws},
                             data=dict(seq_len=128, batch_size=8,
                                       val_batches=1 if opts['laws'] else 4), run=run)
  return experiment_config(model, train={'steps': 20_000, 'lr': 1e-3, 'warmup': 500, **laws},
                           data=dict(seq_len=2048, batch_size=128, source='tokens'))


def get_sweep(arg=None):
  """The grid of scripts/sweep.py for this family: passes 1, 2 and 4; with `laws`, the law
  recipe (LAWS, at smoke or full scale)."""
  opts = parse_arg(arg, _DEFAULTS)
  if opts['laws']:
    return dict(LAWS['smoke' if opts['smoke'] else 'full'])
  return {'model.num_loops': [1, 2, 4]}
