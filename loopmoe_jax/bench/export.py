"""The `export` benchmark (`scripts/benchmark.py export`): the hf-looped export of the README's
main job (configs/default.py, random-init params: sizes and speed do not depend on training).

- looped_bytes_over_params: the exported weight files (model.safetensors) over the parameter
  bytes (target <= 1.05: each shared weight stored once); mixtral_bytes_over_params, the
  unrolled hf-mixtral export of the same model (every executed layer written out), printed
  beside it.
- transformers_forward_s / ours_forward_s: one forward (logits) at batch 8 x 256 in
  transformers (the exported directory loaded with trust_remote_code, float32, CPU,
  torch.no_grad, no cache; torch's default threads, and one thread: on a shared machine
  its threads contend) and in our jitted forward under the run's settings (this machine's
  default dispatch), medians of back-to-back calls; the ratios are printed, not targets.
  Needs torch and transformers.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax import DEFAULT_CONFIG
from loopmoe_jax.bench import _block, init_params, register
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.export import files, looped_io, mixtral, safetensors_io
from loopmoe_jax.model import LoopedMoE


def weight_bytes(directory: str) -> int:
  """Bytes of the .safetensors files in `directory`."""
  return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
             if n.endswith('.safetensors'))


@register('export')
def bench_export(quick: bool = False) -> dict[str, Any]:
  torch, transformers = looped_io.packages()
  exp = build(load_config(DEFAULT_CONFIG))
  cfg, runtime = exp.model, exp.runtime()
  batch, seq, repeats = (2, 32, 2) if quick else (8, 256, 5)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
  model = LoopedMoE(cfg, runtime=runtime)
  params = jax.tree.map(np.asarray, init_params(model, jnp.asarray(tokens)))
  param_bytes = sum(a.nbytes for a in safetensors_io.flatten(params).values())
  res: dict[str, Any] = {'quick': quick, 'batch': batch, 'seq_len': seq,
                         'param_bytes': param_bytes}
  with tempfile.TemporaryDirectory() as work:
    looped = os.path.join(work, 'looped')
    with files.output_dir(looped) as tmp:
      files.write_looped(tmp, cfg, params, step=0)
    unrolled = os.path.join(work, 'mixtral')
    with files.output_dir(unrolled) as tmp:
      files.write_hf(tmp, *mixtral.to_hf(cfg, params))
    res.update(looped_bytes=weight_bytes(looped), mixtral_bytes=weight_bytes(unrolled))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        looped, trust_remote_code=True, dtype=torch.float32).eval()
  res['looped_bytes_over_params'] = res['looped_bytes'] / param_bytes
  res['mixtral_bytes_over_params'] = res['mixtral_bytes'] / param_bytes
  ours = jax.jit(lambda p, t: model.apply({'params': p}, t)[0])
  x, ids = jnp.asarray(tokens), torch.tensor(tokens, dtype=torch.long)

  def theirs():
    with torch.no_grad():
      return hf(ids, use_cache=False).logits

  res['max_abs_logit_error'] = float(np.max(np.abs(theirs().numpy() - np.asarray(ours(params, x)))))
  threads = torch.get_num_threads()
  res['torch_threads'] = threads
  res['ours_forward_s'] = median_seconds(lambda: _block(ours(params, x)), repeats)
  for n, key in ((threads, 'transformers_forward_s'), (1, 'transformers_forward_1thread_s')):
    torch.set_num_threads(n)
    res[key] = median_seconds(theirs, repeats)
  torch.set_num_threads(threads)
  res['transformers_over_ours'] = res['transformers_forward_s'] / res['ours_forward_s']
  res['transformers_1thread_over_ours'] = (res['transformers_forward_1thread_s'] /
                                           res['ours_forward_s'])
  return res


def median_seconds(fn, repeats: int) -> float:
  """Median seconds of `repeats` calls of `fn` after one warm-up call, run back to back (one
  library at a time: XLA's and torch's thread pools would contend if interleaved)."""
  fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))
