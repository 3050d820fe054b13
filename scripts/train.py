"""Trains a looped MoE.

    python scripts/train.py --workdir=/tmp/run                          # configs/default.py
    python scripts/train.py --config=configs/foil.py:foil2,smoke --config.train.steps=200 \
        --workdir=/tmp/foil2
"""
from absl import app, flags

from loopmoe_jax.cli import config_flag, run

_CONFIG = config_flag()
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, metrics).',
                               required=True)


def main(argv):
  del argv
  from loopmoe_jax.train.trainer import train
  train(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  run(main)
