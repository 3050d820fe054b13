"""Validation loss of a checkpoint; --num_loops changes the passes (test-time recurrence).

    python scripts/evaluate.py --workdir=/tmp/run [--num_loops=6] [--step=400]
        [--scale_passes=executed]   # SMELT's 1/r by the executed passes
"""
import json

from absl import flags

from loopmoe_jax.cli import run

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_LOOPS = flags.DEFINE_list('num_loops', [], 'Pass counts to evaluate (default: trained).')
_SCALE = flags.DEFINE_enum('scale_passes', None, ['trained', 'executed'],
                           'r of the 1/r residual scale at another pass count (default: the '
                           "model's model.scale_passes, 'trained' unless set).")


def main(argv):
  del argv
  from loopmoe_jax.train.evaluation import evaluate_checkpoint
  try:
    loops = [int(n) for n in _LOOPS.value] or [None]
  except ValueError:
    raise ValueError(f'--num_loops={",".join(_LOOPS.value)}: pass counts must be integers') from None
  print(json.dumps(evaluate_checkpoint(_WORKDIR.value, loops, _STEP.value, _SCALE.value), indent=1))


if __name__ == '__main__':
  run(main)
