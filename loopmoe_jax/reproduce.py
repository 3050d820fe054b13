"""One-command mini-replications of the three papers: `run(name, out, scale)`.

Each pipeline trains its grid with the sweep runner (same seed and data order for every
point; finished points are skipped, interrupted ones resume), analyses the results with the
scaling-law code, and writes OUT/report.md (our figures beside the paper's, marked as a
different scale), OUT/results.json, OUT/sweep.csv and plots.

- loop_laws: passes x core experts on the loop-laws family; the loop forms (linear, power,
  bounded, sparsity-conditional bounded) compared by held-out RMSE at the largest pass count
  and the largest expert count; the compute-optimal pass count of the best form.
- smelt: the baseline and its compute-matched looped twin, each on a grid of widths x expert
  pools x training lengths; SMELT's law fitted per architecture, its compute-optimal frontier
  (gamma, tokens per parameter) and the compute saved at a matched loss (Hernandez & Brown),
  with cell-bootstrap intervals (scaling/smelt_analysis.py).
- foil: the looped-block shapes (E, D, L) at equal parameters on one data order: final
  losses, paired per-step loss differences against Base, and MaxVio per pass.

`scale='cpu'` fits two CPU cores in under 30 minutes each; `scale='gpu'` widens the models
and runs longer (about an hour on one H200; not run in CI).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from loopmoe_jax.experiment import load_config

SCALES = ('cpu', 'gpu')
SMELT_RESAMPLES = {'cpu': 200, 'gpu': 2000}  # cell-bootstrap resamples of the SMELT analyses


def _sweep(cfg, grid, out, log):
  from loopmoe_jax.scaling.sweep import run_sweep
  return run_sweep(cfg, grid, os.path.join(out, 'runs'), log=log)


def _columns(rows) -> dict[str, np.ndarray]:
  """The numeric fields of sweep rows as columns."""
  keys = [k for k, v in rows[0].items() if isinstance(v, (int, float, np.number))]
  return {k: np.array([r[k] for r in rows], float) for k in keys}


def _table(rows, keys) -> str:
  head = '| ' + ' | '.join(keys) + ' |\n|' + '---|' * len(keys) + '\n'
  fmt = lambda v: f'{v:.4g}' if isinstance(v, float) else str(v)
  return head + '\n'.join('| ' + ' | '.join(fmt(r[k]) for k in keys) + ' |' for r in rows)


# Loop scaling laws --------------------------------------------------------------------------

def loop_laws(out: str, scale: str, log=print) -> tuple[dict, str]:
  from loopmoe_jax import scaling
  from loopmoe_jax.scaling import design
  arg = 'smoke,core_layers=2' if scale == 'cpu' else 'd_model=512,core_layers=4'
  cfg = load_config(f'configs/loop_laws.py:{arg}')
  cfg.train.sample_tokens = 0
  if scale == 'gpu':
    cfg.data.source, cfg.train.steps, cfg.data.batch_size = 'embedded', 2000, 32
  passes, experts = (1, 2, 4), (4, 8, 16)
  rows = _sweep(cfg, {'model.num_loops': list(passes), 'model.core_experts': list(experts)},
                out, log)
  data = _columns(rows)
  # every point trains on the same tokens: the data term is a constant, absorbed by E
  fixed = {'B': 0.0, 'gamma_e': 0.0, 'omega_e': 0.0, 'zeta_e': 0.0}
  forms = ['loop_linear', 'loop_power', 'loop_bounded', 'loop_sparse_bounded']
  holdouts = [('r', float(max(passes))), ('E', float(max(experts)))]
  table = scaling.compare(forms, data, holdouts, fixed=fixed)
  best = scaling.fit(table[0]['form'], data, fixed=fixed)
  mid = {k: float(np.median(data[k])) for k in ('N_active_pass', 'N_block_active')}
  compute = float(np.median(data['C']))
  opt = design.optimal_passes(best, compute, range(1, 9),
                              {**mid, 'E': float(max(experts)), 'k': float(data['k'][0])},
                              active=mid['N_active_pass'], active_block=mid['N_block_active'])
  fits = {f: scaling.fit(f, data, fixed=fixed) for f in forms}
  scaling.plots.plot_fits(data, fits, os.path.join(out, 'fits.png'), x='r', group='E',
                          title=f'loop laws on {len(rows)} points ({scale} scale)')
  results = {'points': len(rows), 'table': table, 'best_form': table[0]['form'],
             'compute_optimal_passes': {'C': compute, 'E': max(experts), **opt}}
  grid_rows = [{'r': int(r['r']), 'E': int(r['E']), 'loss': r['loss'],
                'N_active_pass': int(r['N_active_pass']), 'N_stored': int(r['N_stored'])}
               for r in rows]
  report = f"""# Loop scaling laws, mini-replication ({scale} scale)

