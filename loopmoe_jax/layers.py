"""Small building blocks: parameter helper with logical axes, RMSNorm, RoPE, SwiGLU MLP.

Every dimension of every parameter carries one of LOGICAL_AXES (a rules table in the sharding
code maps them to mesh axes).

Array names carry their shape in capitals after an underscore (`x_BTD`, `gate_EDF`), one letter
per dimension across the package:

  B batch            T tokens (query positions)    S key positions      V vocabulary
  D d_model          H query heads                  G kv heads (groups)  K head dim
  F expert width     E experts                      k top-k (lower case) M routed rows (T*k)
  N rows or windows of an analysis batch, and a matmul's output width (rhs_GKN)
  L passes of the looped core (num_loops)           C core layers (core_layers; the papers'
                                                      D of a looped block (E, D, L))
  R, J, Q, I, A: local to the function that names them (a docstring says)
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

LOGICAL_AXES = (
    'vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp', 'experts',
    'loops',        # per-pass weights (untied attention), stacked on a leading axis
    'embed_in',     # the input side of the injection projection
    'inject_src',   # the injection's two sources (prelude output, current state)
)
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def fan_in_init(in_axes: Sequence[int], out_axes: Sequence[int], batch_axes: Sequence[int] = ()):
  """Normal variance scaling over the fan-in (cheap to compile, unlike the truncated normal);
  batch axes get independent draws."""
  return nn.initializers.variance_scaling(1.0, 'fan_in', 'normal',
                                          in_axis=tuple(in_axes), out_axis=tuple(out_axes),
                                          batch_axis=tuple(batch_axes))


def param(module: nn.Module, name: str, shape, axes: Sequence[str], init, dtype, runtime=None):
  """Creates (or reads) a parameter of shape `shape` annotated with logical axis names (one
  per dimension). Declared with its whole shape wherever it runs: given the `runtime`
  (runtime.Runtime) of a body inside a shard_map over the whole mesh, the value is the
  device's view of it (`Runtime.local_shape`: a layer's experts are its own), and Flax checks
  the value against that shape."""
  if len(axes) != len(shape):
    raise ValueError(f'{name}: {len(axes)} axis names for shape {shape}')
  unknown = [a for a in axes if a not in LOGICAL_AXES]
  if unknown:
    raise ValueError(f'{name}: axis names {unknown} are not in layers.LOGICAL_AXES')
  if runtime is not None:
    shape = runtime.local_shape(shape, axes)
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


class RMSNorm(nn.Module):
  """RMSNorm in float32; a learned gain only when `use_gain` (Foil uses none)."""
  use_gain: bool = True
  eps: float = 1e-6
  param_dtype: str = 'float32'

  @nn.compact
  def __call__(self, x):
    gain = param(self, 'scale', (x.shape[-1],), ('embed',), nn.initializers.ones,
                 DTYPES[self.param_dtype]) if self.use_gain else None
    return rms_norm(x, gain, self.eps).astype(x.dtype)


def rms_norm(x, gain, eps: float):
  """x / rms(x) (times `gain` when not None), in float32 (RMSNorm's arithmetic)."""
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return x if gain is None else x * gain.astype(jnp.float32)


def rope(x_BTHK, positions_BT, theta: float):
  """Rotary embedding (rotate-half form) at integer positions."""
  k = x_BTHK.shape[-1]
  freq = theta ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)
  angle = positions_BT[:, :, None, None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHK.dtype)


def swiglu(x, gate_DF, up_DF, down_FD):
  return (jax.nn.silu(x @ gate_DF) * (x @ up_DF)) @ down_FD


class DenseMLP(nn.Module):
  """A dense SwiGLU feed-forward layer (also the shared experts of an MoE layer)."""
  width: int
  param_dtype: str = 'float32'

  @nn.compact
  def __call__(self, x_BTD):
    d, dt = x_BTD.shape[-1], DTYPES[self.param_dtype]
    gate = param(self, 'gate', (d, self.width), ('embed', 'mlp'), fan_in_init([0], [1]), dt)
    up = param(self, 'up', (d, self.width), ('embed', 'mlp'), fan_in_init([0], [1]), dt)
    down = param(self, 'down', (self.width, d), ('mlp', 'embed'), fan_in_init([0], [1]), dt)
    c = x_BTD.dtype
    return swiglu(x_BTD, gate.astype(c), up.astype(c), down.astype(c))
