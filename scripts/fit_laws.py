"""Fits scaling-law forms to a CSV and prints the comparison table and design numbers.

    python scripts/fit_laws.py --data=tests/data/chinchilla_fig4_epoch.csv --format=epoch \
        --forms=chinchilla --bootstrap=200 --budget=5.76e23 --plot=/tmp/chinchilla.png
    python scripts/fit_laws.py --data=/tmp/sweep/sweep.csv \
        --forms=loop_linear,loop_power,loop_bounded --holdout=r=4 --plot=/tmp/sweep.png

--format=sweep reads the columns that scripts/sweep.py writes (N_stored, N_active_pass,
N_active_executed, N_block_stored, N_block_active, D, C, F, S, r, E, k, loss); --format=epoch reads Epoch AI's digitisation of Chinchilla's Figure 4
(D = C / 6N; the five highest-loss points dropped). --n_column picks the column used as the
law's N for chinchilla/clark (e.g. N_active_pass). --fix holds named parameters (e.g. --fix=beta=0.3,B=0).

    python scripts/fit_laws.py --data=LOOPED.csv --forms=smelt --smelt_baseline=BASE.csv \
        --budget=1e20          # SMELT's frontier exponent, optimum and compute efficiency
"""
import json

from absl import flags

from loopmoe_jax.cli import run
from loopmoe_jax.replicate.common import json_default

_DATA = flags.DEFINE_string('data', None, 'CSV of points.', required=True)
_FORMAT = flags.DEFINE_enum('format', 'sweep', ['sweep', 'epoch'], 'CSV layout.')
_FORMS = flags.DEFINE_list('forms', ['chinchilla'], 'Law forms to fit.')
_N = flags.DEFINE_string('n_column', None, 'Column used as the N of chinchilla/clark '
                         '(default: N, else N_stored); the loop and moe laws read '
                         'N_active_pass and N_block_active.')
_HOLDOUT = flags.DEFINE_list('holdout', [], 'AXIS=VALUE held out, e.g. r=4,E=16.')
_BOOT = flags.DEFINE_integer('bootstrap', 0, 'Bootstrap resamples (0: none).')
_BUDGET = flags.DEFINE_float('budget', 0.0, 'Compute budget (FLOPs) for compute-optimal N, D.')
_FIX = flags.DEFINE_list('fix', [], 'NAME=VALUE parameters held fixed.')
_TOP = flags.DEFINE_integer('top', 16, 'L-BFGS runs from the best grid starts.')
_PLOT = flags.DEFINE_string('plot', None, 'PNG path for the fits.')
_X = flags.DEFINE_string('x', None, 'Plot x axis (default N, or r for loop forms).')
_JSON = flags.DEFINE_string('json', None, 'Write fitted params and the table here.')
_SMELT_BASE = flags.DEFINE_string(
    'smelt_baseline', None, 'With --forms=smelt and --budget: the baseline grid\'s CSV; prints '
    'SMELT\'s analyses (frontier exponent, optimum, tokens/param, compute efficiency).')
_RESAMPLES = flags.DEFINE_integer('cell_resamples', 2000, 'Cell-bootstrap resamples (SMELT).')


def main(argv):
  del argv
  import numpy as np
  from loopmoe_jax import scaling
  if _FORMAT.value == 'epoch':
    data = scaling.chinchilla_epoch(_DATA.value)
  else:
    data = scaling.as_columns(scaling.read_csv(_DATA.value))
    column = _N.value or ('N' if 'N' in data else 'N_stored')
    if column in data:
      data['N'] = data[column]
    elif _N.value:
      raise ValueError(f'--n_column={column}: no such column in {_DATA.value}')
  fixed = {k: float(v) for k, v in (s.split('=') for s in _FIX.value)}
  holdouts = [(a, float(v)) for a, v in (s.split('=') for s in _HOLDOUT.value)]
  kw = dict(top=_TOP.value, fixed=fixed or None)
  rows = scaling.compare(_FORMS.value, data, holdouts, **kw)
  print(f'{len(data["loss"])} points; forms ranked by held-out RMSE' if holdouts else
        f'{len(data["loss"])} points')
  print(scaling.format_table(rows))
  fits = {name: scaling.fit(name, data, **kw) for name in _FORMS.value}
  out = {'table': rows, 'fits': {}}
  for name, f in fits.items():
    entry = {'params': f.params, 'rmse': f.rmse}
    if _BOOT.value:
      b = scaling.bootstrap(name, data, n=_BOOT.value, base=f, **kw)
      entry['se'] = b['se']
      print(f'{name} bootstrap se ({_BOOT.value} resamples): ' +
            ', '.join(f'{k}={v:.4g}' for k, v in b['se'].items()))
    if _BUDGET.value and name == 'chinchilla':
      n_opt, d_opt = scaling.chinchilla_optimal(f.params, _BUDGET.value)
      entry['compute_optimal'] = {'C': _BUDGET.value, 'N': n_opt, 'D': d_opt}
      print(f'compute-optimal at C={_BUDGET.value:.3g}: N*={n_opt:.4g} params, '
            f'D*={d_opt:.4g} tokens ({d_opt / n_opt:.1f} tokens/param)')
    out['fits'][name] = entry
  if _SMELT_BASE.value:
    out['smelt_analysis'] = _smelt_analysis(scaling, data)
  if _PLOT.value:
    loop = any(n.startswith('loop_') for n in fits)
    x = _X.value or ('r' if loop and len(np.unique(data.get('r', [1]))) > 1 else 'N')
    scaling.plots.plot_fits(data, fits, _PLOT.value, x=x,
                            title=f'{", ".join(fits)} on {len(data["loss"])} points')
    print(f'plot: {_PLOT.value}')
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(out, f, indent=1, default=json_default)  # bootstrap samples as lists


def _smelt_analysis(scaling, data):
  from loopmoe_jax.scaling import smelt_analysis
  if not _BUDGET.value:
    raise ValueError('--smelt_baseline needs --budget (the training compute of the optimum)')
  base = scaling.as_columns(scaling.read_csv(_SMELT_BASE.value))
  rep = smelt_analysis.report(base, data, _BUDGET.value, resamples=_RESAMPLES.value)
  print(f'SMELT analyses at C={_BUDGET.value:.3g} ({_RESAMPLES.value} cell resamples, 95%):')
  for name in ('baseline', 'smelt'):
    r = rep[name]
    print(f'  {name} (S={r["S"]:.3f}): ' + ', '.join(
        f'{k} {r[k]["value"]:.4g} [{r[k]["ci"][0]:.4g}, {r[k]["ci"][1]:.4g}]'
        for k in ('gamma', 'F', 'D', 'tokens_per_param')))
  e = rep['compute_efficiency']
  print(f'  compute efficiency at loss {e["loss"]:.4f}: {e["value"]:.3f} '
        f'[{e["ci"][0]:.3f}, {e["ci"][1]:.3f}]')
  strip = lambda d: {k: (v if not isinstance(v, dict) else
                         {kk: vv for kk, vv in v.items() if kk != 'samples'})
                     for k, v in d.items()}
  return {k: strip(v) for k, v in rep.items()}


if __name__ == '__main__':
  run(main)
