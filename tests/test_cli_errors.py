"""The scripts' bad-input errors: one line naming the flag and the path or field, exit status 1
(2 for a usage error), found before any work and with nothing written."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loopmoe_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(name, *args, timeout=120):
  """(exit status, last stderr line, stdout and stderr) of scripts/NAME.py ARGS."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', f'{name}.py'), *args],
                     capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
  lines = r.stderr.strip().splitlines()
  return r.returncode, lines[-1] if lines else '', r.stdout + r.stderr


def test_output_checks_name_the_flag_and_path(tmp_path):
  afile, nodir = tmp_path / 'afile', tmp_path / 'nodir'
  afile.write_text('x')
  with pytest.raises(ValueError, match=f'^--out={afile} is a file: expected a directory'):
    cli.check_output_dir('--out', str(afile))
  with pytest.raises(ValueError, match=f'^--out={afile}/sub: {afile} is a file'):
    cli.check_output_dir('--out', str(afile / 'sub'))
  cli.check_output_dir('--out', str(nodir / 'deeper'))  # made later: fine
  with pytest.raises(ValueError, match=f'^--json={nodir}/m.json: its directory {nodir} does '
                     'not exist$'):
    cli.check_output_file('--json', str(nodir / 'm.json'))
  with pytest.raises(ValueError, match=f'^--json={tmp_path} is a directory'):
    cli.check_output_file('--json', str(tmp_path))
  cli.check_output_file('--json', str(tmp_path / 'm.json'))
  cli.check_output_file('--json', 'gs://bucket/m.json')  # a URL: the storage layer's
  assert not nodir.exists()


def _cases(tmp_path):
  afile, nodir, text = tmp_path / 'afile', tmp_path / 'nodir', tmp_path / 'in.txt'
  afile.write_text('x')
  text.write_text('some text')
  nowork = f'--workdir={tmp_path / "no_run"}'  # the check comes before the run is read
  return {
      ('prepare_data', f'--inputs={text}', f'--output={afile}', '--workers=0'):
          f'error: --output={afile} is a file: expected a directory (made when missing)',
      ('prepare_data', f'--inputs={text}', f'--output={nodir}/x.bin', '--workers=0'):
          f'error: --output={nodir}/x.bin: its directory {nodir} does not exist',
      ('prepare_data', f'--inputs={text}', f'--output={tmp_path}/o', '--train_bpe=300',
       f'--tokenizer={nodir}/bpe.json', '--workers=0'):
          f'error: --tokenizer={nodir}/bpe.json: its directory {nodir} does not exist',
      ('diagnose', nowork, f'--out={afile}'):
          f'error: --out={afile} is a file: expected a directory (made when missing)',
      ('evaluate', nowork, '--exit=kl', '--thresholds=0.1', f'--out={nodir}/exit.png'):
          f'error: --out={nodir}/exit.png: its directory {nodir} does not exist',
      ('match_budgets', '--baseline=configs/smelt.py:smoke,baseline', f'--json={nodir}/m.json'):
          f'error: --json={nodir}/m.json: its directory {nodir} does not exist',
      ('generate', nowork, '--temperature=-1'):
          'error: --temperature=-1.0: must be a finite number >= 0 (0: greedy)',
      ('generate', nowork, '--tokens=0'): 'error: --tokens=0: must be >= 1',
  }


def test_bad_outputs_and_sampling_flags_are_refused_before_any_work(tmp_path):
  for (name, *args), want in _cases(tmp_path).items():
    status, last, out = script(name, *args)
    assert (status, last) == (1, want), (name, args, last)
    assert 'prepare:' not in out and 'ratios' not in out and 'probe set' not in out  # no work
  assert sorted(os.listdir(tmp_path)) == ['afile', 'in.txt']  # nothing written
