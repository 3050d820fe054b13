"""Fits scaling-law forms to a CSV and prints the comparison table and design numbers.

    python scripts/fit_laws.py --data=tests/data/chinchilla_fig4_epoch.csv --format=epoch \
        --forms=chinchilla --bootstrap=200 --budget=5.76e23 --plot=/tmp/chinchilla.png
    python scripts/fit_laws.py --data=/tmp/ll_laws/sweep.csv \
        --forms=loop_linear,loop_power,loop_bounded --holdout=r=4 --plot=/tmp/fit.png \
        --fix=beta=0.37,gamma_e=0,omega_e=0,zeta_e=0,E_start=1,E_max=inf

--format=sweep reads the columns that scripts/sweep.py writes (N_stored, N_active_pass,
N_active_executed, N_block_stored, N_block_active, D, C, F, S, r, E, k, loss); --format=epoch reads Epoch AI's digitisation of Chinchilla's Figure 4
(D = C / 6N; the five highest-loss points dropped). --n_column picks the column used as the
law's N for chinchilla/clark (e.g. N_active_pass). --fix holds named parameters (e.g.
--fix=beta=0.3,B=0); every form fitted must have them (--help lists each form's).

Before any fitting: a form that needs more points than the grid (with its holdouts) has, a
holdout that selects no point, a missing column, a malformed --fix or --holdout and an
unwritable --plot or --json path are errors; a fitted parameter the points leave unidentified
(a constant axis, a combination the grid cannot separate) is a `WARNING:` line.

    python scripts/fit_laws.py --data=LOOPED.csv --forms=smelt --smelt_baseline=BASE.csv \
        --budget=1e20          # SMELT's frontier exponent, optimum and compute efficiency
"""
import json

from absl import flags

from loopmoe_jax.cli import check_output_file, run
from loopmoe_jax.replicate.common import json_default
from loopmoe_jax.scaling.forms import FORMS


def _parameters_help() -> str:
  """Each form's parameters (the names --fix takes)."""
  return '; '.join(f'{name}: {" ".join(form.param_names())}' for name, form in FORMS.items())


_DATA = flags.DEFINE_string('data', None, 'CSV of points.', required=True)
_FORMAT = flags.DEFINE_enum('format', 'sweep', ['sweep', 'epoch'], 'CSV layout.')
_FORMS = flags.DEFINE_list('forms', ['chinchilla'], f'Law forms to fit: {", ".join(FORMS)}.')
_N = flags.DEFINE_string('n_column', None, 'Column used as the N of chinchilla/clark '
                         '(default: N, else N_stored); the loop and moe laws read '
                         'N_active_pass and N_block_active.')
_HOLDOUT = flags.DEFINE_list('holdout', [], 'AXIS=VALUE held out, e.g. r=4,E=16.')
_BOOT = flags.DEFINE_integer('bootstrap', 0, 'Bootstrap resamples (0: none).')
_BUDGET = flags.DEFINE_float('budget', 0.0, 'Compute budget (FLOPs) for compute-optimal N, D.')
_FIX = flags.DEFINE_list('fix', [], 'NAME=VALUE parameters held fixed (inf allowed: '
                         'E_max=inf); every form fitted must have them. Parameters by form: '
                         + _parameters_help() + '.')
_TOP = flags.DEFINE_integer('top', 16, 'L-BFGS runs from the best grid starts.')
_PLOT = flags.DEFINE_string('plot', None, 'PNG path for the fits.')
_X = flags.DEFINE_string('x', None, 'Plot x axis (default N, or r for loop forms).')
_JSON = flags.DEFINE_string('json', None, 'Write fitted params and the table here.')
_SMELT_BASE = flags.DEFINE_string(
    'smelt_baseline', None, 'With --forms=smelt and --budget: the baseline grid\'s CSV; prints '
    'SMELT\'s analyses (frontier exponent, optimum, tokens/param, compute efficiency).')
_RESAMPLES = flags.DEFINE_integer('cell_resamples', 2000, 'Cell-bootstrap resamples (SMELT).')


