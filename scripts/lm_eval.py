"""The LM Evaluation Harness (lm-eval) on a checkpoint, at each pass count.

    pip install lm-eval==0.4.13      # or: pip install -e '.[lm_eval]'
    python scripts/lm_eval.py --workdir=/tmp/loopmoe_default --tasks=loopmoe_next_line \
        --num_loops=1,2,3,4 [--limit=100] [--batch_size=16] --out=/tmp/lm_eval

Writes OUT/results.json ({passes: the harness's results}), OUT/run.json (the workdir, step,
limit, the chance level of each multiple-choice task and the wall seconds per pass count) and
OUT/table.md (task x passes).
Tasks: the harness's own (they download their data) and the offline pack loopmoe_jax/lm_tasks/
(loopmoe_next_line: the true next line of a held-out source among 4). The adapter, its lengths
and batching: loopmoe_jax/analysis/lm_harness.py.
"""
import json
import os
import sys

# This file's name is the harness package's: with scripts/ first on sys.path (how Python runs a
# script), `import lm_eval` would import this file. The package comes from site-packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from absl import flags  # pylint: disable=wrong-import-position

from loopmoe_jax.cli import (distributed_flags, initialize_distributed, main_process,  # pylint: disable=wrong-import-position
                             pass_counts, run)

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_TASKS = flags.DEFINE_list('tasks', [], 'Harness task names (e.g. loopmoe_next_line).')
_LOOPS = flags.DEFINE_list('num_loops', [], 'Pass counts to evaluate (default: trained).')
_LIMIT = flags.DEFINE_integer('limit', None, 'Documents per task (default: all).')
_BATCH = flags.DEFINE_integer('batch_size', 16, 'Rows per batch.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
_MESH = flags.DEFINE_string('mesh', '', "Score on a mesh of this process's devices, e.g. "
                            "'data=2,expert=4' (the mesh config's axes; default: one device).")
_DISTRIBUTED = distributed_flags()


def main(argv):
  del argv
  # started on every host of a multi-process run, each process scores on its own devices
  # (the results are the same on each); process 0 alone writes and prints
  initialize_distributed(_DISTRIBUTED)
  loops = pass_counts(_LOOPS.value)
  if _LIMIT.value is not None and _LIMIT.value < 1:
    raise ValueError(f'--limit={_LIMIT.value}: must be >= 1')
  from loopmoe_jax.analysis import lm_harness
  from loopmoe_jax.sharding import MeshConfig, make_mesh
  mesh = None
  if _MESH.value:
    try:
      axes = {k: int(v) for k, v in (a.split('=') for a in _MESH.value.split(','))}
    except ValueError:
      raise ValueError(f'--mesh={_MESH.value!r}: expected axis=size pairs, e.g. '
                       'data=2,expert=4') from None
    import jax  # pylint: disable=import-outside-toplevel
    mesh = make_mesh(MeshConfig.from_dict(axes), jax.local_devices())
  out = lm_harness.evaluate(_WORKDIR.value, _TASKS.value, loops, _LIMIT.value, _BATCH.value,
                            _STEP.value, mesh=mesh)
  if not main_process():
    return
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, 'results.json'), 'w') as f:
    json.dump(out['passes'], f, indent=1)  # {passes: the harness's results}
  with open(os.path.join(_OUT.value, 'run.json'), 'w') as f:
    json.dump({k: v for k, v in out.items() if k != 'passes'}, f, indent=1)
  text = lm_harness.table(out)
  with open(os.path.join(_OUT.value, 'table.md'), 'w') as f:
    f.write(text)
  print(text, end='')


if __name__ == '__main__':
  run(main)
