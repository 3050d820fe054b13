"""Tokenizes text / JSONL files into a flat token file or a zarr array; can train a BPE first.

    python scripts/prepare_data.py --inputs=a.txt,b.jsonl --output=/data/train.bin
    python scripts/prepare_data.py --inputs=corpus.txt --train_bpe=8192 \
        --tokenizer=/data/bpe.json --output=/data/train.zarr --format=zarr
"""
from absl import flags

from loopmoe_jax.cli import run

_INPUTS = flags.DEFINE_list('inputs', [], 'Text (.txt) or JSONL (.jsonl, field --text_field) '
                            'files; "embedded" for the embedded corpus.', required=True)
_OUTPUT = flags.DEFINE_string('output', None, 'Output token file or zarr path/spec.',
                              required=True)
_FORMAT = flags.DEFINE_enum('format', 'tokens', ['tokens', 'zarr'], 'Output kind.')
_TOKENIZER = flags.DEFINE_string('tokenizer', 'byte', '"byte" or a tokenizers JSON file.')
_TRAIN_BPE = flags.DEFINE_integer('train_bpe', 0, 'Train a BPE of this vocabulary on the '
                                  'inputs and save it to --tokenizer first.')
_FIELD = flags.DEFINE_string('text_field', 'text', 'JSONL field holding the text.')


def main(argv):
  del argv
  from loopmoe_jax.data.prepare import prepare
  info = prepare(_INPUTS.value, _OUTPUT.value, _FORMAT.value, _TOKENIZER.value,
                 _TRAIN_BPE.value, _FIELD.value)
  print(info)


if __name__ == '__main__':
  run(main)
