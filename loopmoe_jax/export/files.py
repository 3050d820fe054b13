"""Export a workdir's checkpoint and import a Hugging Face directory; output directories are
written beside OUT under a temporary name and renamed into place only when complete, so a
failed run leaves nothing half-written."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import numpy as np

from loopmoe_jax import storage
from loopmoe_jax.analysis.probes import validation_inputs
from loopmoe_jax.export import hf_looped, looped_io, mixtral, safetensors_io
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.train.metrics import FINAL_STEPS, METRICS, ROUTING, SUMMARY
from loopmoe_jax.train.run import RunDir, as_loaded

FORMATS = ('safetensors', 'hf-mixtral', 'hf-looped')
IMPORTS = ('hf-mixtral', 'hf-looped')
SHARD_BYTES = 2 << 30  # hub-style shards with an index past this size


RUN_FILES = {METRICS, SUMMARY, ROUTING, FINAL_STEPS}  # a run directory's (train/metrics.py)


def is_export(directory: str) -> bool:
  """An earlier export: a directory of files only, with config.json and *.safetensors (both
  formats write them), and only the files an export writes."""
  names = os.listdir(directory)
  if any(os.path.isdir(os.path.join(directory, n)) for n in names):
    return False
  known = lambda n: n.endswith(('.safetensors', '.json')) or n in EXPORT_EXTRA
  return ('config.json' in names and any(n.endswith('.safetensors') for n in names) and
          all(known(n) for n in names))


EXPORT_EXTRA = ('README.md', 'tokenizer.model') + hf_looped.SOURCE_FILES


def check_out(out: str, overwrite: bool = False) -> str:
  """`out` as an absolute path, if an export may be written there: an existing non-empty
  `out` is refused unless `overwrite` and it is an earlier export, and an `out` that holds a
  training run (checkpoints/ or its logs, at any depth) or lies inside one always. Cheap:
  export_workdir calls it before reading the checkpoint. On object storage (gs://) the same
  rules, over the objects under `out`."""
  if storage.is_url(out):
    names = storage.listdir(out)
    if RUN_FILES & set(names) or 'checkpoints' in names:
      raise FileExistsError(f'--out={out} holds a training run; --overwrite replaces exports '
                            'only: choose another --out')
    if names and not overwrite:
      raise FileExistsError(f'--out={out} exists and is not empty (pass --overwrite to replace '
                            'it)')
    return out
  out = os.path.abspath(out)
  if os.path.exists(out) and not os.path.isdir(out):
    raise FileExistsError(f'--out={out} exists and is not a directory')
  for root, dirs, names in os.walk(out) if os.path.isdir(out) else ():
    if 'checkpoints' in dirs or RUN_FILES & set(names):  # never replace a run directory
      raise FileExistsError(f'--out={out} holds a training run ({root}); --overwrite replaces '
                            'exports only: choose another --out')
  above = os.path.dirname(out)
  while above != os.path.dirname(above):  # nor write inside one
    if os.path.isdir(os.path.join(above, 'checkpoints')) or any(
        os.path.exists(os.path.join(above, n)) for n in RUN_FILES):
      raise FileExistsError(f'--out={out} lies inside the training run {above}: choose an '
                            '--out outside it')
    above = os.path.dirname(above)
  if os.path.isdir(out) and os.listdir(out):
    if not overwrite:
      raise FileExistsError(f'--out={out} exists and is not empty (pass --overwrite to replace '
                            'it)')
    if not is_export(out):
      raise FileExistsError(f'--out={out} is not an earlier export (no *.safetensors and '
                            'config.json, or other entries); --overwrite replaces exports only')
  return out


@contextlib.contextmanager
def output_dir(out: str, overwrite: bool = False):
  """Yields a fresh temporary directory beside `out`, renamed to `out` on success and
  removed on failure; `out` as `check_out` allows. On object storage the export is written to
  a local temporary directory and uploaded to `out` when complete."""
  out = check_out(out, overwrite)
  if storage.is_url(out):
    tmp = tempfile.mkdtemp(prefix='loopmoe-export-')
    try:
      yield tmp
      storage.rmtree(out)  # an earlier export (check_out allowed it)
      storage.upload_tree(tmp, out)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    return
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(out)}.tmp-')
  try:
    yield tmp
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the export from other users
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
  """(config.json, tensors) of a Mixtral directory (one file or an index of shards)."""
  config = read_config(directory)
  mixtral.check_hf_config(config, directory)
  return config, read_tensors(directory)


def read_config(directory: str) -> dict:
  """config.json of a Hugging Face model directory."""
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{directory}: no config.json (not a Hugging Face model directory)')
  with open(path) as f:
    return json.load(f)


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """The tensors of a Hugging Face directory (one file, or an index of shards)."""
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
  return tensors


def export_workdir(workdir: str, out: str, fmt: str, step: int | None = None,
                   overwrite: bool = False, verify: bool = False, write: bool = True,
                   command: str | None = None) -> dict:
  """Exports a checkpoint of `workdir` (a step, or the latest readable) as `fmt` into `out`;
  returns a summary (step, format, out, bytes, layers, and with `verify` verify_export's
  check of the written export against the same loaded checkpoint). `write` False: the
  checkpoint is read (a collective restore) and nothing written, {} returned (the processes
  other than 0 of a multi-process run)."""
  if fmt not in FORMATS:
    raise ValueError(f'--format={fmt!r}: one of {FORMATS}')
  if verify and storage.is_url(out):
    raise ValueError(f'--verify reads the export back from local disk: export to a local --out '
                     f'(then copy it to {out})')
  if verify and fmt == 'hf-mixtral':
    _verify_packages()  # before anything is written
  if verify and fmt == 'hf-looped':
    looped_io.packages()
  check_out(out, overwrite)  # before the checkpoint is read
  run = RunDir(workdir).load(step)
  if not write:  # another process of a multi-process run writes it
    return {}
  cfg, s, config = run.model_cfg, run.step, run.config
  extra = {}
  if fmt == 'hf-mixtral':
    mixtral.check_exportable(cfg)
  elif fmt == 'hf-looped':
    hf_looped.check_exportable(cfg)
  elif cfg.router_bias != 'none':
    raise ValueError(f'model.router_bias={cfg.router_bias!r}: {mixtral.BIAS_REFUSAL}')
  params = safetensors_io.unflatten(safetensors_io.flatten(run.params))  # numpy, one host
  with output_dir(out, overwrite) as tmp:
    if fmt == 'safetensors':
      safetensors_io.save_model(tmp, config, params, s)
      layers = cfg.executed_layers
    elif fmt == 'hf-looped':
      extra = write_looped(tmp, cfg, params, run.router_bias, config, s, run.exp.data, command)
      extra['param_bytes'] = sum(a.nbytes for a in safetensors_io.flatten(params).values())
      layers = cfg.executed_layers
    else:
      seq_len = int((config.get('data') or {}).get('seq_len', 4096))
      hf_config, generation, tensors = mixtral.to_hf(cfg, params, max(seq_len, 4096))
      write_hf(tmp, hf_config, generation, tensors)
      layers = hf_config['num_hidden_layers']
  size = sum(storage.size(storage.join(out, n)) for n in storage.listdir(out))
  summary = {'step': s, 'format': fmt, 'out': storage.absolute(out), 'bytes': size,
             'layers': layers, **extra}
  if verify:
    summary['verify'] = verify_export(run, out, fmt)
  return summary


def write_looped(directory: str, cfg, params, router_bias=None, run_config: dict | None = None,
                 step: int | None = None, data_cfg=None, command: str | None = None) -> dict:
  """The hf-looped export of a model into `directory`: config, weights, modeling source,
  tokenizer and README (looped_io.to_hf, write_extras: its summary is returned)."""
  hf_config, generation, tensors = looped_io.to_hf(cfg, params, router_bias, run_config, step,
                                                   command)
  write_hf(directory, hf_config, generation, tensors)
  return looped_io.write_extras(directory, cfg, step, data_cfg, command,
                                sum(a.nbytes for a in tensors.values()))


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


def import_looped(src: str, out: str, overwrite: bool = False) -> dict:
  """An hf-looped directory back into a run directory (out/checkpoints/<step>/: the params,
  the router bias and the run's config, as the export kept them) that the scripts read with
  --workdir; nothing is written when the directory is not an hf-looped export."""
  run_config, params, bias, step = looped_io.import_run(read_config(src), read_tensors(src),
                                                        src)
  with output_dir(out, overwrite) as tmp:
    looped_io.write_run(tmp, run_config, params, bias, step)
  return {'out': os.path.abspath(out), 'step': step,
          'num_loops': run_config['model']['num_loops'],
          'router_bias': run_config['model'].get('router_bias', 'none')}


def _verify_packages():
  """(torch, transformers), or an ImportError saying --verify of hf-mixtral needs them."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'--verify of hf-mixtral needs torch and transformers ({e}); '
                      'pip install torch==2.13.0 transformers') from None
  return torch, transformers


def verify_export(workdir, out: str, fmt: str, step: int | None = None,
                  tokens: int = 256, greedy: int = 16) -> dict:
  """Checks an export against our model on the run's first validation window(s): the max
  absolute logit difference over `tokens` tokens in float32, and whether `greedy` greedy
  tokens after a 16-token prompt agree. 'hf-mixtral' loads it with transformers'
  MixtralForCausalLM on CPU (torch and transformers must be installed); 'safetensors' with our
  own reader (load_model), run through our model; 'hf-looped' with its own class at several
  pass counts (looped_io.verify). `workdir`: a run directory, or the run.Loaded its caller
  holds already."""
  import jax
  import jax.numpy as jnp
  run = as_loaded(workdir, step)
  if fmt == 'hf-looped':  # its own model class, at several pass counts (looped_io.verify)
    return looped_io.verify(run, out, tokens, greedy)
  cfg, params, s, config = run.model_cfg, run.params, run.step, run.config
  inputs = np.concatenate(validation_inputs(config, cfg.vocab_size, tokens)[0])
  seq = min(inputs.shape[1], tokens)
  n = min(16, seq - greedy)  # prompt length of the greedy check
  if n < 1:
    raise ValueError(f'--verify: the context ({seq}) is too short for {greedy} greedy tokens')
  x = inputs[:max(1, tokens // seq), :seq].astype(np.int32)
  forward = jax.jit(lambda p, t: LoopedMoE(cfg, runtime=run.runtime).apply({'params': p}, t)[0])
  ours = lambda t: np.asarray(forward(params, jnp.asarray(t)), np.float32)
  if fmt == 'safetensors':
    cfg2, back, _ = safetensors_io.load_model(out)
    forward2 = jax.jit(lambda p, t: LoopedMoE(cfg2, runtime=run.runtime).apply({'params': p},
                                                                                t)[0])
    theirs = lambda t: np.asarray(forward2(back, jnp.asarray(t)), np.float32)
  else:
    torch, transformers = _verify_packages()
    model = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    def theirs(t):
      with torch.no_grad():
        return model(torch.tensor(np.asarray(t, np.int64))).logits.numpy()
  ref = ours(x)
  err = float(np.max(np.abs(theirs(x) - ref)))
  buf_a = np.zeros((1, n + greedy), np.int32)
  buf_a[0, :n] = x[0, :n]
  buf_b = buf_a.copy()
  for t in range(n, n + greedy):  # causal: padding after position t changes nothing before it
    buf_a[0, t] = ours(buf_a)[0, t - 1].argmax()
    buf_b[0, t] = theirs(buf_b)[0, t - 1].argmax()
  return {'step': s, 'tokens': int(x.size), 'max_abs_logit_error': err,
          'logit_scale': float(np.max(np.abs(ref))), 'greedy_tokens': greedy,
          'greedy_equal': bool(np.array_equal(buf_a, buf_b))}
