"""Expert parallelism inside `jax.shard_map`, and the capacity limit.

Each device holds a shard of the tokens (the batch axes) and E / n of every MoE layer's
experts (the `expert` axis, n devices); the routing (router, top-k, aux losses) has already
run on the global batch outside. Per device:

  permute  sort the T*k assignments by expert (dropped ones last),
  exchange send each row to the device that holds its expert (all_to_all over `expert`),
  regroup  order the received rows by local expert,
  grouped matmul  the local experts' SwiGLU with the model's dispatch backend
           (`dispatch.grouped_ffn`; expert width sharded over `tensor`, summed at the end),
  exchange back, unpermute, combine with the routing weights.

What a row is (`run.exchange_rows`, resolved by `RunConfig.exchange_unit`): 'token' sends a token's hidden state once
to each device holding one of its experts and combines that device's experts there
(token_exchange.py: `_local_moe_tokens`); 'assignment' sends one row per routed expert, the
steps above (`_local_moe_whole`). Equal results while nothing drops. `run.exchange_streams`
S > 1 runs the tokens in S independent slices, each with its own exchange (`_in_streams`), so
the compiler can overlap one slice's exchange with another's experts.

Two transports (`run.expert_exchange`, 'auto' picks per platform):
Both transports size their buffers by the slot S (`slot_rows`): the most rows one device may
send one other device. Dropless, S = T * min(k, E/n) (a token sends one row per chosen expert,
so at most min(k, E/n) to one device); with a capacity factor S <= E/n * C; with
`model.exchange_buffer_factor` b > 0, S <= ceil(b * T*k / n), the balanced share times b, and a
source's rows for one device past S (the last in expert order) are dropped and counted like
capacity drops (both transports drop the same rows).
- `ragged` (GPU/TPU): `jax.lax.ragged_all_to_all` sends each row once. The send buffer is the
  M = T*k sorted rows; the receive buffer holds n*S rows (n*M dropless with k <= E/n).
- `padded` (CPU, whose XLA has no ragged_all_to_all): a fixed [n, S, D] buffer per direction
  (slot j holds the rows for device j), exchanged with `jax.lax.all_to_all`: it moves n*S*D
  elements per device where the ragged one moves M*D; cf = 1 or b = 1 make the two about equal.

Token chunks (`run.expert_block_rows` r under remat full, pass_input or attention, dropless
only): a device's tokens run in chunks whose receive buffer holds at most r rows, each chunk's
whole body recomputed in its backward (`_local_moe`).

Capacity (`model.capacity_factor` cf > 0): each expert takes at most C = ceil(cf * T * k / E)
of one batch shard's assignments (T its tokens), in token order; the rest are dropped (their
output is zero, the residual carries the token) and counted.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from loopmoe_jax import chunks as chunks_lib
from loopmoe_jax import dispatch as dispatch_lib
from loopmoe_jax import sharding
from loopmoe_jax import token_exchange
from loopmoe_jax.token_exchange import exclusive_cumsum
from loopmoe_jax.runtime import Runtime


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  return int(math.ceil(factor * num_tokens * top_k / num_experts))


def capacity_keep(experts_M, num_experts: int, cap: int):
  """Which of the M flat assignments an expert of capacity `cap` keeps: the first `cap` of
  each expert's assignments in their order, [M] bool."""
  order = jnp.argsort(experts_M, stable=True)
  counts = jnp.bincount(experts_M, length=num_experts)
  starts = jnp.cumsum(counts) - counts
  rank = jnp.arange(experts_M.shape[0]) - starts[experts_M[order]]
  return jnp.zeros(experts_M.shape, bool).at[order].set(rank < cap)


def apply_capacity(experts_Tk, weights_Tk, num_experts: int, factor: float):
  """(weights with dropped assignments zeroed, keep_Tk, number dropped) for one batch shard;
  factor 0 keeps everything."""
  if not factor:
    return weights_Tk, jnp.ones(experts_Tk.shape, bool), jnp.zeros((), jnp.int32)
  t, k = experts_Tk.shape
  keep = capacity_keep(experts_Tk.reshape(-1), num_experts,
                       capacity(t, k, num_experts, factor)).reshape(t, k)
  return (jnp.where(keep, weights_Tk, 0).astype(weights_Tk.dtype), keep,
          jnp.sum(~keep).astype(jnp.int32))


