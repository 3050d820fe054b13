"""`benchmark.py memory`: what attention, the loss and each remat policy hold, read from programs
compiled for this CPU (XLA's memory analysis: temporaries, the buffers that are neither
arguments nor outputs; FLOPs from the HLO's matmuls with loop trip counts, hlo.dot_flops).
Nothing is run: shapes are abstract, so full sizes compile on a laptop.

- attn_temp_T4096_over_T1024: one attention layer's forward+backward (q, k, v -> output, the
  gradients of q, k and v; Foil's 16 heads of 64, bfloat16) at 1 x 4,096 tokens over 4 x 1,024
  (the same tokens per batch), `chunked` (run.attention_block 512); `_xla` the einsum's.
- attn_skip_over_all: seconds of that attention's forward+backward at 1 x 4,096 with the
  block pairs whose keys all follow their queries skipped (the default) over computing them
  (informative; about half the pairs of a causal sequence).
- loss_temp_over_logits: the LM loss's forward+backward on the final hidden states (head matmul,
  log-softmax, target log-probability; gradients of the hidden states and the head) at Foil's
  2 x 4,096 tokens, width 1,024, vocabulary 49,152, over the bytes of the float32 logits
  [B, T, V], with run.loss_chunk=1024 (vocabulary columns per chunk); `_whole` without.
- remat_temp_over_none.<policy>, remat_flops_over_none.<policy>: Foil-2's train step (configs/
  foil.py:foil2, one device, 2 sequences of 4,096, `chunked` attention, run.loss_chunk=1024)
  per run.remat policy,
  temporaries and matmul FLOPs over those with remat 'none'. remat_best: the policy with the
  least temporaries among those recomputing less than 'full' (FLOPs below full's), and its
  temp ratio as remat_best_temp_over_none (its FLOPs ratio: remat_best_flops_over_none).
  remat_act_temp_over_none.<policy>: the same ratio for the temporaries that grow with the
  tokens (each policy's temporaries at 2 x 4,096 less its own at 1 x 128: what is left is
  weight-sized, gradients, the core's gradient accumulator, compute-dtype copies of the
  weights and the optimizer update, about 4.6 GiB for Foil-2 on one device).
- {tpu,cuda}_remat_temp_over_none.<policy>, {tpu,cuda}_remat_flops_over_none.<policy>,
  {tpu,cuda}_hbm_fraction.<policy>: the same per policy on the accelerators' own compilers
  (aot.py; each where its extra is installed, else absent and `real_compilers` says so): Foil-2
  on v5p-128 (fsdp=8 x expert=8, batch 128) and on 8 x H200 (expert=8, batch 96), remat none,
  attention, pass_input and full, run settings otherwise at defaults (splash / cuDNN
  attention, Pallas dispatch, the pod compiler preset); FLOPs are the step's matmuls
  (dry_run.step_flops), bytes the compiled program's. {tpu,cuda}_remat_best: the policy with the
  least temporaries among those within 1.2x none's FLOPs; `tpu_compile_s` the v5p-128 step's
  compile (read from the compile cache when it was compiled before: `tpu_compile_cached`).
  `--quick`: Foil-2 smoke on v5p:2x2x1 and 8 x H100.
- tpu_temp_over_maxtext.{none,full}: that v5p-128 compile's temporaries per chip with remat
  none / full over MaxText's for the same executed shape with its remat_policy none / full
  (MAXTEXT_TEMP_BYTES: docs/maxtext_reference.md, which also says why only `full` compares
  like with like: MaxText recomputes every layer under both). Absent with --quick.
  tpu_temp_over_maxtext.none_bounded: the same `none` step (no layer recomputed) with the
  expert exchange's buffers bounded at the balanced share and replay (BOUNDED_NONE:
  model.exchange_buffer_factor=1, exchange_overflow='replay', so a step that drops a row
  reruns dropless under `full` inside the same program and the losses are the dropless ones)
  and the chunked attention, over MaxText's `none`.
- step_chunked_over_xla: train-step time of the README's main job (configs/default.py, 16 x 128
  tokens) with attention `chunked` over `xla`, timed interleaved (informative).

`--quick` uses small widths and lengths (a smoke run; its ratios are not the targets').
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from loopmoe_jax import aot, dry_run, targets
from loopmoe_jax.attention import attend
from loopmoe_jax.attention_impls import chunked_attend
from loopmoe_jax.bench import (FAST_COMPILE, _batch, register, step_seconds,
                               time_interleaved)
from loopmoe_jax.config import REMAT_POLICIES
from loopmoe_jax.experiment import build, load_config
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.objective import head_nll

_sd = jax.ShapeDtypeStruct


def _temp_bytes(fn, *args) -> int:
  compiled = jax.jit(fn).lower(*args).compile(FAST_COMPILE)
  return int(compiled.memory_analysis().temp_size_in_bytes)


def attention_temp(impl: str, batch: int, seq: int, heads: int, head_dim: int,
                   block: int = 512) -> int:
  """Temporaries of causal attention's forward+backward (grads of q, k, v)."""
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  att = (lambda q, k, v: chunked_attend(q, k, v, pos, pos, block)) if impl == 'chunked' else (
      lambda q, k, v: attend(q, k, v, pos, pos))
  loss = lambda q, k, v: jnp.sum(att(q, k, v).astype(jnp.float32))
  x = _sd((batch, seq, heads, head_dim), jnp.bfloat16)
  return _temp_bytes(jax.grad(loss, argnums=(0, 1, 2)), x, x, x)


