"""The scripts' bad-input errors: one line naming the flag and the path or field, exit status 1
(2 for a usage error), found before any work and with nothing written."""
from __future__ import annotations

import os
import re
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
      ('generate', nowork, '--attention_impl=flash'):
          'error: --attention_impl=flash: must be one of auto, xla, chunked, cudnn, splash',
  }


def test_bad_outputs_and_sampling_flags_are_refused_before_any_work(tmp_path):
  for (name, *args), want in _cases(tmp_path).items():
    status, last, out = script(name, *args)
    assert (status, last) == (1, want), (name, args, last)
    assert 'prepare:' not in out and 'ratios' not in out and 'probe set' not in out  # no work
  assert sorted(os.listdir(tmp_path)) == ['afile', 'in.txt']  # nothing written


def test_help_lists_the_shared_flags_and_keeps_line_continuations():
  for name in ('train', 'sweep'):
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', f'{name}.py'), '--help'],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert '\nflags:\n' in r.stdout, r.stderr[-2000:]  # (absl's --help exits with status 1)
    flags_part = r.stdout.split('\nflags:\n', 1)[1]
    assert '  --config: Config file[:arg].' in flags_part and '  --[no]debug: ' in flags_part
    usage = r.stdout.split('\nflags:\n', 1)[0]
    assert ' \\\n        --' in usage, usage  # a continued command on its own lines
    assert not any(re.search(r'\S {4,}--', line) for line in usage.splitlines()), usage


def test_the_docstring_is_read_as_written(tmp_path):
  from loopmoe_jax.cli_usage import docstring_as_written
  path = tmp_path / 'tool.py'
  path.write_text('"""Tool.\n\n    tool --a=1 \\\n        --b=2   # a \\\\ stays\n"""\nx = 1\n')
  assert docstring_as_written(str(path)) == 'Tool.\n\n    tool --a=1 \\\n        --b=2   # a \\ stays\n'
  path.write_text('x = 1\n')
  assert docstring_as_written(str(path)) is None


def test_unknown_flags_name_the_near_flags_and_config_fields():
  from absl import flags
  from ml_collections import config_flags
  from loopmoe_jax.cli_usage import unknown_flag_line
  values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'Config.', flag_values=values)
  flags.DEFINE_string('workdir', None, 'Run directory.', flag_values=values)
  assert unknown_flag_line('steps', values) == ('unknown flag --steps; did you mean '
                                                '--config.train.steps?')
  assert unknown_flag_line('seed', values) == ('unknown flag --seed; did you mean '
                                               '--config.train.seed or --config.data.seed?')
  assert unknown_flag_line('workdr', values) == 'unknown flag --workdr; did you mean --workdir?'
  assert unknown_flag_line('model.d_modle', values).endswith('--config.model.d_model?')
  plain = flags.FlagValues()
  flags.DEFINE_string('workdir', None, 'Run directory.', flag_values=plain)
  assert unknown_flag_line('steps', plain) == 'unknown flag --steps (see --helpshort)'
  status, last, _ = script('train', '--steps=20', '--workdir=/nonexistent/never')
  assert (status, last) == (2, 'error: unknown flag --steps; did you mean --config.train.steps?')