def exchange_kind(kind: str, *, runtime: Runtime) -> str:
  """run.expert_exchange resolved: 'auto' is 'padded' where the programs are built for a CPU
  (XLA:CPU has no ragged all-to-all), 'ragged' on GPU and TPU."""
  if kind != 'auto':
    return kind
  return 'padded' if runtime.target_platform == 'cpu' else 'ragged'


def slot_rows(t: int, k: int, num_experts: int, n: int, factor: float = 0.0,
              buffer_factor: float = 0.0) -> int:
  """Rows one device may send one other device in one exchange (t tokens, top-k of
  `num_experts` over n devices): the dropless bound t * min(k, E/n) (a token sends at most one
  row per local expert of the destination, and at most k); with a capacity factor at most
  E/n * C; with `buffer_factor` b, ceil(b * t * k / n), the balanced load times b (rows past it
  are dropped and counted). The ragged receive buffer holds n such slots."""
  e_loc = num_experts // n
  rows = chunks_lib.dropless_rows(t, k, num_experts, n)
  if factor:
    rows = min(rows, e_loc * capacity(t, k, num_experts, factor))
  if buffer_factor:
    rows = min(rows, int(math.ceil(buffer_factor * t * k / n)))
  return rows


def _kept_counts(counts_sE, n: int, slot: int):
  """Per source and expert, the rows that fit a destination's slot: a source's rows for one
  destination are sent in expert order, the first `slot` of them kept. [n_src, E] -> same."""
  by_dest = counts_sE.reshape(counts_sE.shape[0], n, -1)
  before = exclusive_cumsum(by_dest, 2)
  return jnp.clip(slot - before, 0, by_dest).reshape(counts_sE.shape)


def limited_devices(cfg, n: int) -> int:
  """The devices a token's experts may lie on under device-limited routing on an expert axis
  of n: model.max_expert_devices where the rule's groups are these devices
  (model.expert_devices == n), else 0 (no limit the buffers may count on)."""
  return cfg.max_expert_devices if cfg.max_expert_devices and cfg.expert_devices == n else 0


@dataclasses.dataclass(frozen=True)
class Body:
  """The per-device body's settings: `num_experts` of the layer over `n` devices of the
  `expert` axis, the capacity `factor` and exchange `buffer_factor` (0: none), the transport
  `kind` ('padded' or 'ragged'), the mesh's batch axes and `tensor` size, the token chunks'
  `block_rows`, the runtime (its dispatch backend and tile), what a row is (`rows`: 'token'
  or 'assignment'), the independent token `streams` (dropless only) and the devices a token
  may reach under device-limited routing (`max_devices`, 0: any)."""
  num_experts: int
  n: int
  factor: float
  buffer_factor: float
  kind: str
  batch_axes: tuple
  tensor: int
  block_rows: int
  runtime: Runtime
  rows: str = 'token'
  streams: int = 1
  max_devices: int = 0

  @classmethod
  def of(cls, cfg, mesh, num_experts: int, runtime: Runtime) -> 'Body':
    """The architecture's capacity and exchange buffers (`cfg`; dropless worst-case buffers
    when the runtime is `exchange_dropless`) with the runtime's run settings on `mesh`."""
    run = runtime.run
    buffer_factor = 0.0 if runtime.exchange_dropless else cfg.exchange_buffer_factor
    n = mesh.shape['expert']  # one expert device: the padded layout, no collective
    return cls(num_experts, n, cfg.capacity_factor, buffer_factor,
               'padded' if n == 1 else exchange_kind(run.expert_exchange, runtime=runtime),
               sharding.batch_axes(mesh),
               mesh.shape['tensor'], run.ffn_block_rows, runtime, run.exchange_unit,
               run.exchange_streams, limited_devices(cfg, n))

  def slot(self, t: int, k: int) -> int:
    """`slot_rows` of `t` tokens routed to `k` experts each."""
    return slot_rows(t, k, self.num_experts, self.n, self.factor, self.buffer_factor)

  def token_slot(self, t: int, k: int) -> int:
    """The pairs one device may send one other by token rows: t (a token goes to a device
    once); with a capacity factor at most E/n * C (a pair carries at least one kept
    assignment); with `buffer_factor` b, ceil(b * t * u / n), u = n (1 - (1 - 1/n)^k) the
    devices a token touches on average under uniform routing."""
    rows, e_loc = t, self.num_experts // self.n
    if self.factor:
      rows = min(rows, e_loc * capacity(t, k, self.num_experts, self.factor))
    if self.buffer_factor:
      touched = self.n * (1 - (1 - 1 / self.n) ** k)
      rows = min(rows, int(math.ceil(self.buffer_factor * t * touched / self.n)))
    return max(rows, 1)

  def expand_rows(self, t: int, k: int) -> int:
    """The expanded rows a device runs by token rows: n * token_slot * min(k, E/n); with a
    capacity factor at most n * E/n * C (C per expert and source); with `buffer_factor` at
    most n times the assignment exchange's slot (`slot`)."""
    e_loc = self.num_experts // self.n
    rows = self.n * self.token_slot(t, k) * min(k, e_loc)
    if self.factor:
      rows = min(rows, self.n * e_loc * capacity(t, k, self.num_experts, self.factor))
    if self.buffer_factor:
      rows = min(rows, self.n * self.slot(t, k))
    return rows



