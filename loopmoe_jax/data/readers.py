"""Input readers for data preparation: documents from text, JSONL (plain, .gz, .zst), parquet,
Hugging Face datasets saved with `save_to_disk`, and the embedded corpus, in a fixed order.

A document is `Doc(path, where, payload, is_json)`: `where` is the line (JSONL) or row
(parquet, arrow) it came from, for error messages; a JSONL payload is the raw line (the worker
processes parse it), any other payload is the text itself. Nothing here imports JAX (the
tokenizing workers import this module).

Kinds, by file name: `*.jsonl` / `*.ndjson` one document per non-blank line (field
`text_field`); `*.parquet` one per row of column `text_field`; a directory holding
`state.json` or `dataset_info.json` with `data-*.arrow` files (`Dataset.save_to_disk`; arrow IPC
streams, read with pyarrow, no `datasets` needed) one per row; anything else (`*.txt`) one
document per file. A `.gz` or `.zst` suffix on a text or JSONL file decompresses it; a truncated
or corrupt compressed file is an error naming the file and the line it stops at.

`hf:NAME[@CONFIG][:SPLIT]` (split `train` by default) streams a dataset through the `datasets`
package (`load_dataset(NAME, CONFIG, split=SPLIT, streaming=True)`, rows in the dataset's file
order): a hub name such as `hf:HuggingFaceFW/fineweb-edu@sample-10BT` when the network allows,
or a local folder of data files (`hf:/data/my_ds`: the same loader, offline). It needs
`pip install datasets`; a name the hub cannot serve is an error naming it.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import zlib
from typing import Iterator, NamedTuple

from loopmoe_jax.data import corpus

COMPRESSIONS = ('.gz', '.zst')
JSONL = ('.jsonl', '.ndjson')
HF_MARKERS = ('state.json', 'dataset_info.json')
HUB = 'hf:'
READ_BYTES = 1 << 20
ROWS_PER_BATCH = 1024


class Doc(NamedTuple):
  path: str
  where: int | None   # line (JSONL) or row (parquet, arrow); None for a whole-file document
  payload: str        # the text, or a raw JSON line when is_json
  is_json: bool


@dataclasses.dataclass(frozen=True)
class Input:
  path: str                 # a file, a dataset directory, 'embedded', or an hf: spec
  kind: str                 # embedded | text | jsonl | parquet | hf | hub
  compression: str = ''     # '' | '.gz' | '.zst'


def _kind(path: str) -> Input:
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, 'dataset_dict.json')):
      splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
      raise ValueError(f'input {path!r} is a saved Hugging Face DatasetDict: name one split, '
                       f'e.g. {os.path.join(path, splits[0]) if splits else path + "/train"!r} '
                       f'(splits: {splits})')
    if not any(os.path.exists(os.path.join(path, m)) for m in HF_MARKERS):
      raise ValueError(f'input {path!r} is a directory without {" or ".join(HF_MARKERS)} (not a '
                       'Hugging Face dataset saved with save_to_disk): give files or a glob')
    return Input(path, 'hf')
  base, comp = path, ''
  for c in COMPRESSIONS:
    if path.endswith(c):
      base, comp = path[:-len(c)], c
  if base.endswith('.parquet'):
    if comp:
      raise ValueError(f'input {path!r}: a compressed parquet file is not read (parquet '
                       'compresses its own pages)')
    return Input(path, 'parquet')
  return Input(path, 'jsonl' if base.endswith(JSONL) else 'text', comp)


def expand(specs) -> list[Input]:
  """The inputs named by `specs` (paths, globs or 'embedded'), in order; each glob's matches
  sorted. A glob that matches nothing, or a missing path, is an error naming it."""
  out = []
  for spec in specs:
    if spec == 'embedded':
      out.append(Input('embedded', 'embedded'))
    elif spec.startswith(HUB):
      hub_spec(spec)  # a malformed spec fails here, before any reading
      out.append(Input(spec, 'hub'))
    elif glob.has_magic(spec):
      matches = sorted(glob.glob(spec, recursive=True))
      if not matches:
        raise ValueError(f'--inputs glob {spec!r} matches no file')
      out.extend(_kind(m) for m in matches)
    elif not os.path.exists(spec):
      raise FileNotFoundError(f'input file {spec!r} does not exist')
    else:
      out.append(_kind(spec))
  if not out:
    raise ValueError('--inputs is empty: give files, globs or "embedded"')
  return out


def _truncated(path: str, line: int, why) -> ValueError:
  return ValueError(f'{path}: compressed data ends early or is corrupt at line {line} '
                    f'(truncated file? {why})')


def _zst_blocks(path: str) -> Iterator[bytes]:
  """Decompressed bytes of a .zst file (any number of frames); raises on a truncated frame."""
  import zstandard
  dctx = zstandard.ZstdDecompressor()
  dobj, complete = dctx.decompressobj(), True
  with open(path, 'rb') as f:
    while block := f.read(READ_BYTES):
      while block:
        try:
          out = dobj.decompress(block)
        except zstandard.ZstdError as e:
          raise EOFError(f'corrupt zstd data: {e}') from None
        complete = dobj.eof
        if out:
          yield out
        block = dobj.unused_data if dobj.eof else b''
        if dobj.eof:
          dobj = dctx.decompressobj()
  if not complete:
    raise EOFError('the last zstd frame is incomplete')


def _byte_blocks(path: str, compression: str) -> Iterator[bytes]:
  if compression == '.zst':
    yield from _zst_blocks(path)
    return
  opener = gzip.open if compression == '.gz' else open
  with opener(path, 'rb') as f:
    while block := f.read1(READ_BYTES):  # what one read decompresses: the data before a cut
      yield block


def lines(path: str, compression: str = '', keepends: bool = False
          ) -> Iterator[tuple[int, str]]:
  """(line number, text) of a text file, decompressing .gz / .zst; a truncated or corrupt
  compressed file or bad UTF-8 is a ValueError naming file and line."""
  n, rest, end = 0, b'', b'\n' if keepends else b''
  try:
    for block in _byte_blocks(path, compression):
      parts = (rest + block).split(b'\n')
      rest = parts.pop()
      for raw in parts:
        n += 1
        yield n, _decode(path, n, raw + end)
  except (EOFError, OSError, zlib.error) as e:
    if not compression or isinstance(e, FileNotFoundError):
      raise
    raise _truncated(path, n + 1, e) from None
  if rest:
    yield n + 1, _decode(path, n + 1, rest)


def _decode(path: str, n: int, raw: bytes) -> str:
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise ValueError(f'{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})') from None


def _arrow_rows(path: str, batches, names, field: str) -> Iterator[Doc]:
  if field not in names:
    raise ValueError(f'{path}: no column {field!r} (its columns: {list(names)}); name the text '
                     'column with --text_field')
  row = 0
  for batch in batches:
    for text in batch.column(field).to_pylist():
      yield Doc(path, row, text, False)
      row += 1


def _parquet(path: str, field: str) -> Iterator[Doc]:
  import pyarrow.parquet as pq
  pf = pq.ParquetFile(path)
  names = pf.schema_arrow.names
  yield from _arrow_rows(path, pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=[field])
                         if field in names else (), names, field)


def hf_files(path: str) -> list[str]:
  """The arrow files of a `save_to_disk` directory, in the order state.json lists them."""
  state = os.path.join(path, 'state.json')
  if os.path.exists(state):
    with open(state) as f:
      files = [d['filename'] for d in json.load(f).get('_data_files', [])]
  else:
    files = sorted(f for f in os.listdir(path) if f.startswith('data-') and f.endswith('.arrow'))
  if not files:
    raise ValueError(f'input {path!r}: a Hugging Face dataset directory without data-*.arrow files')
  return [os.path.join(path, f) for f in files]


def _hf(path: str, field: str) -> Iterator[Doc]:
  import pyarrow as pa
  for file in hf_files(path):
    with pa.memory_map(file) as source:
      try:
        reader = pa.ipc.open_stream(source)
      except pa.ArrowInvalid as e:
        raise ValueError(f'{file}: not an arrow stream as save_to_disk writes ({e})') from None
      yield from _arrow_rows(file, reader, reader.schema.names, field)


def hub_spec(spec: str) -> tuple[str, str | None, str]:
  """(name, config or None, split) of `hf:NAME[@CONFIG][:SPLIT]`."""
  body = spec[len(HUB):]
  head, sep, tail = body.rpartition(':')
  name, split = (head, tail) if sep and '/' not in tail and tail else (body, 'train')
  name, _, config = name.partition('@')
  if not name:
    raise ValueError(f'--inputs {spec!r}: expected hf:NAME[@CONFIG][:SPLIT], e.g. '
                     'hf:HuggingFaceFW/fineweb-edu@sample-10BT:train')
  return name, config or None, split


def _hub(spec: str, field: str) -> Iterator[Doc]:
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f'--inputs {spec!r} needs the datasets package: pip install datasets') \
        from None
  name, config, split = hub_spec(spec)
  try:
    rows = datasets.load_dataset(name, config, split=split, streaming=True)
    names = list(rows.column_names or [])
  except Exception as e:  # pylint: disable=broad-except  (network, unknown name or split)
    why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    raise ValueError(f'--inputs {spec!r}: the datasets loader cannot read it ({why})') from None
  if names and field not in names:
    raise ValueError(f'{spec}: no column {field!r} (its columns: {names}); name the text '
                     'column with --text_field')
  for row, item in enumerate(rows):
    yield Doc(spec, row, item.get(field), False)


def documents(inputs: list[Input], field: str = 'text') -> Iterator[Doc]:
  """Every document of `inputs`, in order."""
  for inp in inputs:
    if inp.kind == 'embedded':
      yield from (Doc('embedded', None, text, False) for _, text in corpus.documents())
    elif inp.kind == 'parquet':
      yield from _parquet(inp.path, field)
    elif inp.kind == 'hf':
      yield from _hf(inp.path, field)
    elif inp.kind == 'hub':
      yield from _hub(inp.path, field)
    elif inp.kind == 'jsonl':
      yield from (Doc(inp.path, n, line, True) for n, line in lines(inp.path, inp.compression)
                  if line.strip())
    else:  # the whole file, newlines translated as Python's text mode does
      text = ''.join(l for _, l in lines(inp.path, inp.compression, keepends=True))
      yield Doc(inp.path, None, text.replace('\r\n', '\n').replace('\r', '\n'), False)


def text_of(doc: Doc, field: str) -> str:
  """The document's text (parses a JSONL line); a clear error naming file and line/row."""
  if doc.is_json:
    try:
      text = json.loads(doc.payload)[field]
    except (ValueError, KeyError, TypeError):
      raise ValueError(f'{doc.path}:{doc.where}: not a JSON object with a {field!r} field') \
          from None
  else:
    text = doc.payload
  if not isinstance(text, str):
    where = f'{doc.path}:{doc.where}' if doc.where is not None else doc.path
    what = 'null' if text is None else f'{type(text).__name__} {str(text)[:40]!r}'
    raise ValueError(f'{where}: field {field!r} is {what}, not text')
  return text
