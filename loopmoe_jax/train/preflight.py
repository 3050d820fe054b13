"""Pre-flight memory check: before anything is compiled, a lower bound on the bytes one device
needs for a train step against the memory it has.

Per device (shard shapes of the abstract train state, `sharding.bytes_per_device`):
  parameters + optimizer state + one gradient of the parameters
  + activations kept for the backward, at least (`layer_bytes`, over the device's tokens of one
    microbatch): with run.remat='none' each executed layer's inputs, attention q, k, v and
    output, routed rows and SwiGLU intermediates (and the 'xla' attention's probabilities);
    with a remat policy each rematerialised stack's input (the prelude, every core pass, the
    coda) plus one stack's recompute;
  + with model.exit='gate', every pass's core state and (without remat) the early passes'
    coda visits that gate training's readouts keep.
This is a floor (attention scores, expert buffers and the optimizer update come on top), so a
config it refuses cannot fit; one it passes may still not (scripts/dry_run.py measures). The
device's memory: its `memory_stats()['bytes_limit']` on GPU/TPU (else its chip's memory in
targets.CHIPS, by device kind); on CPU the host's available
memory shared by the local devices. The trainer skips the check with --force.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from loopmoe_jax import dispatch, sharding, targets
from loopmoe_jax.attention_impls import resolve
from loopmoe_jax.dispatch import resolve_backend
from loopmoe_jax.train import depth


def device_memory_bytes(device=None, sharing: int | None = None) -> int | None:
  """Bytes one device can hold (None when unknown): its allocator's limit; on CPU the host's
  available memory over the `sharing` devices that use it (default: every local device)."""
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  (not every backend has stats)
    stats = None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  if device.platform != 'cpu':  # no allocator stats: the chip's row (targets.CHIPS)
    chip = targets.chip_of_kind(device.device_kind)
    return chip.hbm_bytes // targets.devices_per_chip(jax.devices()) if chip else None
  available = None
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          available = int(line.split()[1]) * 1024
  except OSError:
    pass
  if available is None:
    try:
      available = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError, AttributeError):
      return None
  return available // max(1, sharing or len(jax.local_devices()))


def layer_bytes(mc, runtime, tokens: int, seqs: int, seq_len: int, experts: int) -> int:
  """A floor on what one layer of the architecture `mc` on `runtime` (its run settings) keeps for
  its backward without remat, per device: in the compute
  dtype its input and normed input [tokens, d], q, k, v and the attention output
  [tokens, (2H + 2G) x K], and the routed rows' input and SwiGLU gate, up and product
  [tokens x k, d + 3F] (the 'tiled' dispatch's rounded up to whole `dispatch_tile`s; a dense
  layer: [tokens, 3F]); with the 'xla' attention also its float32 probabilities
  [seqs, H, T, T]."""
  run = runtime.run
  act = np.dtype(mc.dtype).itemsize
  width = 2 * mc.d_model + (2 * mc.num_heads + 2 * mc.kv_heads) * mc.resolved_head_dim
  rows, ffn = 0, 3 * mc.expert_width
  if experts:
    rows = tokens * mc.top_k
    # the tiled dispatch's buffers hold whole tiles of rows
    if resolve_backend(run.dispatch, runtime=runtime) == 'tiled':
      rows = -(-rows // run.dispatch_tile) * run.dispatch_tile
    ffn = 0
  scores = 4 * seqs * mc.num_heads * seq_len * seq_len if resolve(
      run.attention_impl, mc.dtype) == 'xla' else 0
  return (tokens * (width + ffn) + rows * (mc.d_model + 3 * mc.expert_width)) * act + scores


def estimate(exp, mesh, state) -> dict:
  """The lower bound's terms in bytes per device, and what drives the activations."""
  mc, dc, runtime = exp.model, exp.data, dispatch.settle(exp.runtime())
  per_dev = lambda tree: sharding.bytes_per_device(tree, jax.tree.map(lambda s: s.sharding, tree))
  params = per_dev(state['params'])
  seqs = max(1, dc.batch_size // sharding.batch_size_of(mesh) // exp.train.microbatches)
  tokens = seqs * dc.seq_len
  # a run drawing its pass counts is sized at the largest count it may draw; with truncated
  # backprop the backward keeps only the last train.backprop_loops passes (core.Core)
  high = exp.train.loops_bounds(mc.num_loops)[1] if exp.train.sampled else mc.num_loops
  core_passes = depth.backprop(exp.train, high) or (high if exp.train.sampled else None)
  layers = {seg: (n, core_passes if seg == 'core' and core_passes else passes,
                  layer_bytes(mc, runtime, tokens, seqs, dc.seq_len, experts))
            for seg, n, experts, passes in mc.segments}
  if exp.run.remat == 'none':  # every executed layer keeps its set
    per_seg = {seg: n * passes * b for seg, (n, passes, b) in layers.items()}
  else:  # each stack (prelude, a core pass, coda) keeps its input; one stack is recomputed
    act = np.dtype(mc.dtype).itemsize
    per_seg = {seg: passes * tokens * mc.d_model * act for seg, (n, passes, b) in layers.items()}
    per_seg['recompute'] = max(n * b for n, _, b in layers.values())
  if mc.exit == 'gate' and 'core' in layers:  # gate training: every pass's state, and the
    # early passes' coda visits (early_exit.pass_outputs), are kept for the backward
    n_coda, _, coda_b = layers.get('coda', (0, 0, 0))
    passes = layers['core'][1]
    per_seg['exit_readouts'] = passes * tokens * mc.d_model * np.dtype(mc.dtype).itemsize + (
        (passes - 1) * n_coda * coda_b if exp.run.remat == 'none' else 0)
  activations = sum(per_seg.values())
  return {'params': params, 'optimizer': per_dev(state['opt_state']), 'gradients': params,
          'activations': activations, 'core_activations': per_seg.get('core', 0),
          'tokens': tokens}


def check_memory(exp, mesh, state, budget: int | None = None) -> dict:
  """Raises a ValueError naming the key that drives the need when the lower bound exceeds
  `budget` (default: `device_memory_bytes()` shared by the mesh's devices); returns the
  estimate."""
  est = estimate(exp, mesh, state)
  if budget is None:  # on CPU the host's memory serves the mesh's devices only
    budget = device_memory_bytes(sharing=min(mesh.size, len(jax.local_devices())))
  need = est['params'] + est['optimizer'] + est['gradients'] + est['activations']
  if budget is None or need <= budget:
    return est
  gib = lambda b: f'{b / 2**30:,.1f} GiB'
  mc, dc = exp.model, exp.data
  # what one pass of the core would need: the passes drive it when that would fit
  one_pass = need - est['core_activations'] * (1 - 1 / mc.num_loops)
  if est['activations'] >= need / 2:
    if one_pass <= budget and mc.num_loops > 1:
      key = (f'model.num_loops={mc.num_loops} ({mc.executed_layers:,} executed layers); lower '
             'it')
    else:
      key = (f'data.batch_size={dc.batch_size} x data.seq_len={dc.seq_len} ({est["tokens"]:,} '
             'tokens per device); lower them, raise train.microbatches or use run.remat')
  else:
    key = ('the model\'s size: shard it over more devices (mesh.fsdp, mesh.expert) or '
           'shrink model.d_model / model.*_experts')
  raise ValueError(
      f'pre-flight memory check: a train step needs at least {gib(need)} per device '
      f'(parameters {gib(est["params"])}, optimizer {gib(est["optimizer"])}, gradients '
      f'{gib(est["gradients"])}, activations >= {gib(est["activations"])}) but a device has '
      f'{gib(budget)}; it is driven by {key} (or pass --force to scripts/train.py to skip '
      'this check)')
