"""Evaluation and sampling from a checkpoint directory, without the trainer."""
from __future__ import annotations

import logging

import jax
import numpy as np

from loopmoe_jax import sharding
from loopmoe_jax.data import pipeline
from loopmoe_jax.decode import cache_bytes, generate
from loopmoe_jax.job import Job
from loopmoe_jax.model import check_loops
from loopmoe_jax.train import step as steps
from loopmoe_jax.train.run import as_loaded
from loopmoe_jax.train.preflight import device_memory_bytes

log = logging.getLogger(__name__)


def evaluate_checkpoint(workdir, num_loops=(None,), step: int | None = None,
                        scale_passes: str | None = None) -> dict:
  """Validation LM loss of a checkpoint (a workdir, or a run.Loaded) for each pass count in
  `num_loops`; `scale_passes` ('trained' or 'executed') overrides the model's choice of r in
  the 1/r residual scale."""
  run = as_loaded(workdir, step)
  cfg, params, s, bias = run.model_cfg, run.params, run.step, run.router_bias
  if scale_passes:
    cfg = cfg.replace(scale_passes=scale_passes)
  for n in num_loops:  # every count checked before any is evaluated
    check_loops(cfg, n)
  batches = validation_batches(run)
  job = Job.build(run.exp._replace(model=cfg, mesh=sharding.MeshConfig(data=1)),
                  jax.local_devices()[:1])
  out = {'step': s, 'scale_passes': cfg.scale_passes, 'val_loss': {}}
  for n in num_loops:
    loss = steps.evaluate(job.eval_step(n), params, batches, job.batch_sh, bias)
    out['val_loss'][str(n or cfg.num_loops)] = loss
  return out


def validation_batches(run) -> list[dict]:
  """The validation batches of a loaded run (run.Loaded), or a ValueError naming it when it
  has none."""
  batches = pipeline.validation_batches(run.exp.data, run.model_cfg.vocab_size)
  if not batches:
    raise ValueError(f'{run.workdir}: the run has no validation data (data.val_path is empty)')
  return batches


def _check_length(cfg, prompt_len: int, tokens: int, train_len: int, num_loops) -> None:
  """Refuses a KV cache that cannot fit in memory; warns past the trained context."""
  total = prompt_len + tokens
  need, have = cache_bytes(cfg, 1, total, num_loops), device_memory_bytes(sharing=1)
  if have is not None and need > have:
    raise ValueError(f'--tokens={tokens}: a KV cache of {total} tokens takes {need / 2**30:.1f} '
                     f'GiB, more than the {have / 2**30:.1f} GiB available')
  if total > train_len:
    log.warning(f'{prompt_len} prompt + {tokens} new tokens run past the {train_len} tokens '
                'the model was trained on')


def sample_text(workdir: str, prompt: str, tokens: int, temperature: float, seed: int,
                num_loops: int | None = None, step: int | None = None,
                scale_passes: str | None = None, kv_cache: str | None = None) -> str:
  """Text continuing `prompt` from a checkpoint (a workdir or a run.Loaded); `scale_passes`
  and `kv_cache` override the model's model.scale_passes and model.kv_cache (decoding options:
  the same params)."""
  run = as_loaded(workdir, step)
  cfg, params, bias = run.model_cfg, run.params, run.router_bias
  if scale_passes:
    cfg = cfg.replace(scale_passes=scale_passes)
  if kv_cache:
    cfg = cfg.replace(kv_cache=kv_cache)
  check_loops(cfg, num_loops)
  if tokens < 1:
    raise ValueError(f'--tokens={tokens}: must be >= 1')
  data_cfg = run.exp.data
  tok = pipeline.data_tokenizer(data_cfg)
  if tok is None:
    raise ValueError(f'{run.workdir}: the tokenizer of its training data '
                     f'({pipeline.tokenizer_spec(data_cfg)!r}) cannot be loaded')
  if not prompt:
    raise ValueError('--prompt is empty')
  ids = tok.encode(prompt)[None, :]
  back = tok.decode(np.asarray(ids[0]))
  if ids.size == 0:
    raise ValueError(f'--prompt={prompt!r}: the tokenizer {tok.name!r} encodes none of it')
  if back != prompt:  # unknown characters dropped (or a normalising tokenizer)
    log.warning(f'--prompt={prompt!r} reads back as {back!r} through the tokenizer '
                f'{tok.name!r}')
  _check_length(cfg, ids.shape[1], tokens, data_cfg.seq_len, num_loops)
  out = generate(cfg, params, ids, tokens, jax.random.key(seed), temperature=temperature,
                 num_loops=num_loops, router_bias=bias, runtime=run.runtime)
  return tok.decode(np.asarray(out[0]))
