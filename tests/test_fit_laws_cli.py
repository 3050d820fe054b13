"""The README's sweep-to-law chain and scripts/fit_laws.py's refusals.

The recipe (configs/loop_laws.py, `laws`) must identify the forms the README fits it with: as
many points as each form's free parameters plus the held-out ones, and no parameter the grid
leaves undetermined. fit_laws.py's bad inputs are one `error:` line, found before any fitting.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from loopmoe_jax.scaling import fitting, identify, sweep
from loopmoe_jax.scaling.forms import FORMS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands() -> tuple[list[str], list[str]]:
  """The README's recipe: (sweep.py's arguments, fit_laws.py's on its CSV)."""
  lines = open(os.path.join(ROOT, 'README.md')).read().splitlines()
  sweeps = [shlex.split(l, comments=True)[2:] for l in lines
            if l.startswith('python scripts/sweep.py') and ',laws' in l]
  assert len(sweeps) == 1, sweeps
  root = next(a.split('=', 1)[1] for a in sweeps[0] if a.startswith('--root='))
  fits = [shlex.split(l, comments=True)[2:] for l in lines
          if l.startswith(f'python scripts/fit_laws.py --data={root}/sweep.csv')]
  assert len(fits) == 1, (root, fits)
  return sweeps[0], fits[0]


def _flag(args, name) -> str:
  return next(a.split('=', 1)[1] for a in args if a.startswith(f'--{name}='))


def _recipe_columns(config_arg: str) -> dict[str, np.ndarray]:
  """The law columns of every point of the recipe's grid (the loss a placeholder)."""
  spec = importlib.util.spec_from_file_location('loop_laws_cfg',
                                                os.path.join(ROOT, 'configs', 'loop_laws.py'))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config(config_arg)
  rows = []
  for point in sweep.grid(mod.get_sweep(config_arg)):
    c = sweep.apply_point(cfg, point)
    rows.append(sweep.point_row(c, {'steps': c.train.steps, 'final_window_loss': 3.0}))
  return {k: np.array([r[k] for r in rows], dtype=float) for k in rows[0]}


def test_the_readme_recipe_identifies_the_forms_it_fits():
  sweep_args, fit_args = _readme_commands()
  config_arg = _flag(sweep_args, 'config').split(':', 1)[1]
  forms = _flag(fit_args, 'forms').split(',')
  fixed = {k: float(v) for k, v in (s.split('=') for s in _flag(fit_args, 'fix').split(','))}
  holdouts = [(a, float(v)) for a, v in (s.split('=') for s in _flag(fit_args, 'holdout')
                                         .split(','))]
  cols = _recipe_columns(config_arg)
  n = len(cols['loss'])
  for axis in ('N_active_pass', 'D', 'r', 'E'):  # sizes, tokens, passes and experts vary
    assert len(np.unique(cols[axis])) >= 2, axis
  for name in forms:
    p = fitting.free_parameters(name, fixed)
    for axis, value in holdouts:
      held = int(np.isclose(cols[axis], value).sum())
      assert 0 < held < n
      assert n >= p + 1 + held, (name, n, p, held)
  fitting.check_identified(forms, cols, holdouts, fixed)
  assert identify.design_warnings(forms, cols, holdouts, fixed) == []
  # the same grid does not identify the saturation and interaction terms the README holds
  assert any('E_start' in w for w in identify.design_warnings(forms, cols, holdouts, {}))
  # nor the bounded mapping's two constants without a second looped count left to fit
  two = {k: v[cols['r'] != 3] for k, v in cols.items()}
  warned = identify.design_warnings(forms, two, holdouts, fixed)
  assert [w.split(':')[0] for w in warned] == ['loop_bounded'], warned
  assert 'gamma/beta_r' in warned[0] and 'holding out r=4' in warned[0]


