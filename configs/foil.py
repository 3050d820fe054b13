"""Foil ("flatten the experts, untie the attention"): looped-block shapes (E, D, L).

    python scripts/describe.py --config=configs/foil.py:foil1
    python scripts/describe.py --config=configs/foil.py:shape=8x4x2,smoke --init

d_model 1024, 16 heads of 64 (MHA), SwiGLU experts of width 1536, top-2, vocabulary 49152,
untied embeddings, RMSNorm without gain, no biases; a prelude and a coda of one MoE layer
with 8 experts. Variants: `base` (8,8,2), `foil3` (16,4,4), `foil2` (32,2,8), `foil1`
(64,1,16), each with per-pass attention; the tied controls `base_tied`, `protofoil3/2/1`;
and `shape=ExDxL` (untied; add `tied`). Base and every Foil have 553.7M parameters,
Base-tied 520.2M, proto-Foil-1 490.8M. `smoke` shrinks the widths to CPU size.

`base_tied` is Base with one attention set shared by its passes (`tie_attention`), nothing
else changed: the same FLOPs, C (L - 1) = 8 attention sets fewer. `reproduce.py foil` trains
it beside Base and the Foils (same seed, same data order) and pairs it over every step of
the final window (report.md, results.json 'base_tied', 'paired_diff_vs_base_tied'):

    python scripts/reproduce.py foil --out /tmp/repro_foil --scale cpu
    # -> 5 runs of 150 steps, 12.7 min on 2 shared cores; Base-tied - Base +0.0026 nat
    #    (SE_eff 0.0037, steps 101..150: not resolved), MMR Base / Base-tied - 1 = +1.7%

The paper recipe trains in bfloat16 (float32 master weights and optimizer state) for 50k
steps of 96 x 4096 tokens and keeps step 45,000 for good (`train.keep_steps`), the start of
the 100B continuation:

    python scripts/train.py --config=configs/foil.py:foil1 --config.data.path=TRAIN.bin \
        --config.train.steps=254313 --config.train.init_from=RUN --config.train.init_step=45000 \
        --workdir=RUN_100B
"""
from loopmoe_jax.config import flatten, model_config_dict, parse_arg
from loopmoe_jax.experiment import experiment_config

VARIANTS = ('base', 'foil3', 'foil2', 'foil1', 'base_tied', 'protofoil3', 'protofoil2',
            'protofoil1', 'shape=8x4x2', 'shape=8x8x8,tied', 'foil1,smoke', 'base_tied,smoke')
BASE = (8, 8, 2)
FLATTEN = {'base': 1, 'foil3': 2, 'foil2': 4, 'foil1': 8}
TIED = {'base_tied': 'base', 'protofoil3': 'foil3', 'protofoil2': 'foil2', 'protofoil1': 'foil1'}


def core_shape(opts):
  """(E, D, L, tied) of the looped block named by the parsed argument."""
  if opts['shape']:
    try:
      e, d, l = (int(v) for v in opts['shape'].lower().split('x'))
    except ValueError:
      raise ValueError(f"config argument shape={opts['shape']!r}: expected ExDxL") from None
    if min(e, d, l) < 1:
      raise ValueError(f"config argument shape={opts['shape']!r}: E, D and L must be >= 1")
    return e, d, l, opts['tied']
  name = TIED.get(opts['variant'], opts['variant'])
  if name not in FLATTEN:
    raise ValueError(f"foil variant {opts['variant']!r}: known {sorted(FLATTEN) + sorted(TIED)}")
  return (*flatten(*BASE, FLATTEN[name]), opts['variant'] in TIED or opts['tied'])


def get_config(arg=None):
  opts = parse_arg(arg, {'variant': 'base', 'shape': '', 'tied': False, 'smoke': False},
                   choices={'variant': tuple(FLATTEN) + tuple(TIED)})
  e, d, l, tied = core_shape(opts)
  model = model_config_dict(
      smoke=opts['smoke'], vocab_size=49152, d_model=1024, num_heads=16, head_dim=64,
      expert_width=1536, top_k=2, renormalize=True, tie_embeddings=False, norm_gain=False,
      prelude_layers=1, prelude_experts=8, coda_layers=1, coda_experts=8,
      core_layers=d, core_experts=e, num_loops=l, tie_attention=tied)
  if opts['smoke']:
    return experiment_config(model, train=dict(steps=200, warmup=20, lr=3e-3, final_window=50),
                             data=dict(seq_len=128, batch_size=8))
  # Foil's recipe: 50k steps of 96 x 4096 tokens (19.66B), bfloat16 compute with float32
  # master weights; step 45,000 is kept for good (train.keep_steps) for the 100B continuation.
  model.dtype, model.param_dtype = 'bfloat16', 'float32'
  return experiment_config(model, train=dict(keep_steps='45000',
      steps=50_000, lr=3e-4, warmup=1000, schedule='wsd', decay_fraction=0.1,
      decay_shape='1-sqrt', final_lr_fraction=0.05, b1=0.9, b2=0.95, weight_decay=0.1, clip=1.0,
      lb_coef=0.01, z_coef=0.001, final_window=2000, seed=42, log_every=50, eval_every=1000,
      save_every=1000), data=dict(seq_len=4096, batch_size=96, source='tokens'))
