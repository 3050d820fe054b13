"""The implementations behind `run.attention_impl` (a run setting: none changes a parameter).

- `xla`: `attention.attend`, an einsum that materialises float32 scores [B, G, Q, T, S] and
  keeps them for the backward. The probes that read attention weights (the sink mass of
  analysis/probes.py) always use it; decoding with a KV cache its heads-major form
  (`attention.attend_cached`) unless the decode kernels run (below).
- `chunked`: causal attention in plain JAX over query blocks and key blocks of
  `run.attention_block` with an online softmax (flash attention's recurrence: a running max
  m, normaliser l and output accumulator per query), and a custom VJP that recomputes each
  block pair's probabilities from the saved log-sum-exp. Forward and backward hold the scores
  of one block pair [B, H, block, block] at a time (float32), never T x S or T x block. Runs
  on every platform; the CPU path and the fallback. Queries and keys are cut into the fewest
  blocks of at most `attention_block` (as even as can be; padded keys and queries masked
  out), so a sequence shorter than the block is one block pair. Every block pair is computed,
  the masked ones too (the loops have static trip counts, which the dry run's FLOP count
  reads).
- `cudnn`: `jax.nn.dot_product_attention(implementation='cudnn')`, cuDNN's fused flash
  attention: NVIDIA GPUs, bfloat16/float16 compute (`model.dtype`).
- `splash`: JAX's Pallas TPU splash-attention kernel (causal mask, GQA); on CPU it only runs in
  Pallas's interpreter (slow; for checking). The length is padded to a multiple of 128.
- `auto`: splash on TPU, cudnn on a GPU with 16-bit compute, chunked otherwise.

Decoding (attention.decode_attend): where the implementation resolves to splash (a TPU, or
splash named on the CPU, interpreted), a decode step's products run in the kernels of
pallas_kernels.decode_attention, which write the step's K/V into the cache by DMA and read
its slots where they lie (a looped core's pass slot too), only up to each row's last
position; elsewhere, and for caches the kernels do not serve (`supports`: a key block over
VMEM; read slots-minor, slots not of whole lane tiles), `attention.attend_cached`'s XLA
products.

The fused kernels run per batch shard inside `jax.shard_map` under a device mesh (their
custom calls are not partitioned by XLA); the attention output and, in `chunked`, its saved
log-sum-exp carry the checkpoint name 'attention' (core.REMAT's named policies).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import pallas_kernels
from loopmoe_jax import sharding
from loopmoe_jax.config import ATTENTION_IMPLS as IMPLS
from loopmoe_jax.runtime import HERE, Runtime

RUNS_ON = {'xla': ('cpu', 'gpu', 'tpu'), 'chunked': ('cpu', 'gpu', 'tpu'),
           'cudnn': ('gpu',), 'splash': ('tpu', 'cpu')}
SIXTEEN_BIT = ('bfloat16', 'float16')
SPLASH_MULTIPLE = 128  # splash's block sizes are multiples of the 128-lane layout


# cuDNN's fused attention as jax calls it: head dims that are multiples of 8, at most 128 (jax's
# check_is_flash_attention: 256 on Hopper, 128 below it, so one limit holds on H100/H200, A100
# (sm_80), L4 and RTX 4090 (sm_89), bf16/fp16; the tiny step's cuDNN calls compile for all of
# them, tests/test_targets.py). cuDNN's flash attention needs sm_80+.
CUDNN_HEAD_MULTIPLE, CUDNN_MAX_HEAD = 8, 128


def _cudnn_head_ok(head_dim: int | None) -> bool:
  return head_dim is None or (head_dim % CUDNN_HEAD_MULTIPLE == 0 and
                               head_dim <= CUDNN_MAX_HEAD)


def check(runtime: Runtime, mc) -> None:
  """Refuses run settings that the runtime's platform cannot run for the model config `mc`
  (cudnn attention on a TPU, splash on a GPU, cudnn with a head dim or dtype cuDNN does not
  take): a ValueError naming the key and the platform, before anything is traced."""
  resolve(runtime.run.attention_impl, mc.dtype, runtime.target_platform, mc.resolved_head_dim)


def resolve(impl: str, dtype: str, platform: str | None = None,
            head_dim: int | None = None) -> str:
  """The implementation `impl` ('auto' or a name) runs as on `platform` ('cpu', 'gpu', 'tpu':
  the one programs are built for, `Runtime.target_platform`; default: this machine's) for heads of
  `head_dim`; one the platform or the head dim cannot run is a ValueError naming the key,
  and `auto` never picks it (a head dim cuDNN does not take: chunked)."""
  platform = platform or HERE.target_platform
  if impl == 'auto':
    if platform == 'tpu':
      return 'splash'
    cudnn = platform == 'gpu' and dtype in SIXTEEN_BIT and _cudnn_head_ok(head_dim)
    return 'cudnn' if cudnn else 'chunked'
  if impl not in RUNS_ON:
    raise ValueError(f'run.attention_impl={impl!r}: must be one of {IMPLS}')
  if platform not in RUNS_ON[impl]:
    raise ValueError(f'run.attention_impl={impl!r} does not run on platform {platform!r} '
                     f'(it runs on {", ".join(RUNS_ON[impl])}); use auto, chunked or xla')
  if impl == 'cudnn' and dtype not in SIXTEEN_BIT:
    raise ValueError(f"run.attention_impl='cudnn' needs a 16-bit model.dtype (got {dtype!r}); "
                     "set model.dtype='bfloat16' or use chunked")
  if impl == 'cudnn' and not _cudnn_head_ok(head_dim):
    raise ValueError(f"run.attention_impl='cudnn' needs heads of a multiple of "
                     f'{CUDNN_HEAD_MULTIPLE} up to {CUDNN_MAX_HEAD} (model.head_dim: '
                     f'{head_dim}); use auto or chunked')
  return impl


# chunked: flash attention's recurrence in plain JAX --------------------------------------

def _pad_to(x, axis: int, size: int, value=0):
  pad = size - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _split(x, axis: int, block: int, value=0):
  """`x` padded along `axis` to whole blocks of at most `block` and split there: [n, ...] with
  the axis of length block' = ceil(len / n) (the fewest blocks, as even as can be: least
  padding)."""
  size = x.shape[axis]
  n = -(-size // block)
  block = -(-size // n)
  x = _pad_to(x, axis, n * block, value)
  return jnp.moveaxis(x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:]), axis, 0)


def _unsplit(x, axis: int, size: int):
  """The inverse of `_split` (padding dropped)."""
  x = jnp.moveaxis(x, 0, axis)
  merged = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
  return jax.lax.slice_in_dim(merged, 0, size, axis=axis)


def _blocks(k_BSGK, v_BSGK, k_pos_BS, block: int):
  """Keys, values and positions in blocks [n, B, block, ...]; padded keys sit at the largest
  position, so no query attends to them."""
  big = jnp.iinfo(k_pos_BS.dtype).max
  return (_split(k_BSGK, 1, block), _split(v_BSGK, 1, block), _split(k_pos_BS, 1, block, big))


def _query_blocks(q_pos_BT, block: int, *xs_BGQT):
  """Query positions and per-query arrays ([B, G, Q, T, ...]) in query blocks; padded queries
  sit at the smallest position, so they attend to no key (their output is 0)."""
  small = jnp.iinfo(q_pos_BT.dtype).min
  return (_split(q_pos_BT, 1, block, small),) + tuple(_split(x, 3, block) for x in xs_BGQT)


def _grouped(x_BTHK, g: int):
  """[B, T, H, K] -> [B, G, Q, T, K]: the H = G x Q query heads by KV group."""
  b, t, h, kd = x_BTHK.shape
  return jnp.moveaxis(x_BTHK.reshape(b, t, g, h // g, kd), 1, 3)


def _ungrouped(x_BGQTK):
  """The inverse of `_grouped`."""
  b, g, q, t, kd = x_BGQTK.shape
  return jnp.moveaxis(x_BGQTK, 3, 1).reshape(b, t, g * q, kd)


def _scores(q_BGQTK, k_BsGK, q_pos_BT, k_pos_Bs, scale):
  """float32 scores of one key block [B, G, Q, T, s], -inf where the key is after the query."""
  s = jnp.einsum('bgqtk,bsgk->bgqts', q_BGQTK, k_BsGK,
                 preferred_element_type=jnp.float32) * scale
  mask = q_pos_BT[:, None, None, :, None] >= k_pos_Bs[:, None, None, None, :]
  return jnp.where(mask, s, -jnp.inf)


def _masked(q_pos_BT, k_pos_Bs):
  """True when every key of the block comes after every query of the block, in every row:
  the pair's probabilities are all 0, and `skip` leaves it out (a causal run skips about half
  the block pairs; positions, not indices, decide)."""
  return jnp.max(q_pos_BT) < jnp.min(k_pos_Bs)


def _chunked_fwd_impl(q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, block, skip):
  b, t, h, kd = q_BTHK.shape
  g = k_BSGK.shape[2]
  scale = 1.0 / float(kd) ** 0.5
  # The positions tied to q by a zero that XLA folds away. Under jax.checkpoint (remat) JAX
  # computes whatever depends on non-differentiated inputs alone once in the forward and
  # saves it for the backward: untied, the causal masks of every block pair (O(T^2) bytes per
  # sequence and head group) would be saved; tied, they are recomputed with the scores.
  zero = jax.lax.select(q_BTHK[0, 0, 0, 0] == 0, 0, 0).astype(q_pos_BT.dtype)
  q_pos_BT, k_pos_BS = q_pos_BT + zero, k_pos_BS + zero
  kb, vb, pb = _blocks(k_BSGK, v_BSGK, k_pos_BS, block)
  qpb, qb = _query_blocks(q_pos_BT, block, _grouped(q_BTHK, g))

  def query_block(_, blk):
    q, q_pos = blk

    def key_block(carry, blk):
      k_blk, v_blk, pos_blk = blk

      def update(carry):
        m, l, acc = carry
        s = _scores(q, k_blk, q_pos, pos_blk, scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum('bgqts,bsgk->bgqtk', p.astype(v_blk.dtype),
                                                 v_blk, preferred_element_type=jnp.float32)
        return m_new, l, acc

      if not skip:
        return update(carry), None
      return jax.lax.cond(_masked(q_pos, pos_blk), lambda c: c, update, carry), None

    shape = q.shape[:-1]
    init = (jnp.full(shape, jnp.finfo(jnp.float32).min), jnp.zeros(shape, jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    (m, l, acc), _ = jax.lax.scan(key_block, init, (kb, vb, pb))
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return None, (out.astype(q_BTHK.dtype), m + jnp.log(jnp.maximum(l, 1e-30)))

  _, (out, lse) = jax.lax.scan(query_block, None, (qb, qpb))
  return _ungrouped(_unsplit(out, 3, t)), _unsplit(lse, 3, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def chunked_attend(q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, block: int = 512,
                   skip: bool = True):
  """Causal softmax attention as `attention.attend` (same arguments and result), computed
  over query and key blocks of `block` with an online softmax; the backward recomputes each
  block pair's probabilities from the saved log-sum-exp (scores of one block pair live).
  `skip`: block pairs whose keys all follow their queries are not computed (a conditional per
  pair; the forward and the backward); False computes every pair (benchmark.py memory's
  reference for the time it saves)."""
  return _chunked_fwd_impl(q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, block, skip)[0]


def _chunked_fwd(q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, block, skip):
  out, lse = _chunked_fwd_impl(q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, block, skip)
  out, lse = checkpoint_name(out, 'attention'), checkpoint_name(lse, 'attention')
  return out, (q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, out, lse)


def _chunked_bwd(block, skip, res, d_out_BTHK):
  """Flash attention's backward: per key block (outer loop, its dk and dv accumulated over
  the query blocks), per query block (inner loop) the probabilities recomputed from the saved
  log-sum-exp; dq accumulated across key blocks."""
  q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, out_BTHK, lse = res
  kd, s_len, g = q_BTHK.shape[3], k_BSGK.shape[1], k_BSGK.shape[2]
  scale = 1.0 / float(kd) ** 0.5
  q, d_out = _grouped(q_BTHK, g), _grouped(d_out_BTHK, g)
  delta = jnp.sum(d_out.astype(jnp.float32) * _grouped(out_BTHK, g).astype(jnp.float32), axis=-1)
  kb, vb, pb = _blocks(k_BSGK, v_BSGK, k_pos_BS, block)
  qpb, qb, dob, lseb, deltab = _query_blocks(q_pos_BT, block, q, d_out, lse, delta)

  def key_block(dq, blk):
    k_blk, v_blk, pos_blk = blk

    def query_block(carry, blk):
      q_i, do_i, lse_i, delta_i, q_pos = blk

      def update(carry):
        dk, dv = carry
        p = jnp.exp(_scores(q_i, k_blk, q_pos, pos_blk, scale) - lse_i[..., None])
        dv = dv + jnp.einsum('bgqts,bgqtk->bsgk', p.astype(do_i.dtype), do_i,
                             preferred_element_type=jnp.float32)
        dp = jnp.einsum('bgqtk,bsgk->bgqts', do_i, v_blk, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_i[..., None]) * scale).astype(q_i.dtype)
        dk = dk + jnp.einsum('bgqts,bgqtk->bsgk', ds, q_i, preferred_element_type=jnp.float32)
        return (dk, dv), jnp.einsum('bgqts,bsgk->bgqtk', ds, k_blk,
                                    preferred_element_type=jnp.float32)

      if not skip:
        return update(carry)
      nothing = lambda c: (c, jnp.zeros(q_i.shape, jnp.float32))
      return jax.lax.cond(_masked(q_pos, pos_blk), nothing, update, carry)

    zeros = jnp.zeros(k_blk.shape, jnp.float32)
    (dk, dv), dq_parts = jax.lax.scan(query_block, (zeros, zeros),
                                      (qb, dob, lseb, deltab, qpb))
    return dq + dq_parts, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, jnp.float32), (kb, vb, pb))
  dq_BTHK = _ungrouped(_unsplit(dq, 3, q_BTHK.shape[1])).astype(q_BTHK.dtype)
  return (dq_BTHK, _unsplit(dk, 1, s_len).astype(k_BSGK.dtype),
          _unsplit(dv, 1, s_len).astype(v_BSGK.dtype), None, None)


chunked_attend.defvjp(_chunked_fwd, _chunked_bwd)


# fused kernels, per batch shard -----------------------------------------------------------

# cuDNN version assumed when a program for NVIDIA GPUs is built on a machine without cuDNN
# (dry runs and the cross-lowering tests: jax asks the library for its version while tracing).
ASSUMED_CUDNN_VERSION = 91000


@contextlib.contextmanager
def _assume_cudnn():
  # pylint: disable-next=import-outside-toplevel
  from jax._src.cudnn import fused_attention_stablehlo as fa
  saved = fa.check_cudnn_version
  fa.check_cudnn_version = lambda: ASSUMED_CUDNN_VERSION
  try:
    yield
  finally:
    fa.check_cudnn_version = saved


def _cudnn(q_BTHK, k_BSGK, v_BSGK):
  call = lambda: jax.nn.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, is_causal=True,
                                              implementation='cudnn')
  if jax.default_backend() == 'gpu':
    return call()
  with _assume_cudnn():  # built here for a GPU (Runtime.for_platform('cuda')); never run here
    return call()


def _splash(q_BTHK, k_BSGK, v_BSGK, interpret: bool):
  # pylint: disable-next=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  t, kd = q_BTHK.shape[1], q_BTHK.shape[3]
  padded = -(-t // SPLASH_MULTIPLE) * SPLASH_MULTIPLE  # padded keys follow every real query
  blk = max(d for d in (512, 256, 128) if padded % d == 0)
  mask = masks.MultiHeadMask([masks.CausalMask((padded, padded))] * q_BTHK.shape[2])
  kernel = splash.make_splash_mha(
      mask, head_shards=1, q_seq_shards=1, interpret=interpret,
      block_sizes=splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                                    block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
                                    block_q_dq=blk, block_kv_dq=blk))
  heads_first = lambda x: jnp.moveaxis(_pad_to(x, 1, padded), 2, 1)  # [B, heads, T, K]
  q = heads_first(q_BTHK * jnp.asarray(1.0 / float(kd) ** 0.5, q_BTHK.dtype))
  out = jax.vmap(kernel)(q, heads_first(k_BSGK), heads_first(v_BSGK))
  return jnp.moveaxis(out, 1, 2)[:, :t]


def _per_shard(fn, q_BTHK, k_BSGK, v_BSGK, kv_heads: int, runtime: Runtime):
  """`fn` on each batch shard (heads over `tensor` when it divides the KV heads) inside
  `jax.shard_map` when the runtime's mesh splits work (`Runtime.sharded`); else directly."""
  runtime = runtime.resolved()
  if not runtime.sharded:
    return fn(q_BTHK, k_BSGK, v_BSGK)
  mesh = runtime.mesh
  tensor = mesh.shape['tensor']
  heads = 'tensor' if tensor > 1 and kv_heads % tensor == 0 else None
  spec = P(sharding.batch_axes(mesh), None, heads, None)
  return jax.shard_map(fn, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(
      q_BTHK, k_BSGK, v_BSGK)


def attend_with(impl: str, q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, block: int,
                *, runtime: Runtime):
  """Causal attention [B, T, H, K] by a resolved implementation other than 'xla' (positions:
  the training layout, query t at position t, for the fused kernels); splash interpreted where
  the runtime's kernels are (a CPU)."""
  if impl == 'chunked':
    return chunked_attend(q_BTHK, k_BSGK, v_BSGK, q_pos_BT, k_pos_BS, block)
  interpret = bool(pallas_kernels.ops.interpret_flag(runtime.interpret, runtime.target_platform))
  fn = {'cudnn': _cudnn, 'splash': functools.partial(_splash, interpret=interpret)}[impl]
  out = _per_shard(fn, q_BTHK, k_BSGK, v_BSGK, k_BSGK.shape[2], runtime)
  return checkpoint_name(out, 'attention')
