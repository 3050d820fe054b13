"""Routing diagnostics of a checkpoint over held-out tokens: distinct experts U, load shares,
N2/B2, MaxVio, MMR (per core layer, per pass, overall), traffic-matched expert masking, and
PNG heatmaps of load and MMR by layer and pass; SMELT's probes (Q/K/V cosine between visits,
sink mass) over up to --probes tokens of the probe set; with --evals, Dyck-k by shots and
parity / addition / induction; with --recurrence=R, loss and task accuracy at passes 1..R
(recurrence.png).

    python scripts/diagnose.py --workdir=/tmp/run --out=/tmp/diag [--scale=cpu|gpu]
        [--tokens=N] [--step=400] [--probes=8192] [--evals=64] [--recurrence=6]

The probe set is the first N tokens of the run's validation split: by default 16,384 at
--scale=cpu, Foil's 255,500 at --scale=gpu (Foil Sec. 2.3; the split must hold them);
--tokens overrides the count. diagnostics.json's 'probe_set' and the first printed line
name the count, the split and how it was chosen.
"""
import tempfile

from absl import flags

from loopmoe_jax.cli import (check_output_dir, distributed_flags, initialize_distributed,
                             main_process, run)

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Output directory (diagnostics.json, PNGs).',
                           required=True)
_SCALE = flags.DEFINE_enum('scale', 'cpu', ['cpu', 'gpu'], 'The default probe set: cpu 16,384 '
                           "held-out tokens, gpu Foil's 255,500 (as scripts/reproduce.py).")
_TOKENS = flags.DEFINE_integer('tokens', None, 'Probe-set size in held-out tokens, exactly '
                               '(default: the --scale\'s).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_MASK_TOP = flags.DEFINE_integer('mask_top', 1, 'Mask the N most-loaded experts of each core '
                                 'layer (0: no masking test).')
_MASK_DRAWS = flags.DEFINE_integer('mask_draws', 4, 'Traffic-matched random sets per layer.')
_PROBES = flags.DEFINE_integer('probes', 8192, 'Q/K/V-cosine and sink-mass probes over up to '
                               'this many validation tokens (0: skip).')
_EVALS = flags.DEFINE_integer('evals', 0, 'Reasoning evals (Dyck-k by shots, parity, addition, '
                              'induction) on this many examples each (0: skip).')
_RECURRENCE = flags.DEFINE_integer('recurrence', 0, 'Test-time recurrence: loss and task '
                                   'accuracy at passes 1..R (0: skip).')


_DISTRIBUTED = distributed_flags()


def main(argv):
  del argv
  # started on every host of a multi-process run, each process analyses the checkpoint on its
  # own devices (the same figures); process 0 alone writes --out and prints, the others write
  # into a temporary directory removed at the end
  check_output_dir('--out', _OUT.value)  # before any work (every process: the same answer)
  initialize_distributed(_DISTRIBUTED)
  from loopmoe_jax.analysis.diagnose import diagnose, summary_lines
  with tempfile.TemporaryDirectory() as scratch:
    out = _OUT.value if main_process() else scratch
    report = diagnose(_WORKDIR.value, out, _TOKENS.value, _STEP.value, _MASK_TOP.value,
                      _MASK_DRAWS.value, probes=_PROBES.value, evals=_EVALS.value,
                      recurrence=_RECURRENCE.value, scale=_SCALE.value,
                      log=print if main_process() else lambda *a, **k: None)
  if not main_process():
    return
  print('\n'.join(summary_lines(report)))
  print(f'wrote {_OUT.value}/diagnostics.json and {", ".join(report["figures"]) or "no figures"}')


if __name__ == '__main__':
  run(main)
