"""RunConfig (config section `run`): how the model's parameters run, none of it a parameter."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from loopmoe_jax.config.fields import from_mapping

REMAT_POLICIES = ('none', 'full', 'full_keep_exchange', 'dots', 'dots_no_batch', 'pass_input',
                  'attention', 'named')
# What each run.remat policy is, in one place (core.REMAT holds what it saves):
LAYERWISE_REMAT = ('full', 'full_keep_exchange')  # each layer its own checkpoint (core.remat)
# the backward keeps what an unchunked exchange delivered (dry_run.exchange_forwards)
EXCHANGE_KEPT_REMAT = ('none', 'full_keep_exchange', 'pass_input', 'attention', 'named')
# the MoE runs in recomputed token chunks (RunConfig.ffn_block_rows)
CHUNKED_REMAT = ('full', 'full_keep_exchange', 'pass_input', 'attention')
# a policy with another's recompute (the same FLOPs), told apart by memory and step (fit.py)
REMAT_TWINS = {'full_keep_exchange': 'full'}
ATTENTION_IMPLS = ('auto', 'xla', 'chunked', 'cudnn', 'splash')
LOOP_IMPLS = ('scan', 'unroll')
CORE_COLLECTIVES = ('once', 'per_pass')
DISPATCHES = ('reference', 'tiled', 'xla', 'pallas', 'auto')
EXCHANGES = ('auto', 'padded', 'ragged')
EXCHANGE_ROWS = ('auto', 'token', 'assignment')


RUN_FIELDS = ('dispatch', 'dispatch_tile', 'expert_exchange', 'remat', 'loop_impl',
              'core_collectives', 'attention_impl', 'attention_block', 'loss_chunk',
              'expert_block_rows', 'exchange_rows', 'exchange_streams', 'min_shard_bytes')


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """How the model's parameters run (config section `run`): none of these fields changes a
  parameter, and each gives the same results up to float summation order, so a resumed run or
  a finished sweep point may change them. (The capacity factor and the exchange buffers stay
  in `model`: they change which assignments are computed.)"""
  dispatch: str = 'auto'         # auto: the Pallas kernel on GPU/TPU, 'tiled' on CPU
  dispatch_tile: int = 128
  expert_exchange: str = 'auto'  # expert parallelism: padded (all_to_all) | ragged | auto
  exchange_rows: str = 'auto'    # what the expert exchange sends: 'token' (a token's hidden
                                 # state once per device holding its experts, expanded and
                                 # combined there: token_exchange.py) | 'assignment' (one row
                                 # per routed expert) | 'auto' (`exchange_unit`). Equal up to
                                 # summation order while nothing drops; which rows bounded
                                 # buffers drop differs
  min_shard_bytes: int = 0       # under a mesh, a parameter of fewer bytes is kept whole on
                                 # every device (its optimizer moments too): no step gathers
                                 # it, its gradient is all-reduced once. 0: every parameter
                                 # split by the rules table (sharding.py)
  exchange_streams: int = 1      # > 1: a device's tokens in this many independent slices, each
                                 # with its own exchange, so one slice's exchange can run while
                                 # another's experts compute (dropless exchanges; tokens that do
                                 # not split evenly run whole); more collective ops
  remat: str = 'none'            # what the backward recomputes (core.REMAT, docs/results.md):
                                 # the core, prelude and coda layers and the head and loss
  attention_impl: str = 'auto'   # attention_impls.py: auto | xla | chunked | cudnn | splash
  attention_block: int = 512     # key block of 'chunked' (a length not a multiple is padded)
  loss_chunk: int = 8192         # > 0: the head and LM loss over vocabulary chunks of at most
                                 # this many columns (objective.py; no float32 [B, T, V]
                                 # logits; a vocabulary of at most this many is one piece);
                                 # 0: the whole logits
  core_collectives: str = 'once' # under a mesh: 'once' gathers the looped core's weights once a
                                 # step and reduces their gradients once (core.Core); 'per_pass'
                                 # leaves both to XLA inside the loop (weights stay sharded)
  loop_impl: str = 'scan'        # 'unroll': Python loop over the same shared params
  expert_block_rows: int = 16384 # under remat full, pass_input or attention, the MoE
                                 # dispatch handles at most this many rows at once: a device's
                                 # tokens run in chunks (chunks.token_chunks) whose routed
                                 # rows, or under expert parallelism whose dropless receive
                                 # buffer, hold at most this many, each chunk recomputed in its
                                 # own backward (the tokens padded to equal chunks). No buffer
                                 # sized for the worst case outlives a chunk; a chunk's exchange
                                 # and FFN forward rerun in its backward (under full on top of
                                 # the pass's recompute; pass_input and attention keep the
                                 # expert output, so their pass recompute skips the MoE). Dropless
                                 # exchanges only: with model.capacity_factor or
                                 # exchange_buffer_factor the exchange runs whole. 0: off

  def __post_init__(self):
    _validate_run(self)

  @property
  def ffn_block_rows(self) -> int:
    """expert_block_rows where it applies, else 0: under the policies that recompute the MoE
    layer (full) or keep its output (pass_input, attention: core.REMAT); not under none
    (nothing recomputed) nor dots / named, which keep values inside the layer that a chunk's
    recompute would hide."""
    return (self.expert_block_rows
            if self.remat in CHUNKED_REMAT else 0)

  @property
  def exchange_unit(self) -> str:
    """exchange_rows resolved: 'auto' is 'token', except under remat 'none', where the token
    rows' backward would keep every expert output of the worst-case expansion (n x the
    assignment rows' T*k rows, for the routing weights' gradient) and 'assignment' is used."""
    if self.exchange_rows != 'auto':
      return self.exchange_rows
    return 'assignment' if self.remat == 'none' else 'token'

  def replace(self, **kw) -> 'RunConfig':
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = 'run') -> 'RunConfig':
    return from_mapping(cls, d, where)


def _err_run(field: str, value: Any, why: str):
  raise ValueError(f'run.{field}={value!r}: {why}')


def _validate_run(c: RunConfig):
  for name in ('dispatch_tile', 'attention_block', 'exchange_streams'):
    if getattr(c, name) < 1:
      _err_run(name, getattr(c, name), 'must be >= 1')
  for name in ('loss_chunk', 'expert_block_rows', 'min_shard_bytes'):
    if getattr(c, name) < 0:
      _err_run(name, getattr(c, name), 'must be >= 0')
  choices = dict(remat=REMAT_POLICIES, loop_impl=LOOP_IMPLS, dispatch=DISPATCHES,
                 expert_exchange=EXCHANGES, exchange_rows=EXCHANGE_ROWS, core_collectives=CORE_COLLECTIVES,
                 attention_impl=ATTENTION_IMPLS)
  for name, allowed in choices.items():
    if getattr(c, name) not in allowed:
      _err_run(name, getattr(c, name), f'must be one of {allowed}')
