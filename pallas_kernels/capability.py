"""Which Pallas GPU kernel family runs on which NVIDIA GPU, by compute capability.

    capability.gpu_families((8, 9))   # {'gmm': 'gpu', 'tgmm': 'gpu'}: Triton on Ada
    capability.plan((8, 0))           # (tiles for gmm's `tiles`, why no Pallas, one line)

Hopper (sm_90) runs every family: defaults.GPU_DEFAULT (Mosaic GPU gmm, Triton tgmm). Ampere
(sm_80: A100) and Ada (sm_89: L4, RTX 4090) run the Triton family only: Mosaic GPU lowers to
TMA and wgmma, which XLA:GPU refuses below sm_90 ("'nvvm.wgmma.fence.aligned' op is not
supported on sm_89"). Ada and GA10x blocks opt into 99 KiB of shared memory, not Hopper's
227 or A100's 163: the Triton tgmm's default tiles pipelined 3 deep ask for 144 KiB there
("Shared memory size limit exceeded: requested 147456, available: 101376", the CUDA plugin
compiling for rtx4090x1), so they pipeline fewer stages. Below sm_80 no family runs: the MoE
dispatch takes the XLA path (ragged_dot).
"""
from __future__ import annotations

import functools
import types

import jax

from pallas_kernels.defaults import GPU_DEFAULT, OPS, TILES

# The oldest NVIDIA compute capability each GPU family compiles for: Pallas Triton's bf16 dots
# need Ampere's mma (sm_80); Mosaic GPU's TMA and wgmma exist on Hopper (sm_90) and later only.
MIN_CC = types.MappingProxyType({'gpu': (8, 0), 'mgpu': (9, 0), 'mgpu_ws': (9, 0)})
NAMES = {'gpu': 'Triton', 'mgpu': 'Mosaic GPU', 'mgpu_ws': 'Mosaic GPU, warp-specialised'}
# Shared memory a block may opt into, KiB, by compute capability (CUDA C++ Programming Guide,
# technical specifications per compute capability); an unlisted one: the smallest
SMEM_OPTIN_KIB = types.MappingProxyType({(8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99,
                                         (9, 0): 227})


def smem_optin_bytes(cc: tuple[int, int]) -> int:
  """The shared memory a block may opt into on compute capability `cc` (SMEM_OPTIN_KIB)."""
  return SMEM_OPTIN_KIB.get(tuple(cc), min(SMEM_OPTIN_KIB.values())) * 1024


def _cc(cc) -> str:
  return f'{cc[0]}.{cc[1]}'


def gpu_families(cc: tuple[int, int] | None) -> dict[str, str] | None:
  """Per op the family for a GPU of compute capability `cc`: GPU_DEFAULT where it runs
  (Hopper), the Triton family where only that one does (Ampere, Ada), None where no Pallas
  GPU family does (the caller takes XLA); cc None (not known): GPU_DEFAULT."""
  if cc is None:
    return dict(GPU_DEFAULT)
  for choice in (dict(GPU_DEFAULT), {op: 'gpu' for op in OPS}):
    if all(tuple(cc) >= MIN_CC[f] for f in choice.values()):
      return choice
  return None


def describe(families: dict[str, str] | None) -> str:
  """'gmm: gpu (Triton), tgmm: gpu (Triton)'; None: XLA's grouped matmul."""
  if families is None:
    return 'XLA (run.dispatch=xla: jax.lax.ragged_dot)'
  return ', '.join(f'{op}: {f} ({NAMES.get(f, f)})' for op, f in families.items())


def family_refusal(family: str, cc: tuple[int, int], where: str = '') -> str | None:
  """Why kernel family `family` cannot run on compute capability `cc` (one line naming the
  family, the capability and what would run), or None when it can."""
  if family not in MIN_CC or tuple(cc) >= MIN_CC[family]:
    return None
  return (f'kernel family {family!r} ({NAMES[family]}){where} needs compute capability '
          f'{_cc(MIN_CC[family])}+, the target has {_cc(cc)}; what runs there: '
          f'{describe(gpu_families(cc))}')


def _stages_within(op: str, family: str, smem: int, itemsize: int = 2) -> dict:
  """{'num_stages': n} for Triton tiles whose n pipelined operand tiles of `itemsize`-byte
  elements fit `smem` bytes (at least 2), and where even 2 do not (float32 on Ada's 99 KiB)
  the contraction tile halved until they do; {} where the defaults fit."""
  if family != 'gpu':
    return {}
  t = TILES['gpu'][op]
  rows = t['tile_m'] + t['tile_n'] if op == 'gmm' else t['tile_k'] + t['tile_n']
  depth_key = 'tile_k' if op == 'gmm' else 'tile_m'
  depth = t[depth_key]
  while depth > 16 and 2 * itemsize * rows * depth > smem:
    depth //= 2
  stages = max(2, min(t['num_stages'], smem // (itemsize * rows * depth)))
  out = {} if stages == t['num_stages'] else {'num_stages': stages}
  return out if depth == t[depth_key] else {**out, depth_key: depth}


def gpu_tiles(cc: tuple[int, int] | None, family: str | None = None,
              itemsize: int = 2) -> dict | None:
  """`tiles` for pallas_kernels.gmm on compute capability `cc`: per op its family (`family`
  for both when given, else `gpu_families`), the capability itself ('cc': a program built
  for `cc` on a machine with another GPU is `cc`'s, pallas_kernels.ops.tiling) and fewer
  Triton pipeline stages (operands of `itemsize` bytes) where the defaults outgrow the shared
  memory a block may opt into. None where cc is unknown or no Pallas GPU family runs."""
  runs = {op: family for op in OPS} if family else gpu_families(cc)
  if cc is None or runs is None:
    return None
  smem = smem_optin_bytes(cc)
  return {op: dict(family=runs[op], cc=tuple(cc),
                  **_stages_within(op, runs[op], smem, itemsize))
          for op in OPS}


def plan(cc: tuple[int, int], family: str | None = None) -> tuple[dict | None, str, str]:
  """(tiles, why_not, line) for programs built for a GPU of compute capability `cc`: the
  `gpu_tiles` (None where no family runs); why no Pallas family runs there ('' when one
  does: the MoE dispatch's `auto` then takes the XLA path); one line saying what runs. A `family`
  the capability cannot run is a ValueError naming it, the capability and what would run."""
  if family:
    why = family_refusal(family, cc)
    if why:
      raise ValueError(f'--kernel_family={family}: {why}')
  runs = {op: family for op in OPS} if family else gpu_families(cc)
  why_not = '' if runs else (f'no Pallas GPU kernel family compiles for compute capability '
                             f'{_cc(cc)} (Triton needs {_cc(MIN_CC["gpu"])}+)')
  line = (f'compute capability {_cc(cc)}: ' + describe(runs) if runs else
          f'{why_not}: the MoE dispatch runs {describe(None)}')
  return gpu_tiles(cc, family), why_not, line


@functools.lru_cache(maxsize=None)
def local_cc() -> tuple[int, int] | None:
  """This machine's NVIDIA GPU compute capability, None without one (or not reported)."""
  if jax.default_backend() != 'gpu':
    return None
  cc = getattr(jax.devices()[0], 'compute_capability', None)
  return tuple(int(v) for v in str(cc).split('.')[:2]) if cc else None
