"""Tokenizes a corpus into sharded token files with a manifest (or one token file / zarr array).

    # a directory of shards + DIR/manifest.json, 2% of documents held out in 'val' shards
    python scripts/prepare_data.py --inputs='/data/c4/*.jsonl.zst,/data/wiki/*.parquet' \
        --output=/data/corpus --format=tokens --workers=8 --val_fraction=0.02
    # then train on it: --config.data.source=manifest --config.data.path=/data/corpus
    python scripts/prepare_data.py --inputs=corpus.txt --train_bpe=8192 \
        --tokenizer=/data/bpe.json --output=/data/corpus_bpe --format=array_record
    # the single-file form: an --output ending in .bin (or .zarr with --format=zarr)
    python scripts/prepare_data.py --inputs=a.txt,b.jsonl --output=/data/train.bin

Inputs (comma-separated paths or globs, each glob's matches sorted; "embedded" for the embedded
corpus): .txt (a document per file), .jsonl / .jsonl.gz / .jsonl.zst (a document per line, field
--text_field), .parquet (column --text_field), and Hugging Face datasets saved with save_to_disk
(a directory with state.json and data-*.arrow files). Workers tokenize in parallel (a progress
line on stderr); EOS follows every document; --val_fraction of the documents (by a hash of their
number) go to separate 'val' shards. Formats: tokens (flat token files), zarr (zarr3 arrays),
array_record (ArrayRecord files of 4096-token records; see loopmoe_jax/data/shards.py).
The shards depend only on the inputs, tokenizer, --shard_tokens and --val_fraction, not on
--workers. Interrupted? Run the same command again: finished shards are verified and kept, the
rest is written, byte-identical to an uninterrupted run. DIR/manifest.json is written last.
"""
import os

from absl import flags

from loopmoe_jax.cli import check_output_dir, check_output_file, run

_INPUTS = flags.DEFINE_list('inputs', None, 'Paths or globs of .txt, .jsonl[.gz|.zst], .parquet '
                            'files and save_to_disk dataset directories; '
                            'hf:NAME[@CONFIG][:SPLIT] streams a Hugging Face dataset (needs '
                            'the datasets package; a hub name needs the network); "embedded" '
                            'for the embedded corpus.', required=True)
_OUTPUT = flags.DEFINE_string('output', None, 'Output directory (shards + manifest.json), or a '
                              'single FILE.bin / X.zarr / zarr kvstore spec.', required=True)
_FORMAT = flags.DEFINE_enum('format', 'tokens', ['tokens', 'zarr', 'array_record'],
                            'Shard format.')
_TOKENIZER = flags.DEFINE_string('tokenizer', 'byte', '"byte" or a tokenizers JSON file.')
_TRAIN_BPE = flags.DEFINE_integer('train_bpe', 0, 'Train a BPE of this vocabulary on the '
                                  'inputs and save it to --tokenizer first.')
_FIELD = flags.DEFINE_string('text_field', 'text', 'JSONL field / parquet or arrow column holding '
                             'the text.')
_WORKERS = flags.DEFINE_integer('workers', None, 'Tokenizing processes (default: the CPU count; '
                                '0: in this process).')
_SHARD_TOKENS = flags.DEFINE_integer('shard_tokens', 1 << 27, 'A shard ends at the first '
                                     'document end at or past this many tokens.')
_VAL_FRACTION = flags.DEFINE_float('val_fraction', 0.0, 'Share of documents held out in the '
                                   'val split (directory output only).')


def main(argv):
  del argv
  from loopmoe_jax.data.prepare import PrepareConfig, run as prepare
  workers = (os.cpu_count() or 1) if _WORKERS.value is None else _WORKERS.value
  cfg = PrepareConfig(tuple(_INPUTS.value), _OUTPUT.value, _FORMAT.value, _TOKENIZER.value,
                      _TRAIN_BPE.value, _FIELD.value, workers, _SHARD_TOKENS.value,
                      _VAL_FRACTION.value, progress=True)
  check_outputs(cfg)
  print(prepare(cfg))


def check_outputs(cfg) -> None:
  """The paths written, before any input is read: --output (a directory of shards, a .zarr
  directory, or a .bin file; a kvstore spec is tensorstore's) and, with --train_bpe, the
  --tokenizer file the BPE is saved to."""
  if cfg.output.lstrip().startswith('{'):
    pass
  elif cfg.single and cfg.output.rstrip('/').endswith('.bin'):
    check_output_file('--output', cfg.output)
  else:
    check_output_dir('--output', cfg.output)
  if cfg.train_vocab:
    check_output_file('--tokenizer', cfg.tokenizer)


if __name__ == '__main__':
  run(main)
