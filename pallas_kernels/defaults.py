"""The Pallas grouped-matmul kernels' defaults, one table each: the tiles per kernel family
and op (TILES), the ops (OPS) and the family per op a GPU uses when none is given
(GPU_DEFAULT). Shared by ops.py (which runs the kernels) and capability.py (which picks the
families a GPU's compute capability runs)."""
from __future__ import annotations

import types


def _fixed(tiles):  # read-only: a program's tiles come from its arguments, never from edits here
  return types.MappingProxyType({op: types.MappingProxyType(t) for op, t in tiles.items()})


# Tile defaults per target and op ('gmm': forward and input gradient, 'tgmm': weight
# gradient). TPU: 128 matches the MXU and the (8, 128) layout, K in steps of 512 (not yet run
# on a TPU). GPU: the fastest correct variants of `scripts/benchmark.py kernels` on an H200
# (jax 0.11.2, M 65536, K 2048, N 1024, 64 groups, bf16): Mosaic GPU gmm persistent with 5
# stages 295 TFLOP/s (one CTA per tile: 236), tgmm 173-222; Triton gmm 8 warps 224-243,
# tgmm 64x256 8 warps 225-234. On CPU every kernel only interprets.
TILES = types.MappingProxyType({
    'tpu': _fixed({'gmm': dict(tile_m=128, tile_n=128, tile_k=512),
                   'tgmm': dict(tile_m=128, tile_n=128, tile_k=512)}),
    'gpu': _fixed({'gmm': dict(tile_m=128, tile_n=128, tile_k=64, num_warps=8, num_stages=3),
                   'tgmm': dict(tile_m=64, tile_n=256, tile_k=128, num_warps=8, num_stages=3)}),
    'mgpu': _fixed({'gmm': dict(tile_m=128, tile_n=128, tile_k=64, stages=5, persistent=True),
                    'tgmm': dict(tile_m=64, tile_n=128, tile_k=128, stages=4)}),
    # warp-specialised (tile_n / tile_k: one of the two compute warpgroups' share); not yet
    # timed on a device
    'mgpu_ws': _fixed({'gmm': dict(tile_m=128, tile_n=128, tile_k=64, stages=3),
                       'tgmm': dict(tile_m=64, tile_n=128, tile_k=128, stages=3)}),
})
# The kernel family per op a GPU backend uses when no target is given: 'gpu' (Triton) or
# 'mgpu' (Mosaic GPU, Hopper wgmma). Measured on an H200 (above): the Mosaic GPU gmm (295
# TFLOP/s) beats Triton's (224-243); for tgmm Triton's (222-234) beat Mosaic GPU's (173-222)
# in both runs that timed the two.
GPU_DEFAULT = types.MappingProxyType({'gmm': 'mgpu', 'tgmm': 'gpu'})
OPS = ('gmm', 'tgmm')