Grid: passes {list(passes)} x core experts {list(experts)} (top-{int(data['k'][0])}) on
`configs/loop_laws.py:{arg}`, {int(data['D'][0]):,} training tokens per point, one data order.
**Different scale from the paper** (its sweep spans 10^7-10^9 parameters and billions of
tokens); read the ranking, not the constants.

## Points

{_table(grid_rows, ['r', 'E', 'N_active_pass', 'N_stored', 'loss'])}

## Forms by held-out RMSE (r = {max(passes)} and E = {max(experts)} held out)

{_table(table, ['form', 'n_params', 'rmse', 'heldout_mean'])}

Paper: the sparsity-conditional bounded mapping has the lowest held-out RMSE on every held-out
axis; linear overestimates the gain of looping and power stays optimistic. Ours: the best
form is **{table[0]['form']}**.

## Compute-optimal passes (best form, C = {compute:.3g} FLOPs, E = {max(experts)})

r* = {opt['r']} (a pass is accepted when it lowers the predicted loss by more than the fit's
RMSE, {opt['tol']:.4f}). Paper: the law selects a finite r* that grows with sparsity.

![fits](fits.png)
"""
  return results, report


# SMELT --------------------------------------------------------------------------------------

def smelt(out: str, scale: str, log=print) -> tuple[dict, str]:
  from loopmoe_jax.scaling import smelt_analysis
  size = 'smoke' if scale == 'cpu' else '200m'
  steps = (50, 100, 200) if scale == 'cpu' else (2000, 4000, 8000)
  resamples = SMELT_RESAMPLES[scale]
  arch_rows, matched = {}, {}
  for variant in ('baseline', 'looped'):
    cfg = load_config(f'configs/smelt.py:{size},{variant}')
    cfg.train.sample_tokens, cfg.train.warmup = 0, 10
    if scale == 'gpu':
      cfg.data.source = 'embedded'
    width, experts = cfg.model.d_model, cfg.model.core_experts
    matched[variant] = (width, experts)
    # four cells per architecture (width x1, x1.5 by experts x1, x2: F and S vary), each at
    # three training lengths: the fewest that identify the SMELT law's six coefficients
    rows = _sweep(cfg, {'model.d_model': [width, width * 3 // 2],
                        'model.core_experts': [experts, 2 * experts],
                        'train.steps': list(steps)}, os.path.join(out, variant), log)
    arch_rows[variant] = rows
  cols = {v: _columns(rows) for v, rows in arch_rows.items()}
  compute = float(max(np.max(c['C']) for c in cols.values()))
  rep = smelt_analysis.report(cols['baseline'], cols['looped'], compute, resamples=resamples)
  fits = {v: rep[name]['params'] for v, name in (('baseline', 'baseline'), ('looped', 'smelt'))}
  pair = {v: {int(r['steps']): r['loss'] for r in rows
              if (r['model.d_model'], r['model.core_experts']) == matched[v]}
          for v, rows in arch_rows.items()}
  points = [{'arch': v, 'width': int(r['model.d_model']), 'experts': int(r['model.core_experts']),
             'steps': int(r['steps']), 'F': int(r['F']), 'S': float(r['S']), 'C': float(r['C']),
             'loss': r['loss']} for v, rows in arch_rows.items() for r in rows]
  summary = {v: {k: rep[name][k]['value'] for k in ('gamma', 'F', 'D', 'tokens_per_param',
                                                    'loss')}
             | {k + '_ci': rep[name][k]['ci'] for k in ('gamma', 'tokens_per_param')}
             | {'S': rep[name]['S']}
             for v, name in (('baseline', 'baseline'), ('looped', 'smelt'))}
  eff = rep['compute_efficiency']
  results = {'points': points, 'fits': fits, 'frontier': summary, 'compute': compute,
             'matched_loss': eff['loss'], 'compute_efficiency': eff['value'],
             'compute_efficiency_ci': eff['ci'], 'matched_pair': pair}
  frontier_rows = [{'arch': v, **{k: summary[v][k] for k in ('S', 'gamma', 'F', 'D',
                                                             'tokens_per_param', 'loss')},
                    'gamma 95%': '[{:.3g}, {:.3g}]'.format(*summary[v]['gamma_ci'])}
                   for v in summary]
  pair_rows = [{'steps': s, 'baseline': pair['baseline'][s], 'looped': pair['looped'][s]}
               for s in sorted(pair['baseline'])]
  pair_dirs = {v: next(r['workdir'] for r in rows if int(r['steps']) == max(steps) and
                       (r['model.d_model'], r['model.core_experts']) == matched[v])
               for v, rows in arch_rows.items()}
  results['analysis'] = analysis = smelt_probes(pair_dirs, log)
  probe_text = smelt_probe_report(analysis)
  report = f"""# SMELT, mini-replication ({scale} scale)

