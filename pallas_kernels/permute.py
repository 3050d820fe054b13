"""Permute tokens into expert-sorted order and combine (weighted un-permute) them back.

Both are gathers driven by the routing kernel's positions (no sort at all): permute writes row
positions[t, j] from token t; combine reads every token's k rows back and sums them weighted
in float32. They are written as plain JAX gathers/scatters, which XLA fuses well on every
platform; the kernels that matter (route, gmm) are Pallas.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def permute(x_TD, positions_Tk):
  """x rows in expert-sorted order, [T*k, D]: row positions[t, j] is x[t]."""
  t, k = positions_Tk.shape
  with jax.named_scope('permute'):
    token_M = jnp.zeros((t * k,), jnp.int32).at[positions_Tk.reshape(-1)].set(
        jnp.repeat(jnp.arange(t, dtype=jnp.int32), k), unique_indices=True)
    return x_TD[token_M]


def combine(out_MD, positions_Tk, weights_Tk):
  """sum_j weights[t, j] * out[positions[t, j]], accumulated in float32, [T, D] in out's dtype."""
  with jax.named_scope('combine'):
    rows_TkD = out_MD[positions_Tk].astype(jnp.float32)
    y = jnp.einsum('tkd,tk->td', rows_TkD, weights_Tk.astype(jnp.float32))
    return y.astype(out_MD.dtype)