def attention_seconds(seq: int, heads: int, head_dim: int, block: int,
                      repeats: int) -> dict[bool, float]:
  """Median seconds of chunked attention's forward+backward on one sequence (bfloat16) with
  the fully masked block pairs skipped (True) and computed (False), timed interleaved."""
  pos = jnp.arange(seq, dtype=jnp.int32)[None]
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, seq, heads, head_dim), jnp.bfloat16) for key in keys)
  thunks = {}
  for skip in (True, False):
    loss = lambda q, k, v, skip=skip: jnp.sum(
        chunked_attend(q, k, v, pos, pos, block, skip).astype(jnp.float32))
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    thunks[skip] = lambda fn=fn: fn(q, k, v)
  return time_interleaved(thunks, repeats)


def loss_temp(batch: int, seq: int, width: int, vocab: int, chunk: int) -> int:
  """Temporaries of the LM loss's forward+backward from hidden states (grads of h and head)."""
  fn = jax.grad(lambda h, w, t: head_nll(h, w, t, None, chunk)[0], argnums=(0, 1))
  return _temp_bytes(fn, _sd((batch, seq, width), jnp.bfloat16), _sd((width, vocab), jnp.float32),
                     _sd((batch, seq), jnp.int32))


def remat_rows(quick: bool, batch: int = 2, seq: int | None = None,
               flops: bool = True) -> dict[str, dict]:
  """dry_run.memory_and_flops per remat policy on Foil-2 at `batch` x 4,096 (quick: smoke
  widths, x 256), one device, chunked attention, the chunked loss."""
  arg = 'foil2,smoke' if quick else 'foil2'
  cfg = load_config(f'configs/foil.py:{arg}')
  cfg.data.batch_size, cfg.data.seq_len = batch, seq or (256 if quick else 4096)
  cfg.run.attention_impl = 'chunked'
  cfg.run.attention_block = 128 if quick else 512
  cfg.run.loss_chunk = 256 if quick else 1024
  cfg.mesh.data = 1
  return dry_run.remat_policies(cfg, REMAT_POLICIES, jax.devices()[:1], flops)


REAL_POLICIES = ('none', 'attention', 'pass_input', 'full')
# MaxText's temporaries per chip, Foil-2's executed shape on v5p-128, by its remat_policy
# (measured reference: docs/maxtext_reference.md)
MAXTEXT_TEMP_BYTES = {'none': 12.2 * 2**30, 'full': 3.46 * 2**30}
# Foil-2's `none` step with no worst-case exchange buffer kept (see the module docstring)
BOUNDED_NONE = {'run.remat': 'none', 'model.exchange_buffer_factor': 1.0,
                'model.exchange_overflow': 'replay', 'run.attention_impl': 'chunked'}
REAL_SHAPES = {  # platform -> (target, quick target, mesh, global batch)
    'tpu': ('v5p-128', 'v5p:2x2x1', dict(data=1, fsdp=8, expert=8), 128),
    'cuda': ('h200x8', 'h100x8', dict(data=1, expert=8), 96)}


