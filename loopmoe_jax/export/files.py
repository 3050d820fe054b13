"""Export a workdir's checkpoint and import a Mixtral directory; output directories are
written beside OUT under a temporary name and renamed into place only when complete, so a
failed run leaves nothing half-written."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import numpy as np

from loopmoe_jax.export import mixtral, safetensors_io

FORMATS = ('safetensors', 'hf-mixtral')
SHARD_BYTES = 2 << 30  # hub-style shards with an index past this size


@contextlib.contextmanager
def output_dir(out: str, overwrite: bool = False):
  """Yields a fresh temporary directory beside `out`, renamed to `out` on success and
  removed on failure. An existing non-empty `out` is refused unless `overwrite`."""
  out = os.path.abspath(out)
  if os.path.exists(out) and not os.path.isdir(out):
    raise FileExistsError(f'--out={out} exists and is not a directory')
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise FileExistsError(f'--out={out} exists and is not empty (pass --overwrite to replace it)')
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(out)}.tmp-')
  try:
    yield tmp
    if os.path.isdir(out):
      shutil.rmtree(out)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def write_hf(directory: str, config: dict, generation: dict, tensors: dict[str, np.ndarray]):
  """config.json, generation_config.json and model.safetensors (or hub-style shards
  model-0000i-of-0000n.safetensors with model.safetensors.index.json past SHARD_BYTES)."""
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(config, f, indent=1)
  with open(os.path.join(directory, 'generation_config.json'), 'w') as f:
    json.dump(generation, f, indent=1)
  shards, size = [{}], 0
  for name in sorted(tensors):
    if size and size + tensors[name].nbytes > SHARD_BYTES:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += tensors[name].nbytes
  meta = {'format': 'pt'}
  if len(shards) == 1:
    safetensors_io.write_file(os.path.join(directory, 'model.safetensors'), tensors, meta)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    name = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    safetensors_io.write_file(os.path.join(directory, name), shard, meta)
    weight_map.update({n: name for n in shard})
  with open(os.path.join(directory, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {'total_size': sum(a.nbytes for a in tensors.values())},
               'weight_map': weight_map}, f, indent=1)


def read_hf(directory: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json, tensors) of a Hugging Face directory (one file or an index of shards)."""
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{directory}: no config.json (not a Hugging Face model directory)')
  with open(path) as f:
    config = json.load(f)
  mixtral.check_hf_config(config, directory)
  index = os.path.join(directory, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
  elif os.path.isfile(os.path.join(directory, 'model.safetensors')):
    files = ['model.safetensors']
  else:
    raise FileNotFoundError(f'{directory}: no model.safetensors or model.safetensors.index.json')
  tensors = {}
  for name in files:
    tensors.update(safetensors_io.read_file(os.path.join(directory, name))[0])
  return config, tensors


def export_workdir(workdir: str, out: str, fmt: str, step: int | None = None,
                   overwrite: bool = False) -> dict:
  """Exports a checkpoint of `workdir` (a step, or the latest readable) as `fmt` into `out`;
  returns a summary (step, format, out, bytes, layers)."""
  from loopmoe_jax.train import checkpoint
  if fmt not in FORMATS:
    raise ValueError(f'--format={fmt!r}: one of {FORMATS}')
  cfg, params, s, config = checkpoint.load_params(workdir, step)
  if fmt == 'hf-mixtral':
    mixtral.check_exportable(cfg)
  params = safetensors_io.unflatten(safetensors_io.flatten(params))  # numpy, one host
  with output_dir(out, overwrite) as tmp:
    if fmt == 'safetensors':
      safetensors_io.save_model(tmp, config, params, s)
      layers = cfg.executed_layers
    else:
      seq_len = int((config.get('data') or {}).get('seq_len', 4096))
      hf_config, generation, tensors = mixtral.to_hf(cfg, params, max(seq_len, 4096))
      write_hf(tmp, hf_config, generation, tensors)
      layers = hf_config['num_hidden_layers']
  size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
  return {'step': s, 'format': fmt, 'out': os.path.abspath(out), 'bytes': size,
          'layers': layers}


def import_hf(src: str, out: str, span: tuple[int, int, int] | None = None,
              overwrite: bool = False) -> dict:
  """A Mixtral directory into our safetensors format (config.json with a 'model' section)."""
  import dataclasses
  config, tensors = read_hf(src)
  cfg, params = mixtral.from_hf(config, tensors, span, where=src)
  with output_dir(out, overwrite) as tmp:
    safetensors_io.save_model(tmp, {'model': dataclasses.asdict(cfg)}, params)
  return {'out': os.path.abspath(out), 'layers': cfg.executed_layers,
          'core_layers': cfg.core_layers, 'num_loops': cfg.num_loops}