def pairs(flag: str, specs) -> list[tuple[str, float]]:
  """['NAME=VALUE', ...] as (name, float) pairs; a ValueError naming the flag otherwise."""
  out = []
  for spec in specs:
    name, eq, value = spec.partition('=')
    try:
      if not (eq and name.strip()):
        raise ValueError
      out.append((name.strip(), float(value)))
    except ValueError:
      raise ValueError(f'--{flag}={spec}: expected NAME=VALUE with a number (e.g. '
                       f'--{flag}={"beta=0.3" if flag == "fix" else "r=4"})') from None
  return out


def load(scaling, path: str, forms, holdouts) -> dict:
  """The points of --data as columns; a ValueError naming the file, the missing column and
  the columns present when a form, the loss or a holdout needs one it lacks."""
  raw = scaling.read_csv(path)
  needed = {'loss': 'the fit'}
  if _FORMAT.value == 'epoch':
    needed.update({'Model Size': '--format=epoch', 'Training FLOP': '--format=epoch'})
  _require(path, raw, needed)
  if _FORMAT.value == 'epoch':
    data = scaling.chinchilla_epoch(path)
  else:
    data = scaling.as_columns(raw)
    column = _N.value or ('N' if 'N' in data else 'N_stored')
    if column in data:
      data['N'] = data[column]
    elif _N.value:
      raise ValueError(f'--n_column={column}: no such column in {path} (columns: '
                       f'{", ".join(raw)})')
  needed = {}
  for name in forms:
    needed.update({c: f'law {name!r}' for c in scaling.get_form(name).columns})
  needed.update({axis: f'--holdout={axis}={value:g}' for axis, value in holdouts})
  _require(path, data, needed, present=list(raw))
  return data


def _require(path: str, cols, needed: dict, present=None):
  missing = [c for c in needed if c not in cols]
  if missing:
    c = missing[0]
    raise ValueError(f'{path} has no column {c!r} (needed by {needed[c]}); its columns: '
                     f'{", ".join(present or cols)}')


def main(argv):
  del argv
  import numpy as np
  from loopmoe_jax import scaling
  from loopmoe_jax.scaling import fitting
  fixed = dict(pairs('fix', _FIX.value))
  holdouts = pairs('holdout', _HOLDOUT.value)
  for name in _FORMS.value:
    fitting.check_fixed(name, fixed)
  check_output_file('--plot', _PLOT.value)  # before the fitting: nothing is lost
  check_output_file('--json', _JSON.value)
  data = load(scaling, _DATA.value, _FORMS.value, holdouts)
  kw = dict(top=_TOP.value, fixed=fixed or None)
  fitting.check_design(_FORMS.value, data, holdouts, fixed)
  fits = {name: scaling.fit(name, data, **kw) for name in _FORMS.value}
  rows = scaling.compare(_FORMS.value, data, holdouts, fits=fits, check=False, **kw)
  print(f'{len(data["loss"])} points; forms ranked by held-out RMSE' if holdouts else
        f'{len(data["loss"])} points')
  print(scaling.format_table(rows))
  out = {'table': rows, 'fits': {}}
  for name, f in fits.items():
    out['fits'][name] = _report_fit(scaling, name, f, data, kw)
  if _SMELT_BASE.value:
    out['smelt_analysis'] = _smelt_analysis(scaling, data)
  if _PLOT.value:
    loop = any(n.startswith('loop_') for n in fits)
    x = _X.value or ('r' if loop and len(np.unique(data.get('r', [1]))) > 1 else 'N')
    group = _series(scaling, data, x, fits)
    scaling.plots.plot_fits(data, fits, _PLOT.value, x=x, group=group,
                            title=f'{", ".join(fits)} on {len(data["loss"])} points')
    print(f'plot: {_PLOT.value}')
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(out, f, indent=1, default=json_default)  # bootstrap samples as lists


def _series(scaling, data: dict, x: str, forms) -> str | None:
  """Numbers the points' combinations of the laws' other columns (a column `series`), so
  that the plot draws one curve against `x` per combination; None when there is one."""
  import numpy as np
  others = sorted({c for name in forms for c in scaling.get_form(name).columns} - {x})
  keys = np.stack([data[c] for c in others if c in data], axis=1) if others else None
  if keys is None or len(np.unique(keys, axis=0)) < 2:
    return None
  data['series'] = np.unique(keys, axis=0, return_inverse=True)[1].astype(float).ravel()
  return 'series'


def _report_fit(scaling, name: str, f, data, kw) -> dict:
  """The fit's entry of --json; prints its bootstrap errors and compute-optimal point."""
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
  return entry


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
