"""Cross-lowering: lower a jitted function for 'cuda' or 'tpu' on this CPU machine.

jax lowers a pallas_call to Triton IR (GPU, with triton CompilerParams) or Mosaic (TPU) in
Python, so lowering errors (unsupported ops, bad block shapes, shared-memory overflow) show
here without the device. Compiling that IR still needs the device (the `gpu` tests).
jax >= 0.11 asks for a GPU (or an abstract GPU device) to lower Triton kernels; without one
the test is skipped with that reason (CI's jax 0.10 lowers them).
"""
import jax
import pytest


def lower_for(platform: str, fn, *args):
  """Lowers jit(fn) at the given abstract or concrete args for `platform`; returns its text."""
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  try:
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
  except Exception as e:  # pylint: disable=broad-except
    if 'No supported GPU devices found' in str(e):
      pytest.skip(f'jax {jax.__version__} cannot lower Triton kernels without a GPU: {e}')
    raise
