"""Checksums of a train state: every array gets two 32-bit sums of its bits (plain and
position-weighted, wrapping: exact and order-free, so the same on any mesh and process
count), stored with the step's data-iterator state (train/checkpoint.py). Restore recomputes them; a mismatch sets
the step aside like any other damage (a few zeroed bytes inside a state file otherwise
restore as good values)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CHECKSUMS = 'checksums'
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _one_checksum(x):
  size = np.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    u = x.astype(jnp.uint32)
  elif size == 8:  # two 32-bit words per element
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    u = jax.lax.bitcast_convert_type(x, _UINT[size]).astype(jnp.uint32)
  # each element's flat (row-major) index, built per axis: a reshape to 1-D would gather an
  # array sharded along a later axis onto every device
  index, stride = jnp.zeros(u.shape, jnp.uint32), 1
  for axis in reversed(range(u.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis) * jnp.uint32(stride)
    stride = stride * u.shape[axis] % (1 << 32)
  weighted = u * (index * jnp.uint32(2654435761) + jnp.uint32(1))
  # both sums in one pass over the array (a variadic reduce: XLA:CPU runs two jnp.sum as two
  # passes, 8x slower on a 64 MiB array)
  plain, weighted = jax.lax.reduce((u, weighted), (jnp.uint32(0), jnp.uint32(0)),
                                   lambda a, b: (a[0] + b[0], a[1] + b[1]),
                                   tuple(range(u.ndim)))
  return jnp.stack([plain, weighted])


def checksum_program():
  """The jitted checksums of a tree of arrays, made anew for each use: no module-level cache
  keeps one per model a process has seen."""
  return jax.jit(lambda tree: jax.tree.map(_one_checksum, tree))


def checksums(tree, program=None) -> dict[str, list[int]]:
  """{array path: [sum, weighted sum]} of a tree of (global) arrays; `program`: a
  `checksum_program` to reuse (a run's Job keeps one for its saves), else a new one."""
  sums = jax.device_get((program or checksum_program())(tree))
  return {jax.tree_util.keystr(path): [int(v) for v in np.asarray(leaf)]
          for path, leaf in jax.tree_util.tree_leaves_with_path(sums)}


def checksum_mismatch(tree, stored: dict, prefix: str = '') -> str | None:
  """The path of the first array of `tree` whose checksum differs from `stored` (keys as
  `checksums` gives them, under `prefix`), or None. Checksums recorded but none of them for
  an array of `tree` is a mismatch too (the layout changed: nothing would be verified)."""
  matched = False
  for path, value in checksums(tree).items():
    want = stored.get(prefix + path)
    if want is not None and list(want) != value:
      return prefix + path
    matched = matched or want is not None
  if stored and not matched:
    return f'every array ({len(stored)} recorded, none under {prefix or "the state"!r})'
  return None
