"""The Foil replication (`reproduce.py foil`)."""
from __future__ import annotations

import os

import numpy as np

from loopmoe_jax.experiment import load_config
from loopmoe_jax.replicate import common
from loopmoe_jax.train.run import RunDir
from loopmoe_jax.replicate.common import _mean, _table


def run(out: str, scale: str, log=print) -> tuple[dict, str]:
  from loopmoe_jax.accounting import count
  from loopmoe_jax.config import ModelConfig
  variants = ('base', 'foil3', 'foil2', 'foil1')
  steps = 150 if scale == 'cpu' else 3000
  from loopmoe_jax.analysis import paired
  from loopmoe_jax.analysis.diagnose import diagnose
  results, runs, dirs = {}, {}, {}
  for v in variants:
    cfg = load_config(f'configs/foil.py:{v}' + (',smoke' if scale == 'cpu' else ''))
    cfg.train.steps, cfg.train.sample_tokens, cfg.train.log_every = steps, 0, 1
    cfg.train.routing_every, cfg.train.eval_every = steps // 3, steps
    if scale == 'gpu':
      cfg.data.source = 'embedded'
    (row,) = common._sweep(cfg, {'train.steps': [steps]}, os.path.join(out, v), log)
    mc = ModelConfig.from_dict(cfg.model)
    run = RunDir(row['workdir'])
    metrics, summary, routing = run.metrics(required=True), run.summary(), run.routing()
    last = max(r['step'] for r in routing)
    core = [r for r in routing if r['step'] == last and r['segment'] == 'core']
    by_pass = {}
    for r in core:
      by_pass.setdefault(r['pass'], []).append(r['max_vio'])
    runs[v] = {m['step']: m['loss'] for m in metrics}
    results[v] = {'shape': f'{mc.core_experts}x{mc.core_layers}x{mc.num_loops}',
                  'params': count(mc)['params_total'], 'val_loss': summary['val_loss'],
                  'final_window_loss': summary['final_window_loss'],
                  'max_vio_by_pass': {p: float(np.mean(v_)) for p, v_ in sorted(by_pass.items())}}
    dirs[v] = row['workdir']
    log(f'foil: routing diagnostics of {v}')
    diag = diagnose(row['workdir'], os.path.join(out, 'diagnostics', v),
                    tokens=4096 if scale == 'cpu' else 65536, mask_draws=2, log=log)
    core = diag['segments'].get('core', {})
    results[v]['diagnostics'] = {k: core.get(k) for k in (
        'U_mean', 'U_normalized', 'B2_pooled', 'B2_per_pass', 'MaxVio_global', 'MMR_overall',
        'MMR_per_pass')}
  for v in variants[1:]:
    c = paired.compare_runs(dirs[v], dirs['base'], window=0.5)
    results[v]['paired_diff_vs_base'] = {k: c[k] for k in ('mean_diff', 'se', 'lag1_autocorr',
                                                           'n_eff', 'se_eff', 'n')}
  rows = [{'variant': v, **{k: results[v][k] for k in ('shape', 'params', 'val_loss',
                                                       'final_window_loss')},
           'paired_diff': results[v].get('paired_diff_vs_base', {}).get('mean_diff', 0.0),
           'se_eff': results[v].get('paired_diff_vs_base', {}).get('se_eff', 0.0),
           'max_vio_pass0': results[v]['max_vio_by_pass'].get(0, float('nan'))}
          for v in variants]
  diag_rows = [{'variant': v, 'U': d['U_mean'], 'U_norm': d['U_normalized'],
                'B2_pooled': _mean(d['B2_pooled']), 'B2_per_pass': _mean(d['B2_per_pass']),
                'MaxVio': _mean(d['MaxVio_global']), 'MMR': d['MMR_overall']}
               for v in variants for d in [results[v]['diagnostics']]]
  report = f"""# Foil, mini-replication ({scale} scale)

The looped-block shapes (E, D, L) of `configs/foil.py` ({'smoke widths, ' if scale == 'cpu'
else ''}{steps} steps, one data order, untied per-pass attention), equal parameters within
each family. **Different scale from the paper** (553.7M parameters, 20B tokens).

{_table(rows, ['variant', 'shape', 'params', 'val_loss', 'final_window_loss', 'paired_diff',
               'se_eff', 'max_vio_pass0'])}

`paired_diff`: mean over the second half of training of (variant loss - Base loss) at the same
step on the same batch (negative: better than Base), `se_eff` its standard error with the
lag-1-autocorrelation effective sample size (analysis/paired.py). MaxVio of the core's first
pass at the last routing record.

Routing diagnostics of the final checkpoints over held-out tokens (analysis/diagnose.py; core
layers, means over layers and passes; per-run JSON and heatmaps under `diagnostics/`):

{_table(diag_rows, ['variant', 'U', 'U_norm', 'B2_pooled', 'B2_per_pass', 'MaxVio', 'MMR'])}

Paper: flattening to more experts, fewer layers and more passes (Foil-1/2/3) beats Base at
equal parameters and compute, and untied attention is needed for the gain.
"""
  return results, report