def _local_moe(x_TD, experts_Tk, weights_Tk, params, body: Body):
  """The per-device body (see the module docstring): returns (y_TD float32, dropped).

  `body.block_rows` r > 0 on a dropless exchange (no capacity or buffer factor): the device's
  tokens run in `chunks.token_chunks` consecutive chunks, each chunk's whole body (permute,
  exchange, grouped matmul, exchange back, combine) recomputed in its backward
  (`chunks.in_token_chunks`), so no buffer sized by the worst-case received rows outlives
  its chunk. A token's rows go to the same experts whatever the chunk, so the outputs are the
  unchunked ones. With a capacity or buffer factor (which rank rows across the whole shard)
  the exchange runs whole."""
  t, k = experts_Tk.shape
  chunks = (1 if body.factor or body.buffer_factor or body.rows == 'token' else
            chunks_lib.token_chunks(t, k, body.num_experts, body.n, body.block_rows))
  whole = _local_moe_tokens if body.rows == 'token' else _local_moe_whole
  if body.streams > 1 and not (body.factor or body.buffer_factor):
    whole = _in_streams(whole, body.streams)
  if chunks == 1:
    y_TD, dropped = whole(x_TD, experts_Tk, weights_Tk, params, body)
    return y_TD, jax.lax.psum(dropped, body.batch_axes)
  run = lambda p, x, e, w: whole(x, e, w, p, body, name_exchange=False)
  y_ctD, dropped_c = chunks_lib.in_token_chunks(run, chunks, params, x_TD, experts_Tk,
                                                  weights_Tk)
  # the dropped count summed over the chunks here, over the shards once (not per chunk)
  return y_ctD.reshape(-1, y_ctD.shape[-1])[:t], jax.lax.psum(jnp.sum(dropped_c),
                                                              body.batch_axes)


