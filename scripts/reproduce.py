"""One-command mini-replications of the three papers (resumable; finished points skipped).

    python scripts/reproduce.py loop_laws --out /tmp/repro_ll [--scale cpu]
    python scripts/reproduce.py smelt --out /tmp/repro_smelt
    python scripts/reproduce.py foil --out /tmp/repro_foil

Each writes OUT/report.md (our figures beside the paper's), OUT/results.json and its runs.
"""
from absl import app, flags

from loopmoe_jax.cli import run

_OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
_SCALE = flags.DEFINE_enum('scale', 'cpu', ['cpu', 'gpu'], 'Sizes: cpu (two cores, < 30 min) '
                           'or gpu (about an hour on one H200).')


def main(argv):
  from loopmoe_jax import replicate
  if len(argv) != 2:
    raise app.UsageError(f'usage: reproduce.py NAME --out DIR; NAME one of '
                         f'{sorted(replicate.PIPELINES)}')
  replicate.run(argv[1], _OUT.value, _SCALE.value)


if __name__ == '__main__':
  run(main)
