"""Export a checkpoint (safetensors, or Hugging Face Mixtral with the loop unrolled), or
import a Mixtral directory into our safetensors format.

    python scripts/export.py --workdir=/tmp/run [--step=400] --format=hf-mixtral --out=/tmp/hf \
        [--verify]   # load it in transformers: max logit error and greedy tokens against ours
    python scripts/export.py --workdir=/tmp/run --format=safetensors --out=/tmp/st
    python scripts/export.py --import=hf-mixtral --src=/tmp/hf --out=/tmp/ours
        [--loop_span=START:STOP:LOOPS]   # layers [START, STOP) as a shared core looped LOOPS
                                         # times, each shared layer the average of its layers
"""
import json

from absl import flags

from loopmoe_jax.cli import run

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory to export from.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_FORMAT = flags.DEFINE_enum('format', None, ['safetensors', 'hf-mixtral'], 'Export format.')
_OUT = flags.DEFINE_string('out', None, 'Output directory (must not exist or be empty).',
                           required=True)
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace a non-empty --out.')
_IMPORT = flags.DEFINE_enum('import', None, ['hf-mixtral'], 'Import instead of export.')
_SRC = flags.DEFINE_string('src', None, 'Directory to import (with --import).')
_SPAN = flags.DEFINE_string('loop_span', None, 'START:STOP:LOOPS for --import.')
_VERIFY = flags.DEFINE_bool('verify', False, 'After exporting, compare the export with our model '
                            'on validation tokens (logits, greedy tokens); hf-mixtral loads it '
                            'in transformers (needs torch).')


def main(argv):
  del argv
  from loopmoe_jax.export import files
  if _IMPORT.value:
    if not _SRC.value:
      raise ValueError('--import needs --src=DIR (the Mixtral directory)')
    span = None
    if _SPAN.value:
      try:
        span = tuple(int(x) for x in _SPAN.value.split(':'))
        assert len(span) == 3
      except (ValueError, AssertionError):
        raise ValueError(f'--loop_span={_SPAN.value!r}: expected START:STOP:LOOPS') from None
    print(json.dumps(files.import_hf(_SRC.value, _OUT.value, span, _OVERWRITE.value), indent=1))
    return
  if not _WORKDIR.value or not _FORMAT.value:
    raise ValueError('export needs --workdir=DIR and --format={safetensors,hf-mixtral}')
  summary = files.export_workdir(_WORKDIR.value, _OUT.value, _FORMAT.value, _STEP.value,
                                 _OVERWRITE.value)
  if _VERIFY.value:
    summary['verify'] = files.verify_export(_WORKDIR.value, _OUT.value, _FORMAT.value,
                                            summary['step'])
  print(json.dumps(summary, indent=1))


if __name__ == '__main__':
  run(main)
