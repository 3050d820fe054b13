"""Pallas routing and dispatch kernels (TPU Mosaic; GPU Triton and Mosaic GPU), differentiable ops.

Public API:
  gmm(lhs_MK, rhs_GKN, group_sizes_G, ...)   grouped matmul, jax.lax.ragged_dot semantics
  tgmm(lhs_MK, grad_MN, group_sizes_G, ...)  per-group lhs^T @ grad (weight gradient)
  gmm_swiglu(x_MD, gate_GDF, up_GDF, group_sizes_G, ...)  fused gate/up SwiGLU
  route(logits_TE, top_k, ...)               top-k routing + counts + sorted positions
  permute(x_TD, positions_Tk), combine(out_MD, positions_Tk, weights_Tk)
On CPU every kernel runs in interpret mode (TPU kernels under pltpu.InterpretParams()).
"""
from pallas_kernels.ops import TILES, gmm, gmm_swiglu, tgmm
from pallas_kernels.permute import combine, permute
from pallas_kernels.routing import route

__all__ = ['TILES', 'gmm', 'gmm_swiglu', 'tgmm', 'route', 'permute', 'combine']
