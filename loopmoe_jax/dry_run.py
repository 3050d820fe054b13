"""Ahead-of-time check of a config on a target mesh: lower and compile the train step from
abstract shapes (no arrays are made), then read per-device bytes and collective traffic.

    report = dry_run(config_dict, platform='tpu')   # on as many fake CPU devices as the mesh

Library, not an application, so it stays beside aot.py: the program-reading functions here
(job_of, partitioned_compile, classify, step_flops, analytic_flops,
remat_policies) are what aot.py (the real-compiler dry run), fit.py, bench/memory.py and
bench/scale.py build on; the application is scripts/dry_run.py, a thin script over them.

Per device: parameter and optimizer-state bytes (their shardings' shard shapes, and the
parameters by group), temporaries (the memory analysis of the program compiled for this CPU,
labelled so: XLA:CPU's buffers, not a TPU's or GPU's).

Collectives per train step are read from the program the target platform would run, as the
SPMD partitioner leaves it (XLA's dump after `spmd-partitioning`): the dtypes the program
sends (XLA:CPU's later passes widen bfloat16 collectives to float32; this is before them),
collectives over single-device groups skipped, and ops inside while loops (the scan over
passes, gradient accumulation) counted once per iteration (trip counts read off the loop
conditions). For `tpu`/`cuda` that program has the ragged expert exchange; it is compiled for
this CPU only as far as the partitioner (XLA:CPU cannot emit a ragged all-to-all), and the same
step is lowered for the platform with its Pallas kernels compiled, not interpreted
(`runtime.Runtime.for_platform`): its Mosaic / Triton calls are counted. For `cpu` the
figures are the CPU program's (the padded exchange). Bytes of a collective: its result's bytes;
a ragged all-to-all moves at most min(operand, result) rows, counted so.

Analytic column (`analytic_collective_bytes_per_step`), what the model and mesh require, per
device and step (V MoE visits: MoE layers of prelude and coda once, the core's L times; M =
local tokens x k routed rows of width d_model in the compute dtype; R = 1 with no remat or a
policy that saves the exchange's rows (full_keep_exchange, pass_input, attention, named), else
2: every layer is rematerialised, prelude and coda too; with token chunks
(run.expert_block_rows) each chunk reruns its exchange in its backward: R = 2, `exchange_forwards`):
- all-to-all: 2 exchanges (there and back) x (R forward + 1 backward) per visit, M rows each;
  by token rows (run.exchange_rows='token') M = local tokens x min(k, expert devices) pairs,
  plus the pairs' routing (2k float32 each) with every send, and the return trip skipped by
  the reruns that only feed a backward (`exchanges`);
  `all-to-all-uniform`: the token rows' figure for the rows a token sends on average when its
  experts fall on the devices alike (`touched_devices`: 4.86 of 8 for top-7), where the
  buffers, and the compiled program's count, allow min(k, n);
- activation all-gather: 0 (routing and lookups are local);
- gradient reduction: every parameter's gradient reduced once into its sharding: one
  reduce-scatter per parameter whose result is the device's shard, i.e. the per-device
  parameter bytes (an all-reduce of a partial sum counts its larger result: the measured
  figure exceeds this one by that, and by any reduction repeated per pass).
Classification of all-gathers: a parameter gather's result has a parameter's shape (or a
per-pass / per-layer slice of one), or that shape still split over some of the axes the
parameter is sharded over; the expert
exchange's own counts gather (scope `permute`, [n, E] integers) is reported apart; every other
all-gather gathers activations (`act_allgather_bytes_per_step`, 0 expected). Gradient
reductions: all-reduce / reduce-scatter ops in the backward pass (`transpose(` in their op name)
whose result has a parameter's (or a parameter slice's) shape, and floating point.
XLA:CPU's partitioner leaves the gradient of a weight used on the whole batch (embedding,
head, prelude and coda weights) as an all-reduce of the full gradient followed by a slice;
GPU/TPU pipelines rewrite that pair into a reduce-scatter (not checked here), so for those
weights the measured bytes are the all-reduce's, up to the device count above a
reduce-scatter's.
"""
from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax import chunks, sharding
from loopmoe_jax.hlo import collective_bytes, collectives, dot_flops
from loopmoe_jax.config import EXCHANGE_KEPT_REMAT, LAYERWISE_REMAT, RUN_FIELDS
from loopmoe_jax.experiment import build
from loopmoe_jax.job import Job
from loopmoe_jax.runtime import Runtime
from loopmoe_jax.train import compile_cache, depth