Each architecture of `configs/smelt.py:{size},baseline|looped` (the twin loops the middle half
twice with 1/r scaling) in four cells (1x and 1.5x the width by 1x and 2x the experts; the
first is the compute-matched pair) at training lengths {list(steps)}, one data order. **Different scale
from the paper** (200M-active models, billions of tokens): read the pipeline, not the constants.

## Points

{_table(points, ['arch', 'width', 'experts', 'steps', 'F', 'S', 'C', 'loss'])}

## The compute-matched pair

{_table(pair_rows, ['steps', 'baseline', 'looped'])}

## SMELT law per architecture, L = E + A (1-S)^b / F^a + K / D^c

{_table([{'arch': v, **fits[v]} for v in fits], ['arch', 'E', 'A', 'b', 'a', 'K', 'c'])}

## Compute-optimal frontier at C = {compute:.3g} FLOPs (cell bootstrap, {resamples} resamples)

{_table(frontier_rows, ['arch', 'S', 'gamma', 'gamma 95%', 'F', 'D', 'tokens_per_param', 'loss'])}

At the baseline frontier's loss at this compute ({eff['loss']:.4f}) the looped frontier needs
**{eff['value']:.1%}** less training compute (95% interval {eff['ci'][0]:.1%} to
{eff['ci'][1]:.1%}; negative: it costs more).

Paper: a 6.8-18.0% training-compute discount across its grid, growing with compute; frontier
exponents gamma 0.250 (SMELT) vs 0.237 (baseline).