def _script(*args, timeout=120):
  """(exit status, stdout, stderr) of scripts/fit_laws.py ARGS."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'fit_laws.py'), *args],
                     capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                     env=dict(os.environ, JAX_PLATFORMS='cpu'))
  return r.returncode, r.stdout, r.stderr


def _csv(path, header, rows):
  path.write_text(header + '\n' + '\n'.join(','.join(str(v) for v in r) for r in rows) + '\n')
  return str(path)


@pytest.fixture
def points(tmp_path):
  """Three points at one N and D, and a CSV whose loss column is misnamed."""
  return {'flat': _csv(tmp_path / 'flat.csv', 'N,D,r,loss',
                       [(1e8, 2e9, 1, 3.0), (1e8, 2e9, 2, 3.1), (1e8, 2e9, 2, 2.9)]),
          'noloss': _csv(tmp_path / 'noloss.csv', 'N,D,los', [(1e8, 2e9, 3.0)]),
          'dir': str(tmp_path), 'nodir': str(tmp_path / 'nodir')}


CASES = {
    'unknown fixed name': (['--forms=chinchilla', '--fix=bta=0.3'],
                           "error: cannot fix ['bta'] of law 'chinchilla' (did you mean beta?); "
                           'its parameters: A, B, E, alpha, beta'),
    'holdout of no point': (['--fix=alpha=0.3,beta=0.3,B=0', '--holdout=r=4'],
                            'error: holdout r=4 selects no point: r takes 1, 2'),
    'missing column': (['--data={noloss}'],
                       "error: {noloss} has no column 'loss' (needed by the fit); its columns: "
                       'N, D, los'),
    'fix without a value': (['--fix=alpha'], 'error: --fix=alpha: expected NAME=VALUE with a '
                            'number (e.g. --fix=beta=0.3)'),
    'holdout not a number': (['--holdout=r=four'], 'error: --holdout=r=four: expected '
                             'NAME=VALUE with a number (e.g. --holdout=r=4)'),
    'json a directory': (['--fix=alpha=0.3,beta=0.3,B=0', '--json={dir}'],
                         'error: --json={dir} is a directory: expected a file name'),
    'plot in no directory': (['--fix=alpha=0.3,beta=0.3,B=0', '--plot={nodir}/fit.png'],
                             'error: --plot={nodir}/fit.png: its directory {nodir} does not '
                             'exist'),
    'too few points': ([], 'error: cannot rank the forms: the full grid leaves 3 points to fit '
                       "'chinchilla', which has 5 free parameters (need at least 6 points to "
                       'fit); add points or fix terms (fixable: A, B, E, alpha, beta)'),
}


@pytest.mark.parametrize('case', list(CASES))
def test_bad_inputs_are_one_line_before_any_fitting(points, case):
  args, expected = CASES[case]
  args = [a.format(**points) for a in args]
  if not any(a.startswith('--data=') for a in args):
    args.insert(0, f'--data={points["flat"]}')
  rc, out, err = _script(*args)
  assert rc == 1, (out, err)
  assert err.strip().splitlines()[-1] == expected.format(**points)
  assert 'Traceback' not in err and 'points' not in out  # no table: nothing was fitted


def test_a_constant_axis_is_a_warning_and_help_lists_each_forms_parameters(points, tmp_path):
  out_json = tmp_path / 'fit.json'
  rc, out, err = _script(f'--data={points["flat"]}', '--forms=chinchilla',
                         '--fix=alpha=0.3,beta=0.3,B=0', f'--json={out_json}')
  assert rc == 0, err
  warnings = [l for l in err.splitlines() if l.startswith('WARNING: chinchilla')]
  assert warnings == ['WARNING: chinchilla: column N (1e+08) is constant over the 3 points '
                      'fitted, so A is not identified: vary N or fix it'], err
  assert out_json.exists() and '3 points' in out
  rc, out, err = _script('--help')
  text = ' '.join((out + err).split())
  for name in ('chinchilla', 'loop_bounded', 'smelt'):
    assert f'{name}: {" ".join(FORMS[name].param_names())}' in text, name