PLATFORMS = ('cpu', 'tpu', 'cuda')
def step_flops(cfg_dict, num_devices: int | None = None) -> int:
  """Matmul FLOPs of the config's train step per device: the step lowered for one device
  (`dot_flops` of its HLO) over the mesh's devices. Lowered with the 'xla' dispatch (one
  ragged-dot per grouped matmul: exactly the routed rows, where the tiled dispatch loops over a
  data-dependent number of tiles) and chunked attention (the fused kernels' FLOPs are inside
  custom calls), for TPU (where ragged-dot stays one op); nothing is compiled. The mesh's
  device count: `num_devices` (a target's), default this process's devices."""
  exp = build(cfg_dict)
  devices = exp.mesh.sizes(num_devices or len(jax.devices()))
  devices = int(np.prod(list(devices.values())))
  one = _with_model(cfg_dict, dispatch='xla', attention_impl='chunked')
  one['mesh'] = {'data': 1}
  job = job_of(one, jax.devices()[:1], Runtime.for_platform('tpu'))
  text = job.train_step().lower(*job.step_args(), platform='tpu').compiler_ir('hlo').as_hlo_text()
  return dot_flops(text) // devices


def analytic_flops(exp, mesh) -> int:
  """Training FLOPs per device and step: the trainer's per-token count
  (depth.step_flops_per_token: 6 x N_active per token plus attention's 12 x context x heads x
  head dim per executed layer, accounting.py's convention, no causal discount; the gate's
  readouts and truncated backprop as the run sets them) x the batch's tokens, over the
  devices."""
  L = exp.model.num_loops
  per_token = depth.step_flops_per_token(exp.model, exp.data.seq_len, L,
                                         depth.backprop(exp.train, L))
  return int(per_token * exp.data.batch_size * exp.data.seq_len // mesh.size)


def _param_dims(params) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(shape, split factor per dimension) of each param and of its trailing slices (one pass /
  layer of a stacked weight): a parameter gather yields such a shape with each dimension
  divided by a divisor of its split factor (gathered over some of its axes, or all)."""
  out = set()
  for leaf in jax.tree.leaves(params):
    shape = tuple(leaf.shape)
    split = tuple(a // b for a, b in zip(shape, leaf.sharding.shard_shape(shape)))
    for start in range(len(shape)):
      out.add((shape[start:], split[start:]))
  return out


def _is_param_shape(dims, param_dims) -> bool:
  for shape, split in param_dims:
    if len(shape) == len(dims) and all(
        d and q % d == 0 and f % (q // d) == 0 for q, d, f in zip(shape, dims, split)):
      return True
  return False


def _backward(op_name: str) -> bool:
  """A reduction of the backward pass: XLA's partitioning of a transposed op, or a shard_map's
  transpose (the sum of a replicated input's cotangent, named 'psum', or the reduce-scatter
  that transposes the core's weight gather)."""
  return ('transpose(' in op_name or op_name.split('/')[-1] == 'psum' or
          op_name.endswith('gather_core_weights/reduce_scatter'))


def classify(colls, params) -> dict[str, int]:
  """{'act_allgather', 'param_allgather', 'exchange_counts', 'grad_reduce', 'grad_reduce_ops'}:
  bytes per step (ops per step for the last), by the rules of the module docstring."""
  pdims = _param_dims(params)
  out = collections.Counter()
  for c in colls:
    total = c['times'] * c['bytes']
    if c['kind'] == 'all-gather':
      if 'permute/' in c['op_name'] and all(dt.startswith('s') for dt, _ in c['shapes']):
        out['exchange_counts'] += total
      elif all(_is_param_shape(d, pdims) for _, d in c['shapes']):
        out['param_allgather'] += total
      else:
        out['act_allgather'] += total
    elif c['kind'] in ('all-reduce', 'reduce-scatter') and _backward(c['op_name']):
      if any(dt.startswith(('f', 'bf')) and _is_param_shape(d, pdims) for dt, d in c['shapes']):
        out['grad_reduce'] += total
        out['grad_reduce_ops'] += c['times']
  return {k: int(out[k]) for k in ('act_allgather', 'param_allgather', 'exchange_counts',
                                   'grad_reduce', 'grad_reduce_ops')}


def check_platform(platform: str):
  """An error naming --platform and the fix when the installed jax cannot lower for it."""
  if platform not in PLATFORMS:
    raise ValueError(f'--platform={platform!r}: must be one of {", ".join(PLATFORMS)}')
  try:
    jax.jit(lambda x: x + 1).trace(jax.ShapeDtypeStruct((), jnp.float32)).lower(
        lowering_platforms=(platform,))
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'--platform={platform}: jax {jax.__version__} here cannot lower for it '
                     f'({type(e).__name__}: {str(e)[:200]}); use --platform=cpu or a jax '
                     f'that has the {platform} lowering') from None


def job_of(cfg_dict, devices=None, runtime: Runtime | None = None) -> Job:
  """The config's Job on its mesh (over `devices`, default all), built for `runtime`'s
  platform (default: this machine)."""
  return Job.build(build(cfg_dict), devices, runtime)


def partitioned_compile(lowered):
  """(HLO text after SPMD partitioning, the compiled CPU program or None): compiles for this
  CPU with XLA's dump of that pass; a program XLA:CPU cannot finish (the ragged exchange)
  still yields the partitioned module."""
  with tempfile.TemporaryDirectory() as tmp, compile_cache.off():
    compiled, error = None, None
    try:
      compiled = lowered.compile(compiler_options={
          'xla_dump_to': tmp, 'xla_dump_hlo_pass_re': 'spmd-partitioning'})
    except Exception as e:  # pylint: disable=broad-except
      error = e
    files = glob.glob(os.path.join(tmp, '*after_spmd-partitioning*.txt'))
    if not files and compiled is not None and len(compiled.input_shardings[0]) and all(
        len(s.device_set) == 1 for s in jax.tree.leaves(compiled.input_shardings)):
      # one device: XLA runs no partitioner; its module before optimisation is the same
      files = glob.glob(os.path.join(tmp, '*before_optimizations.txt'))
    if not files:
      if error is not None:
        raise error
      raise RuntimeError('XLA wrote no module after spmd-partitioning')
    with open(max(files, key=os.path.getsize)) as f:
      return f.read(), compiled


def _with_model(cfg_dict, **fields):
  """A copy of the config with `fields` set in section `run` (a run setting) or `model`."""
  cfg = cfg_dict.copy_and_resolve_references() if hasattr(cfg_dict, 'copy_and_resolve_references') \
      else dict(cfg_dict)
  for k, v in fields.items():
    cfg['run' if k in RUN_FIELDS and 'run' in cfg else 'model'][k] = v
  return cfg


def _chunked(mc, run, n: int, tokens: int, num_experts: int) -> bool:
  """Whether the exchange runs in token chunks: assignment rows on a dropless exchange whose
  receive buffer exceeds run.expert_block_rows (token rows chunk only their experts)."""
  return (run.exchange_unit != 'token' and not mc.capacity_factor and
          not mc.exchange_buffer_factor and
          chunks.token_chunks(tokens, mc.top_k, num_experts, n, run.ffn_block_rows) > 1)


def exchange_forwards(mc, run, n: int, tokens: int, num_experts: int) -> int:
  """R, the forward exchanges of one MoE visit (module docstring) for `tokens` per device and
  call (the architecture `mc`, the run settings `run`): 1 where the backward keeps the
  exchanged rows, 2 where the layer's recompute repeats them. With token chunks
  (chunks.token_chunks > 1) each chunk reruns its exchange in its own backward (2): under
  full each layer is its own checkpoint, whose backward reads no expert output, and
  pass_input and attention keep the expert output, so no recompute adds an MoE forward."""
  if _chunked(mc, run, n, tokens, num_experts):
    return 2
  return 1 if run.remat in EXCHANGE_KEPT_REMAT else 2


def exchanges(mc, run, n: int, tokens: int, num_experts: int, last: bool = False):
  """(sends, returns) of one MoE visit: R + 1 of each (`exchange_forwards`), except that by
  token rows no backward reads what the return trip delivered (the weights were applied where
  the experts ran), so a stack's recompute of its last layer, which only feeds a backward,
  skips it."""
  f = exchange_forwards(mc, run, n, tokens, num_experts)
  if run.exchange_unit != 'token':
    return f + 1, f + 1
  return f + 1, f + (0 if last and run.remat not in EXCHANGE_KEPT_REMAT else 1)


def analytic(exp, mesh, params) -> dict[str, int]:
  """The analytic column (formulas in the module docstring)."""
  mc = exp.model
  n_batch = sharding.batch_size_of(mesh)
  local_tokens = exp.data.batch_size * exp.data.seq_len // n_batch
  act = np.dtype(jnp.dtype(mc.dtype)).itemsize
  a2a, n = 0, mesh.shape['expert']
  limit = mc.max_expert_devices if mc.max_expert_devices and mc.expert_devices == n else n
  rows = local_tokens * (min(mc.top_k, n, limit) if exp.run.exchange_unit == 'token'
                         else mc.top_k)
  row = rows * mc.d_model * act
  there = row + (rows * 2 * mc.top_k * 4 if exp.run.exchange_unit == 'token' else 0)
  call_tokens = local_tokens // exp.train.microbatches  # the tokens one MoE call sees
  alone = exp.run.remat in LAYERWISE_REMAT  # each layer its own checkpoint (full)
  if n > 1:
    for _, layers, experts, passes in mc.segments:
      if experts:  # a segment's pass is one remat stack (its last layer apart), or under
        # full each layer counts as a stack's last
        counts = [exchanges(mc, exp.run, n, call_tokens, experts, alone or i == layers - 1)
                  for i in range(layers)]
        a2a += passes * sum(s * there + r * row for s, r in counts)
  grads = sharding.bytes_per_device(params, jax.tree.map(lambda s: s.sharding, params))
  uniform = a2a
  if exp.run.exchange_unit == 'token' and n > 1:
    uniform = int(a2a * touched_devices(mc.top_k, n, min(limit, n)) / min(mc.top_k, n, limit))
  return {'all-to-all': a2a, 'all-to-all-uniform': uniform, 'act-all-gather': 0,
          'grad-reduce': grads}


def touched_devices(k: int, n: int, limit: int = 0) -> float:
  """The devices a token's k experts lie on, on average, when each choice falls on any of
  n devices (or of its `limit` allowed ones) alike: d (1 - (1 - 1/d)^k), d = limit or n. The
  token-row exchange sends that many rows a token where its buffers allow min(k, n)."""
  d = min(limit, n) if limit else n
  return d * (1 - (1 - 1 / d) ** k)


def param_groups(params) -> dict[str, int]:
  """Per-device bytes by group: segment (embed, prelude, core, coda, head, ...) x kind
  (experts, router, attention, other)."""
  out = collections.Counter()
  for path, s in jax.tree_util.tree_leaves_with_path(params):
    keys = [str(getattr(k, 'key', k)) for k in path]
    kind = ('experts' if keys[-1] in ('gate', 'up', 'down') and 'moe' in keys and
            'shared' not in keys else 'router' if keys[-1] == 'router' else
            'attention' if any('attn' in k or 'attention' in k for k in keys) else 'other')
    shard = s.sharding.shard_shape(s.shape)
    out[f'{keys[0]}/{kind}'] += int(np.prod(shard, dtype=np.int64)) * np.dtype(s.dtype).itemsize
  return dict(sorted(out.items()))


def memory_and_flops(cfg_dict, devices=None, flops: bool = True) -> dict:
  """{'temp_bytes_per_device', 'flops_per_step_per_device', 'analytic_flops_per_step_per_device',
  'flops_over_analytic'}: temporaries of the train step compiled for this CPU (mesh over
  `devices`), FLOPs by `step_flops` (not with `flops=False`: the temporaries alone)."""
  job = job_of(cfg_dict, devices)
  exp, mesh = job.exp, job.mesh
  compiled = job.train_step().lower(*job.step_args()).compile()
  mem = compiled.memory_analysis()
  out = {'temp_bytes_per_device': int(getattr(mem, 'temp_size_in_bytes', 0)) if mem else None}
  if flops:
    n, analytic_f = step_flops(cfg_dict), analytic_flops(exp, mesh)
    out.update(flops_per_step_per_device=n, analytic_flops_per_step_per_device=analytic_f,
               flops_over_analytic=round(n / analytic_f, 4))
  return out


def remat_policies(cfg_dict, policies, devices=None, flops: bool = True) -> dict[str, dict]:
  """`memory_and_flops` per run.remat policy (one CPU compile each)."""
  return {p: memory_and_flops(_with_model(cfg_dict, remat=p), devices, flops) for p in policies}


def dry_run(cfg_dict, platform: str = 'cpu') -> dict:
  check_platform(platform)
  job = job_of(cfg_dict)
  exp, mesh, state = job.exp, job.mesh, job.abstract_state
  cpu_hlo, compiled = partitioned_compile(job.train_step().lower(*job.step_args()))
  mem = compiled.memory_analysis()
  flops, analytic_f = step_flops(cfg_dict), analytic_flops(exp, mesh)
  report_hlo, lowered_for = cpu_hlo, None
  if platform != 'cpu':
    runtime = Runtime.for_platform(platform)
    # what the platform runs, lowered for it (Pallas kernels compiled)
    job_p = job_of(cfg_dict, runtime=runtime)
    text = job_p.train_step().lower(*job_p.step_args(), platform=platform).as_text()
    # the same program for the partitioner here: XLA's grouped matmul in place of the
    # kernels (no collective in either), the exchange the platform uses
    # (and chunked attention for the platform's fused kernel: neither has a collective)
    job_x = job_of(_with_model(cfg_dict, dispatch='xla', attention_impl='chunked'),
                   runtime=runtime)
    report_hlo, _ = partitioned_compile(job_x.train_step().lower(*job_x.step_args()))
    lowered_for = {'platform': platform, 'custom_calls': text.count('stablehlo.custom_call'),
                   'ragged_all_to_all': text.count('ragged_all_to_all')}
  colls = collectives(report_hlo)
  coll = collective_bytes(colls)
  kinds = classify(colls, state['params'])
  per_dev = lambda tree: sharding.bytes_per_device(tree, jax.tree.map(lambda s: s.sharding, tree))
  total = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
              for s in jax.tree.leaves(state['params']))
  return {
      'devices': mesh.size,
      'platform': platform,
      'mesh': {a: int(n) for a, n in mesh.shape.items()},
      'params_bytes_total': total,
      'params_bytes_per_device': per_dev(state['params']),
      'params_bytes_per_device_by_group': param_groups(state['params']),
      'opt_state_bytes_per_device': per_dev(state['opt_state']),
      'temp_bytes_per_device': int(getattr(mem, 'temp_size_in_bytes', 0)) if mem else None,
      'temp_bytes_program': 'cpu proxy (XLA:CPU buffers of the CPU program)',
      'flops_per_step_per_device': flops,
      'analytic_flops_per_step_per_device': analytic_f,
      'flops_over_analytic': round(flops / analytic_f, 4),
      'remat': exp.run.remat,
      'attention_impl': exp.run.attention_impl,
      'collective_bytes_per_step': coll,
      'collective_bytes_program': f'{platform}, after SPMD partitioning (its dtypes)',
      'act_allgather_bytes_per_step': kinds['act_allgather'],
      'param_allgather_bytes_per_step': kinds['param_allgather'],
      'grad_reduce_bytes_per_step': kinds['grad_reduce'],
      'grad_reduce_ops_per_step': kinds['grad_reduce_ops'],
      'analytic_collective_bytes_per_step': analytic(exp, mesh, state['params']),
      'lowered_for': lowered_for,
      'batch': [exp.data.batch_size, exp.data.seq_len],
      'expert_exchange': 'padded' if platform == 'cpu' else 'ragged',
  }
