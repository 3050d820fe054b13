"""Runs a grid of training runs from a config, one workdir per point, and collects a CSV.

    python scripts/sweep.py --config=configs/loop_laws.py:smoke --root=/tmp/ll_sweep \
        --sweep model.num_loops=1,2,4,8 --sweep model.num_experts=8,16 \
        --config.train.steps=80
    python scripts/fit_laws.py --data=/tmp/ll_sweep/sweep.csv --forms=loop_linear,loop_bounded

Without --sweep the config file's own `get_sweep(arg)` grid is used. `model.num_experts` sets
every MoE segment's expert count; any other key is a config field (`model.FIELD`,
`train.FIELD`, ...); a key that names none is refused before any work, with the near names.
Every point shares the data order and seeds, and one compile cache (ROOT/compile_cache unless
train.compile_cache names one: points of one program compile once). Finished points are
skipped and interrupted ones resume, so re-running the command completes a sweep. The CSV (ROOT/sweep.csv) holds N_stored,
N_active_pass, N_active_executed, N_block_stored, N_block_active, D, C, F, S, r, E, k, loss,
loss_steps and steps: `loss` is each point's final_window_loss (its summary.json), the mean
LM loss of its last `loss_steps` steps -- train.final_window, or, for a run too short for it
after train.warmup, the steps after the warmup (the trainer prints a note saying so).

Exit status: 0 when every point finished; 130 (SIGINT, Ctrl-C) or 143 (SIGTERM) when a
signal stopped a point (it saved; re-running resumes it): the CSV then holds the points that
had finished, or is not written when none had (the last line says which); 1 for an error.
"""
from absl import flags
from ml_collections import config_flags

from loopmoe_jax.cli import (check_output_dir, config_flag, distributed_flags,
                             initialize_distributed, run)

_CONFIG = config_flag()
_DISTRIBUTED = distributed_flags()
_SWEEP = flags.DEFINE_multi_string('sweep', [], 'SECTION.FIELD=v1,v2,... (repeatable).')
_ROOT = flags.DEFINE_string('root', None, 'Directory holding one workdir per point.',
                            required=True)


def main(argv):
  del argv
  check_output_dir('--root', _ROOT.value)  # before any work
  initialize_distributed(_DISTRIBUTED)
  from loopmoe_jax.scaling import sweep
  from loopmoe_jax.train import preempt
  if _SWEEP.value:
    grid = sweep.parse_sweeps(_SWEEP.value)
  else:
    path, _, arg = config_flags.get_config_filename(flags.FLAGS['config']).partition(':')
    grid = sweep.config_sweep(path, arg or None)
    if not grid:
      raise SystemExit(f'{path} has no get_sweep(); pass --sweep SECTION.FIELD=v1,v2')
  print(f'sweep over {grid}')
  try:
    rows = sweep.run_sweep(_CONFIG.value, grid, _ROOT.value)
  except preempt.Stopped as stop:  # it said what it wrote
    _print_rows(stop.rows)
    return stop.code
  _print_rows(rows)
  print(f'csv: {_ROOT.value}/sweep.csv')
  return 0


def _print_rows(rows):
  if not rows:
    return
  keys = ['point', 'N_stored', 'N_active_pass', 'D', 'C', 'r', 'E', 'loss']
  print('  '.join(f'{k:>14}' for k in keys))
  for r in rows:
    print('  '.join(f'{r[k]:>14.5g}' if isinstance(r[k], float) else f'{r[k]!s:>14}'
                    for k in keys))


if __name__ == '__main__':
  run(main)