def _in_streams(whole, streams: int):
  """`whole` over `streams` consecutive equal slices of the tokens, each with its own exchange
  and experts, none depending on another: the compiler may run one slice's exchange while
  another's experts compute (the exchange hidden behind compute). A token's rows go to the
  same experts whatever its slice, so the outputs are the whole's. Token counts that do not
  split evenly run whole."""
  def run(x_TD, experts_Tk, weights_Tk, params, body, **kw):
    t = x_TD.shape[0]
    if t % streams:
      return whole(x_TD, experts_Tk, weights_Tk, params, body, **kw)
    parts = [whole(*(a[i * (t // streams):(i + 1) * (t // streams)]
                     for a in (x_TD, experts_Tk, weights_Tk)), params, body, **kw)
             for i in range(streams)]
    return jnp.concatenate([y for y, _ in parts]), sum(d for _, d in parts)
  return run


class _Sent(NamedTuple):
  """What the permute step decides: the sorted rows and their order, the counts kept per
  (source, expert), the rows this device sends and receives, and the rows dropped."""
  x_send: jax.Array
  key: jax.Array
  order: jax.Array
  inverse: jax.Array
  send_off: jax.Array
  raw_counts: jax.Array
  dest_counts: jax.Array
  recv_nE: jax.Array
  c_nn: jax.Array
  dropped: jax.Array


def _permute(x_TD, experts_Tk, weights_Tk, body: Body, slot: int, e_loc: int):
  """Sorts the device's assignments by expert (dropped ones last) and counts what each
  device sends and keeps: (capacity-masked weights, _Sent)."""
  k, me = experts_Tk.shape[1], jax.lax.axis_index('expert')
  n, num_experts = body.n, body.num_experts
  with jax.named_scope('permute'):
    flat = experts_Tk.reshape(-1)
    weights_Tk, keep_Tk, dropped = apply_capacity(experts_Tk, weights_Tk, num_experts,
                                                  body.factor)
    key = jnp.where(keep_Tk.reshape(-1), flat, num_experts)  # dropped rows sort last
    order = jnp.argsort(key, stable=True)
    inverse = dispatch_lib.inverse_permutation(order)
    x_send = dispatch_lib.gather_tokens(x_TD, order, inverse, k)
    counts_E = jnp.bincount(key, length=num_experts).astype(jnp.int32)
    send_off = exclusive_cumsum(counts_E.reshape(n, e_loc).sum(1))
    raw_counts = jax.lax.all_gather(counts_E, 'expert')                   # [n_src, E]
    all_counts = _kept_counts(raw_counts, n, slot)                        # what is sent
    kept_E = all_counts[me]
    dest_counts = kept_E.reshape(n, e_loc).sum(1)
    dropped = dropped + jnp.sum(counts_E) - jnp.sum(kept_E)  # rows past a slot
    recv_nE = jax.lax.dynamic_slice_in_dim(all_counts, me * e_loc, e_loc, axis=1)
    c_nn = all_counts.reshape(n, n, e_loc).sum(-1)                        # [src, dest]
  return weights_Tk, _Sent(x_send, key, order, inverse, send_off, raw_counts, dest_counts,
                           recv_nE, c_nn, dropped)


def _local_moe_whole(x_TD, experts_Tk, weights_Tk, params, body: Body,
                     name_exchange: bool = True):
  """`_local_moe` over all of the device's tokens at once. `name_exchange`: the exchanged rows
  carry the checkpoint name 'exchange' (core.REMAT's policies keep them); off inside token
  chunks, whose backward reruns their exchange: kept there, the chunks' receive buffers would
  stack over chunks and passes, the worst-case buffers the chunks are there to avoid. Returns
  (y_TD, this device's dropped count)."""
  t, k = experts_Tk.shape
  named = (lambda v: checkpoint_name(v, 'exchange')) if name_exchange else (lambda v: v)
  m, d = t * k, x_TD.shape[1]
  e_loc, n = params['gate'].shape[0], body.n
  me = jax.lax.axis_index('expert')
  slot = body.slot(t, k)
  weights_Tk, sent = _permute(x_TD, experts_Tk, weights_Tk, body, slot, e_loc)
  c_in = sent.c_nn[:, me]  # the rows each source sends this device

  with jax.named_scope('exchange'):
    sorted_key = sent.key[sent.order]
    dest = jnp.where(sorted_key < body.num_experts, sorted_key // e_loc, n)
    pos = jnp.arange(m) - sent.send_off[jnp.minimum(dest, n - 1)]
    if body.kind == 'padded':  # rows past a slot fall off the buffer (mode='drop')
      buf = jnp.zeros((n, slot, d), x_TD.dtype).at[dest, pos].set(sent.x_send, mode='drop')
      recv = token_exchange.all_to_all(buf, n).reshape(n * slot, d)
      recv = named(recv)
      block_start = jnp.arange(n, dtype=jnp.int32) * slot
    else:  # each source's first dest_counts rows per destination
      out_off = exclusive_cumsum(sent.c_nn, 0)[me]
      recv = jax.lax.ragged_all_to_all(sent.x_send, jnp.zeros((n * slot, d), x_TD.dtype),
                                       sent.send_off, sent.dest_counts, out_off, c_in,
                                       axis_name='expert')
      recv = named(recv)
      block_start = exclusive_cumsum(c_in)

  out_recv = _local_experts(recv, block_start, sent.recv_nE, params, body)

  with jax.named_scope('exchange_back'):
    if body.kind == 'padded':
      back = named(token_exchange.all_to_all(out_recv.reshape(n, slot, d), n))
      out_sorted = back.at[dest, pos].get(mode='fill', fill_value=0)
    else:  # rows a slot dropped are never written: they stay zero
      # where each source's rows for this device begin in its send buffer (offsets of the
      # whole sorted rows, dropped ones included)
      src_off = exclusive_cumsum(sent.raw_counts.reshape(n, n, e_loc).sum(-1), 1)[:, me]
      out_sorted = jax.lax.ragged_all_to_all(out_recv, jnp.zeros((m, d), out_recv.dtype),
                                             block_start, c_in, src_off, sent.dest_counts,
                                             axis_name='expert')
      out_sorted = named(out_sorted)

  with jax.named_scope('unpermute'):
    out_TkD = dispatch_lib.permute_rows(out_sorted, sent.inverse, sent.order).reshape(t, k, d)
  y_TD = dispatch_lib.combine(out_TkD, weights_Tk)
  if body.tensor > 1:
    y_TD = jax.lax.psum(y_TD, 'tensor')
  return y_TD, sent.dropped  # this device's: `_local_moe` sums it over the shards


def _local_moe_tokens(x_TD, experts_Tk, weights_Tk, params, body: Body,
                      name_exchange: bool = True):
  """`_local_moe` by token rows (token_exchange.exchange) after the capacity limit: (y_TD
  float32, this device's dropped count)."""
  weights_Tk, keep_Tk, dropped = apply_capacity(experts_Tk, weights_Tk, body.num_experts,
                                                body.factor)
  y_TD, dropped_x = token_exchange.exchange(x_TD, experts_Tk, weights_Tk, keep_Tk, params, body,
                                            name_exchange)
  return y_TD, dropped + dropped_x


def _local_experts(recv, block_start, recv_nE, params, body: Body):
  """The received rows through this device's experts: regrouped by local expert, the grouped
  SwiGLU (the runtime's dispatch backend), and back in received order."""
  e_loc = recv_nE.shape[1]
  with jax.named_scope('regroup'):
    seg_start = (block_start[:, None] + exclusive_cumsum(recv_nE, 1)).reshape(-1)
    seg_count = recv_nE.reshape(-1)
    q = jnp.arange(recv.shape[0])
    seg = jnp.searchsorted(seg_start, q, side='right') - 1
    local = jnp.where(q < seg_start[seg] + seg_count[seg], seg % e_loc, e_loc)
    order2 = jnp.argsort(local, stable=True)
    inverse2 = dispatch_lib.inverse_permutation(order2)
    sizes = recv_nE.sum(0)
  run = body.runtime.run
  out_g = dispatch_lib.grouped_ffn(dispatch_lib.permute_rows(recv, order2, inverse2), sizes,
                                   params, run.dispatch, run.dispatch_tile, runtime=body.runtime)
  return dispatch_lib.permute_rows(out_g, inverse2, order2)


def local_dispatch(x_TD, experts_Tk, weights_Tk, params, cfg, mesh, num_experts: int,
                   *, runtime: Runtime):
  """The per-device body called where every mesh axis is already manual (core.Core's
  shard_map): this device's rows and its E/n experts (`params`); (y_TD, dropped)."""
  y_TD, dropped = _local_moe(x_TD, experts_Tk, weights_Tk, params,
                             Body.of(cfg, mesh, num_experts, runtime))
  return y_TD.astype(x_TD.dtype), dropped


def moe_dispatch(x_TD, experts_Tk, weights_Tk, params, cfg, mesh, *, runtime: Runtime):
  """Expert-parallel dispatch over `mesh` (the abstract mesh of `jax.set_mesh`): (y_TD,
  dropped assignments over the whole batch). Token rows are split over the batch axes."""
  num_experts = params['gate'].shape[0]
  n = mesh.shape['expert']
  if num_experts % n:
    raise ValueError(f'{num_experts} experts do not divide over mesh.expert={n}; make every '
                     f'model.*_experts a multiple of {n}')
  rows = P(sharding.batch_axes(mesh))
  names = {'gate': ('experts', 'embed', 'mlp'), 'up': ('experts', 'embed', 'mlp'),
           'down': ('experts', 'mlp', 'embed')}
  layouts = {k: sharding.gathered_inside(
      names[k], w.shape, w.dtype.itemsize, mesh,
      tuple(None if n == 'embed' else n for n in names[k]), runtime.run.min_shard_bytes)
             for k, w in params.items()}
  settings = Body.of(cfg, mesh, num_experts, runtime)

  def body(x, e, w, p):
    for k, (_, gathers) in layouts.items():  # the width, split over fsdp in the state
      for dim, axes in gathers.items():
        p = dict(p, **{k: jax.lax.all_gather(p[k], axes, axis=dim, tiled=True)})
    return _local_moe(x, e, w, p, settings)
  y_TD, dropped = jax.shard_map(
      body, in_specs=(rows, rows, rows, {k: s for k, (s, _) in layouts.items()}),
      out_specs=(rows, P()), check_vma=False)(x_TD, experts_Tk, weights_Tk, params)
  return y_TD.astype(x_TD.dtype), dropped
