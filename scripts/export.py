"""Export a checkpoint (safetensors; Hugging Face Mixtral with the loop unrolled; or
hf-looped, a transformers model that keeps the loop, loaded with trust_remote_code and run at
any pass count), or import a Hugging Face directory.

    python scripts/export.py --workdir=/tmp/run [--step=400] --format=hf-mixtral --out=/tmp/hf \
        [--verify]   # load it in transformers: max logit error and greedy tokens against ours
    python scripts/export.py --workdir=/tmp/run --format=safetensors --out=/tmp/st
    python scripts/export.py --workdir=/tmp/run --format=hf-looped --out=/tmp/looped [--verify]
        # --verify: logits in transformers at 1, the trained and twice the trained passes
        # (with model.exit also with the per-token exit), greedy tokens at the trained count
    python scripts/export.py --import=hf-looped --src=/tmp/looped --out=/tmp/run2
        # back into a run directory (params and router bias bit-identical; no optimizer
        # state): evaluate.py / generate.py / lm_eval.py --workdir=/tmp/run2
    python scripts/export.py --import=hf-mixtral --src=/tmp/hf --out=/tmp/ours
        [--loop_span=START:STOP:LOOPS]   # layers [START, STOP) as a shared core looped LOOPS
                                         # times, each shared layer the average of its layers
"""
import json
import sys

from absl import flags

from loopmoe_jax.cli import distributed_flags, initialize_distributed, main_process, run

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory to export from.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_FORMAT = flags.DEFINE_enum('format', None, ['safetensors', 'hf-mixtral', 'hf-looped'],
                            'Export format.')
_OUT = flags.DEFINE_string('out', None, 'Output directory (must not exist or be empty).',
                           required=True)
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace a non-empty --out.')
_IMPORT = flags.DEFINE_enum('import', None, ['hf-mixtral', 'hf-looped'],
                            'Import instead of export.')
_SRC = flags.DEFINE_string('src', None, 'Directory to import (with --import).')
_SPAN = flags.DEFINE_string('loop_span', None, 'START:STOP:LOOPS for --import.')
_DISTRIBUTED = distributed_flags()
_VERIFY = flags.DEFINE_bool('verify', False, 'After exporting, compare the export with our model '
                            'on validation tokens (logits, greedy tokens); hf-mixtral and '
                            'hf-looped load it in transformers (needs torch).')


def main(argv):
  del argv
  initialize_distributed(_DISTRIBUTED)
  from loopmoe_jax.export import files
  given = {'--workdir': _WORKDIR.value, '--format': _FORMAT.value, '--step': _STEP.value,
           '--verify': _VERIFY.value or None, '--src': _SRC.value, '--loop_span': _SPAN.value}
  spans = ('--loop_span',) if _IMPORT.value == 'hf-mixtral' else ()
  mode, needs, takes = (('--import', ('--src',), ('--src',) + spans) if _IMPORT.value else
                        ('export', ('--workdir', '--format'),
                         ('--workdir', '--format', '--step', '--verify')))
  missing = [f for f in needs if given[f] is None]
  ignored = [f for f, v in given.items() if v is not None and f not in takes]
  if missing or ignored:
    raise ValueError(f'{mode} ' + '; '.join(
        ([f'needs {", ".join(missing)}'] if missing else []) +
        ([f'does not take {", ".join(ignored)}'] if ignored else [])))
  if _IMPORT.value == 'hf-looped':
    print(json.dumps(files.import_looped(_SRC.value, _OUT.value, _OVERWRITE.value), indent=1))
    return
  if _IMPORT.value:
    span = None
    if _SPAN.value:
      parts = _SPAN.value.split(':')
      if len(parts) != 3 or not all(p.strip().lstrip('-').isdigit() for p in parts):
        raise ValueError(f'--loop_span={_SPAN.value!r}: expected START:STOP:LOOPS (integers)')
      span = tuple(int(p) for p in parts)
    print(json.dumps(files.import_hf(_SRC.value, _OUT.value, span, _OVERWRITE.value), indent=1))
    return
  # in a multi-process run every process reads the checkpoint (Orbax's restore is collective);
  # process 0 writes the export and prints
  out = files.export_workdir(_WORKDIR.value, _OUT.value, _FORMAT.value, _STEP.value,
                             _OVERWRITE.value, verify=_VERIFY.value, write=main_process(),
                             command=' '.join(['python', 'scripts/export.py'] + sys.argv[1:]))
  if main_process():
    print(json.dumps(out, indent=1))


if __name__ == '__main__':
  run(main)
