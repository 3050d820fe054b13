"""The safetensors file format (header length, JSON header, raw little-endian bytes) in
numpy, and our parameter tree under stable dotted names ('core.body.layer_0.moe.down').

The format is written here directly (no torch, no extra package): it holds any of our
param dtypes, bfloat16 included, and reads back bit-exact. `load_model` checks the names,
shapes and dtypes against the tree the config's model builds, naming what is missing or extra.
"""
from __future__ import annotations

import json
import os
import struct

import jax
import ml_dtypes
import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.model import LoopedMoE, for_init

DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
          'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U8': np.uint8,
          'BOOL': np.bool_}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
MODEL_FILE = 'model.safetensors'
CONFIG_FILE = 'config.json'


def write_file(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
  """Writes `tensors` (name -> array) in name order, 8-byte aligned."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.asarray(tensors[name], order='C')  # keeps a 0-d array 0-d (ascontiguousarray: 1-d)
    if a.dtype not in CODES:
      raise ValueError(f'{name}: dtype {a.dtype} has no safetensors code')
    a = a.astype(a.dtype.newbyteorder('<'), copy=False)
    header[name] = {'dtype': CODES[a.dtype], 'shape': list(a.shape),
                    'data_offsets': [offset, offset + a.nbytes]}
    offset += a.nbytes
    arrays.append(a)
  if metadata:
    header['__metadata__'] = {str(k): str(v) for k, v in metadata.items()}
  text = json.dumps(header, separators=(',', ':')).encode()
  text += b' ' * (-len(text) % 8)
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(text)))
    f.write(text)
    for a in arrays:
      f.write(a.tobytes())


def read_file(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """(tensors, metadata) of a safetensors file; a truncated or malformed file is a ValueError."""
  with open(path, 'rb') as f:
    data = f.read()
  try:
    (n,) = struct.unpack('<Q', data[:8])
    header = json.loads(data[8:8 + n])
  except (struct.error, ValueError) as e:
    raise ValueError(f'{path}: not a safetensors file ({e})') from None
  metadata = header.pop('__metadata__', {}) or {}
  out, base = {}, 8 + n
  for name, h in header.items():
    start, stop = h['data_offsets']
    if h['dtype'] not in DTYPES or base + stop > len(data):
      raise ValueError(f'{path}: tensor {name!r} has dtype {h["dtype"]} or lies past the file end')
    dt = np.dtype(DTYPES[h['dtype']]).newbyteorder('<')
    out[name] = np.frombuffer(data, dt, count=(stop - start) // dt.itemsize,
                              offset=base + start).reshape(h['shape'])
  return out, metadata


def flatten(params) -> dict[str, np.ndarray]:
  """{'core.body.layer_0.moe.down': array, ...} of a (nested dict) param tree."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return {'.'.join(str(k.key) for k in path): np.asarray(leaf) for path, leaf in leaves}


def unflatten(flat: dict[str, np.ndarray]) -> dict:
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split('.')
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def expected_tensors(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """Dotted name -> shape/dtype of the params the config's model builds (no init run)."""
  import flax.linen as nn
  import jax.numpy as jnp
  shapes = jax.eval_shape(lambda: for_init(LoopedMoE(cfg)).init(jax.random.key(0),
                                                      jnp.zeros((1, 4), jnp.int32)))
  leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(shapes['params']))
  return {'.'.join(str(k.key) for k in path): leaf for path, leaf in leaves}


def check_tensors(flat: dict[str, np.ndarray], expected: dict, where: str):
  """ValueError naming the missing, extra and misshapen tensors of `flat` against `expected`."""
  missing = sorted(set(expected) - set(flat))
  extra = sorted(set(flat) - set(expected))
  wrong = [f'{n} {tuple(flat[n].shape)} {flat[n].dtype} (expected {tuple(e.shape)} {e.dtype})'
           for n, e in sorted(expected.items())
           if n in flat and (tuple(flat[n].shape) != tuple(e.shape) or flat[n].dtype != e.dtype)]
  problems = []
  if missing:
    problems.append(f'missing tensors {missing}')
  if extra:
    problems.append(f'extra tensors {extra}')
  if wrong:
    problems.append(f'tensors of another shape or dtype {wrong}')
  if problems:
    raise ValueError(f'{where}: ' + '; '.join(problems))


def save_model(directory: str, config: dict, params, step: int | None = None):
  """Writes model.safetensors (the param tree) and config.json (the resolved config, every
  section, with the checkpoint step) into an existing directory."""
  cfg = ModelConfig.from_dict(config['model'])
  flat = flatten(params)
  check_tensors(flat, expected_tensors(cfg), 'the parameter tree')
  write_file(os.path.join(directory, MODEL_FILE), flat,
             {'format': 'loopmoe_jax', 'step': '' if step is None else str(step)})
  with open(os.path.join(directory, CONFIG_FILE), 'w') as f:
    json.dump({**config, 'step': step}, f, indent=1, sort_keys=True)


def load_model(directory: str) -> tuple[ModelConfig, dict, dict]:
  """(ModelConfig, params as numpy, config dict) of a directory `save_model` wrote."""
  for name in (MODEL_FILE, CONFIG_FILE):
    if not os.path.isfile(os.path.join(directory, name)):
      raise FileNotFoundError(f'{directory}: no {name} (not a safetensors export)')
  with open(os.path.join(directory, CONFIG_FILE)) as f:
    config = json.load(f)
  if 'model' not in config:
    raise ValueError(f'{os.path.join(directory, CONFIG_FILE)}: no "model" section')
  cfg = ModelConfig.from_dict(config['model'])
  flat, _ = read_file(os.path.join(directory, MODEL_FILE))
  check_tensors(flat, expected_tensors(cfg), os.path.join(directory, MODEL_FILE))
  return cfg, unflatten(flat), config