{probe_text}"""
  return results, report


def smelt_probes(pair_dirs: dict[str, str], log=print, tokens: int = 4096) -> dict:
  """SMELT's probes and in-context eval of the compute-matched pair (`pair_dirs`:
  {'baseline', 'looped'} run directories): Q/K/V cosine between the twin's visits, sink mass
  per visit, and Dyck-2 exact match by shots (analysis/probes.py, analysis/evals.py)."""
  from loopmoe_jax.analysis import evals, probes
  out = {}
  for v, workdir in pair_dirs.items():
    log(f'smelt: probes and Dyck of {workdir}')
    out[v] = {'workdir': workdir, 'probes': probes.probe_workdir(workdir, tokens),
              'dyck': evals.reasoning_evals(workdir, examples=32)['dyck']}
  return out


def smelt_probe_report(analysis: dict) -> str:
  rows = []
  for v, a in analysis.items():
    for n, sim in a['probes'].get('qkv_cosine', {}).items():
      sim = np.asarray(sim)  # [D][L][L]: visit 1 against visit 2 per shared layer
      if sim.shape[-1] < 2:  # one pass: no second visit to compare
        continue
      rows.append({'arch': v, 'probe': f'{n} cosine, visits 1-2',
                   'per layer': ', '.join(f'{x:.3f}' for x in sim[:, 0, 1])})
    for seg, mass in a['probes']['sink_mass'].items():
      rows.append({'arch': v, 'probe': f'sink mass, {seg}',
                   'per layer': ', '.join(f'{x:.3f}' for x in np.ravel(mass))})
  dyck = [{'arch': v, **{f'{k}-shot': (d['accuracy'] if 'accuracy' in d else 'refused')
                          for k, d in a['dyck'].items()}} for v, a in analysis.items()]
  shots = [k for k in dyck[0] if k != 'arch']
  return f"""## Probes and in-context Dyck of the compute-matched pair (longest run)

{_table(rows, ['arch', 'probe', 'per layer'])}

Dyck-2 completion, exact match of the closing sequence (teacher-forced argmax, 32 queries;
'refused': the prompts exceed the trained context):

{_table(dyck, ['arch'] + shots)}

Paper: queries, keys and values of the second visit stay close to the first's; the looped
model's sink mass differs from the baseline's; looping helps Dyck in-context accuracy at
many shots (models trained on billions of tokens).
"""


# Foil ---------------------------------------------------------------------------------------

def foil(out: str, scale: str, log=print) -> tuple[dict, str]:
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
    (row,) = _sweep(cfg, {'train.steps': [steps]}, os.path.join(out, v), log)
    mc = ModelConfig.from_dict(cfg.model)
    with open(os.path.join(row['workdir'], 'metrics.jsonl')) as f:
      metrics = [json.loads(line) for line in f]
    with open(os.path.join(row['workdir'], 'summary.json')) as f:
      summary = json.load(f)
    with open(os.path.join(row['workdir'], 'routing.jsonl')) as f:
      routing = [json.loads(line) for line in f]
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


PIPELINES = {'loop_laws': loop_laws, 'smelt': smelt, 'foil': foil}


def run(name: str, out: str, scale: str = 'cpu', log=print) -> dict:
  if name not in PIPELINES:
    raise ValueError(f'unknown replication {name!r}; known: {sorted(PIPELINES)}')
  if scale not in SCALES:
    raise ValueError(f'--scale={scale!r}: must be one of {SCALES}')
  os.makedirs(out, exist_ok=True)
  t0 = time.time()
  results, report = PIPELINES[name](out, scale, log)
  wall = time.time() - t0
  train_s = _training_seconds(out)
  results = {'name': name, 'scale': scale, 'wall_s': wall, 'training_s': train_s, **results}
  with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1, default=_json_default)
  with open(os.path.join(out, 'report.md'), 'w') as f:
    f.write(report + f'\nTraining time (sum over the points\' runs): {train_s / 60:.1f} min; this '
            f'invocation: {wall / 60:.1f} min (finished points are skipped).\n')
  log(f'{name}: report {os.path.join(out, "report.md")} ({wall / 60:.1f} min)')
  return results


def _training_seconds(out: str) -> float:
  """Sum of the wall time of every run under `out` (their summary.json)."""
  total = 0.0
  for root, _, files in os.walk(out):
    if 'summary.json' in files:
      with open(os.path.join(root, 'summary.json')) as f:
        total += float(json.load(f).get('wall_s', 0.0))
  return total


def _mean(x) -> float:
  return float(np.mean(x)) if x is not None else float('nan')


def _json_default(x: Any):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)
