"""Routing diagnostics of a checkpoint over held-out tokens: distinct experts U, load shares,
N2/B2, MaxVio, MMR (per core layer, per pass, overall), traffic-matched expert masking, and
PNG heatmaps of load and MMR by layer and pass.

    python scripts/diagnose.py --workdir=/tmp/run --out=/tmp/diag [--tokens=16384] [--step=400]
"""
from absl import flags

from loopmoe_jax.cli import run

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Output directory (diagnostics.json, PNGs).',
                           required=True)
_TOKENS = flags.DEFINE_integer('tokens', 16384, 'Probe-set size in held-out tokens (whole '
                               'validation windows, rounded up).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_MASK_TOP = flags.DEFINE_integer('mask_top', 1, 'Mask the N most-loaded experts of each core '
                                 'layer (0: no masking test).')
_MASK_DRAWS = flags.DEFINE_integer('mask_draws', 4, 'Traffic-matched random sets per layer.')


def main(argv):
  del argv
  from loopmoe_jax.analysis.diagnose import diagnose, summary_lines
  report = diagnose(_WORKDIR.value, _OUT.value, _TOKENS.value, _STEP.value, _MASK_TOP.value,
                    _MASK_DRAWS.value)
  print('\n'.join(summary_lines(report)))
  print(f'wrote {_OUT.value}/diagnostics.json and {", ".join(report["figures"]) or "no figures"}')


if __name__ == '__main__':
  run(main)