def real_compiler_rows(quick: bool) -> dict[str, Any]:
  """The `{tpu,cuda}_remat_*` keys (module docstring) for each platform whose extra is here."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  res: dict[str, Any] = {'real_compilers': {}}
  for platform, (name, quick_name, mesh, batch) in REAL_SHAPES.items():
    if importlib.util.find_spec(targets.EXTRAS[platform][0]) is None:
      res['real_compilers'][platform] = f'not installed ({targets.EXTRAS[platform][1]})'
      continue
    target = targets.get(quick_name if quick else name)
    cfg = load_config('configs/foil.py:foil2' + (',smoke' if quick else ''))
    mesh = dict(data=1, fsdp=2, expert=2) if quick and platform == 'tpu' else (
        dict(data=2, expert=4) if quick else mesh)
    for k, v in mesh.items():
      cfg.mesh[k] = v
    cfg.data.batch_size = 8 if quick else batch
    rows = {p: aot.candidate(cfg, target, {'run.remat': p}) for p in REAL_POLICIES}
    res['real_compilers'][platform] = target.name
    none = rows['none']
    for p, r in rows.items():
      res[f'{platform}_remat_temp_over_none.{p}'] = (r['temp_bytes_per_device'] /
                                                    none['temp_bytes_per_device'])
      res[f'{platform}_remat_flops_over_none.{p}'] = (r['flops_per_step_per_device'] /
                                                     none['flops_per_step_per_device'])
      res[f'{platform}_hbm_fraction.{p}'] = r['hbm_fraction']
      res[f'{platform}_temp_bytes.{p}'] = r['temp_bytes_per_device']
    within = [p for p in rows if res[f'{platform}_remat_flops_over_none.{p}'] <= 1.2]
    best = min(within, key=lambda p: res[f'{platform}_remat_temp_over_none.{p}'])
    res[f'{platform}_remat_best'] = best
    res[f'{platform}_remat_best_temp_over_none'] = res[f'{platform}_remat_temp_over_none.{best}']
    res[f'{platform}_remat_best_flops_over_none'] = res[f'{platform}_remat_flops_over_none.{best}']
    if platform == 'tpu':
      res['tpu_compile_s'], res['tpu_compile_cached'] = none['compile_s'], none['cached']
      if not quick:
        for p, ref in MAXTEXT_TEMP_BYTES.items():
          res[f'tpu_temp_over_maxtext.{p}'] = rows[p]['temp_bytes_per_device'] / ref
        bounded = aot.candidate(cfg, target, BOUNDED_NONE)
        res['tpu_temp_bytes.none_bounded'] = bounded['temp_bytes_per_device']
        res['tpu_temp_over_maxtext.none_bounded'] = (bounded['temp_bytes_per_device'] /
                                                     MAXTEXT_TEMP_BYTES['none'])
  return res


@register('memory')
def bench_memory(quick: bool = False) -> dict[str, Any]:
  res: dict[str, Any] = {'quick': quick}
  heads, head_dim = (4, 32) if quick else (16, 64)
  long, short = (1024, 256) if quick else (4096, 1024)
  for impl in ('chunked', 'xla'):
    t_long = attention_temp(impl, 1, long, heads, head_dim, 128 if quick else 512)
    t_short = attention_temp(impl, long // short, short, heads, head_dim, 128 if quick else 512)
    suffix = '' if impl == 'chunked' else '_xla'
    res[f'attn_temp_bytes_long{suffix}'], res[f'attn_temp_bytes_short{suffix}'] = t_long, t_short
    res[f'attn_temp_T4096_over_T1024{suffix}'] = t_long / t_short

  secs = attention_seconds(long, heads, head_dim, 128 if quick else 512, 3)
  res['attn_s_skip'], res['attn_s_all'] = secs[True], secs[False]
  res['attn_skip_over_all'] = secs[True] / secs[False]

  b, t, d, v = (2, 512, 64, 4096) if quick else (2, 4096, 1024, 49152)
  logits = b * t * v * 4
  res['logits_bytes'] = logits
  res['loss_temp_over_logits'] = loss_temp(b, t, d, v, 256 if quick else 1024) / logits
  res['loss_temp_over_logits_whole'] = loss_temp(b, t, d, v, 0) / logits

  rows = remat_rows(quick)
  # the temporaries that do not grow with the tokens (weight-sized: gradients, the core's
  # gradient accumulator, compute-dtype weight copies, the optimizer update), read at 1 x 128
  fixed = {p: r['temp_bytes_per_device'] for p, r in remat_rows(quick, 1, 128, flops=False).items()}
  none = rows['none']
  act_none = none['temp_bytes_per_device'] - fixed['none']
  for p, r in rows.items():
    res[f'remat_act_temp_over_none.{p}'] = (r['temp_bytes_per_device'] - fixed[p]) / act_none
    res[f'remat_temp_bytes.{p}'] = r['temp_bytes_per_device']
    res[f'remat_flops.{p}'] = r['flops_per_step_per_device']
    res[f'remat_temp_over_none.{p}'] = r['temp_bytes_per_device'] / none['temp_bytes_per_device']
    res[f'remat_flops_over_none.{p}'] = (r['flops_per_step_per_device'] /
                                          none['flops_per_step_per_device'])
  res['remat_flops_over_analytic_none'] = none['flops_over_analytic']
  full_flops = res['remat_flops_over_none.full']
  cheaper = [p for p in rows if p not in ('none', 'full') and
             res[f'remat_flops_over_none.{p}'] < full_flops]
  best = min(cheaper, key=lambda p: res[f'remat_temp_over_none.{p}']) if cheaper else None
  res['remat_best'] = best
  res['remat_best_temp_over_none'] = res[f'remat_temp_over_none.{best}'] if best else None
  res['remat_best_flops_over_none'] = res[f'remat_flops_over_none.{best}'] if best else None
  res['remat_best_act_temp_over_none'] = (res[f'remat_act_temp_over_none.{best}'] if best
                                          else None)

  res.update(real_compiler_rows(quick))

  exp = build(load_config('configs/default.py'))
  main, rt = exp.model, exp.runtime()
  batch = _batch(main, 4 if quick else 16, 128)
  secs = step_seconds({'chunked': LoopedMoE(main, runtime=rt.with_run(attention_impl='chunked')),
                       'xla': LoopedMoE(main, runtime=rt.with_run(attention_impl='xla'))},
                      batch, 3 if quick else 15,
                      FAST_COMPILE if quick else None)
  res.update(step_s_chunked=secs['chunked'], step_s_xla=secs['xla'],
             step_chunked_over_xla=secs['chunked'] / secs['xla'])
  return res
