"""The looped core's plan as types: what an entry point asks of it (`CoreRequest`), how one
forward runs its passes (`CorePlan`, decided once by core.Core with the runtime), what every
scan of the passes takes (`CoreInputs`) and what the core gives back (`CoreOutputs`).
core.py, core_once.py and early_exit.py read the same types.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp


class Path(enum.Enum):
  """How the core runs its passes."""
  SCAN = 'scan'                # one nn.scan under XLA's partitioning
  ONCE = 'once'                # that scan inside core_once's shard_map: collectives once
  UNROLL = 'unroll'            # a Python loop over the passes (run.loop_impl='unroll')
  EARLY_EXIT = 'early_exit'    # per-token early exit (early_exit.scan_core)
  PASS_STATES = 'pass_states'  # gate training: the scan also emits every pass's state


class CoreRequest(NamedTuple):
  """What an entry point asks of the core besides its passes: gradient through the last
  `backprop_loops` only (0: all), per-token early exit read by `readout` (early_exit.Readout), or
  every pass's output state (`pass_states`, gate training)."""
  backprop_loops: int = 0
  readout: Any = None
  pass_states: bool = False


@dataclasses.dataclass(frozen=True)
class CorePlan:
  """One forward's passes: the path, how many, the first with gradient (`split`, 0: all:
  truncated backprop runs passes [0, split) without gradient), whether the router bias
  is per pass (scanned with them), and whether the KV cache is carried through the passes
  whole (`carry_cache`: decoding; each pass writes its own slot in place, attention.py)
  rather than stacked per pass."""
  path: Path
  num_loops: int
  split: int = 0
  per_pass: bool = False
  carry_cache: bool = False

  def pass_indices(self, part: slice | None = None) -> tuple:
    """The scanned pass indices of the passes in `part` (all by default) that a scan carrying
    the cache takes as its last input; () otherwise."""
    part = part or slice(0, self.num_loops)
    return (jnp.arange(part.start, part.stop),) if self.carry_cache else ()

  @property
  def parts(self) -> tuple[slice, ...]:
    """The passes' scans: one, or without and with gradient when split."""
    if self.split:
      return slice(0, self.split), slice(self.split, self.num_loops)
    return (slice(0, self.num_loops),)


class CoreInputs(NamedTuple):
  """What every pass reads: the carried state, the untied attention's per-pass weights (or
  None), the injected input (or None), the positions and the router bias (per pass when the
  plan says so, or None)."""
  x_BTD: Any
  pass_attn: Any
  e_BTD: Any
  positions_BT: Any
  bias: Any

  def passes(self, part: slice, per_pass: bool) -> 'CoreInputs':
    """The inputs of the passes in `part`: their slices of the per-pass inputs."""
    cut = lambda t: None if t is None else jax.tree.map(lambda a: a[part], t)
    return self._replace(pass_attn=cut(self.pass_attn),
                         bias=cut(self.bias) if per_pass else self.bias)

  def one_pass(self, index: int, per_pass: bool) -> 'CoreInputs':
    """The inputs of pass `index` alone (per-pass inputs indexed, not sliced)."""
    at = lambda t: None if t is None else jax.tree.map(lambda a: a[index], t)
    return self._replace(pass_attn=at(self.pass_attn),
                         bias=at(self.bias) if per_pass else self.bias)


@flax.struct.dataclass
class CoreOutputs:
  """The state after the last pass, the MoE statistics by pass ({} without experts, or with
  early exit), and what the request asked: the passes each token ran (early exit) or every
  pass's state [L, B, T, D] (gate training)."""
  x_BTD: Any
  stats: dict
  exit_passes_BT: Any = None
  pass_states_LBTD: Any = None
