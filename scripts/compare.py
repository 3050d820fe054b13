"""Paired comparison of two runs trained on the same data order (loopmoe_jax/analysis/paired.py).

    python scripts/compare.py --runs=DIR_A,DIR_B --out=OUT [--window=0.2] [--metric=loss]

Writes OUT/compare.json (mean step-wise loss difference A - B over the final window of shared
logged steps, its SE, the lag-1 autocorrelation, n_eff = n(1-rho)/(1+rho) and the SE with it,
each run's final-window loss, validation losses at shared eval steps, both curves) and
OUT/compare.png. Runs with different data sections, or no shared logged step, are refused.

The looped-vs-non-looped CPU comparison (FLOPs, params and KV matched with the matcher;
the baseline is the README main job unlooped, 4 layers, with 4 experts in its prelude and
coda as the main job had then; the twin loops its middle half twice):

    python scripts/match_budgets.py --baseline=configs/default.py --baseline.model.num_loops=1 \
        --baseline.model.prelude_experts=4 --baseline.model.coda_experts=4 --span=0.5 \
        --loops=2 --search_expert_width --json /tmp/cmp14/match.json
    # -> d_model 112, 2 heads / 1 KV head of 42, expert width 104, 9 experts per layer, 2 passes
    #    (FLOPs 0.994, params 0.994, KV 0.984 of the baseline)
    COMMON="--config=configs/default.py --config.train.steps=250 --config.train.log_every=1 \
        --config.train.eval_every=50 --config.train.save_every=125 --config.train.sample_tokens=0"
    python scripts/train.py $COMMON --config.model.num_loops=1 \
        --config.model.prelude_experts=4 --config.model.coda_experts=4 --workdir=/tmp/cmp14/base
    python scripts/train.py $COMMON --config.model.d_model=112 --config.model.num_heads=2 \
        --config.model.num_kv_heads=1 --config.model.head_dim=42 --config.model.expert_width=104 \
        --config.model.prelude_experts=9 --config.model.core_experts=9 \
        --config.model.coda_experts=9 --config.model.num_loops=2 \
        --config.model.residual_scale=inverse_loops --workdir=/tmp/cmp14/looped
    python scripts/compare.py --runs=/tmp/cmp14/looped,/tmp/cmp14/base --out=/tmp/cmp14/out
"""
import json
import os

from absl import flags

from loopmoe_jax.cli import check_output_dir, run

_RUNS = flags.DEFINE_list('runs', None, 'Two run directories A,B (difference A - B).',
                          required=True)
_OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
_WINDOW = flags.DEFINE_float('window', None, 'Final window: this fraction of the shared logged '
                             'steps (default: every step of the runs\' train.final_window, '
                             'from their final_steps.jsonl; runs without it: 0.2).')
_GAPS = flags.DEFINE_bool('allow_gaps', False, 'Compare a window with skipped steps (coarse '
                          'train.log_every and no per-step record).')
_METRIC = flags.DEFINE_string('metric', 'loss', 'metrics.jsonl key compared (train LM loss).')


def main(argv):
  del argv
  if len(_RUNS.value) != 2:
    raise ValueError(f'--runs={",".join(_RUNS.value)}: expected two run directories A,B')
  check_output_dir('--out', _OUT.value)
  from loopmoe_jax.analysis.paired import compare_runs, plot_comparison
  a, b = _RUNS.value
  res = compare_runs(a, b, _WINDOW.value, _METRIC.value, _GAPS.value)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, 'compare.json'), 'w') as f:
    json.dump(res, f, indent=1)
  png = plot_comparison(res, os.path.join(_OUT.value, 'compare.png'))
  lo, hi = res['window_steps']
  print(f"A = {res['run_a']}\nB = {res['run_b']}")
  print(f"final window: steps {lo}..{hi} ({res['n']} paired steps, from {res['window_source']}; "
        f"{res['shared_steps']} shared logged steps)")
  print(f"final-window {res['metric']}: A {res['final_window_loss_a']:.4f}  "
        f"B {res['final_window_loss_b']:.4f}")
  print(f"mean difference A - B: {res['mean_diff']:+.4f}  SE {res['se']:.4f}  "
        f"(lag-1 autocorrelation {res['lag1_autocorr']:.3f}, n_eff {res['n_eff']:.1f}, "
        f"SE_eff {res['se_eff']:.4f})")
  for step, (va, vb) in res['val_loss'].items():
    print(f'val_loss at step {step}: A {va:.4f}  B {vb:.4f}  A - B {va - vb:+.4f}')
  print(f"wrote {os.path.join(_OUT.value, 'compare.json')} and {png}")


if __name__ == '__main__':
  run(main)
