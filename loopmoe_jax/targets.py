"""Accelerator targets by name: the chips users rent, as the project needs them (compile-only
devices for the real compiler on this CPU, memory per device, peak FLOP/s, link bandwidths).

    target = targets.get('v5p-128')          # or 'v5p:4x4x4', 'v6e-64', 'h200x8', '2x8xh100'
    devices = target.devices()              # compile-only: jit(...).lower(...).compile() runs
                                            # libtpu's / XLA:GPU's compiler here, no chip needed

Names: TPU `GEN-N` (Cloud's accelerator type: N TensorCores for v4 / v5p, chips for v5e /
v6e) or `GEN:AxB[xC]` (the topology); GPU `CHIPxN` (one node of N) or `MxNxCHIP` (M nodes of N,
one process per node). TPU devices come from libtpu (`pip install -e '.[tpu]'`), GPU devices
from the CUDA plugin (`pip install -e '.[cuda]'`) with a GpuTargetConfigProto built from the
chip's row below (no GPU needed; no autotuning, so tile choices are the compiler's fallbacks).

Figures are per chip, public specifications (Cloud TPU system-architecture pages for v4, v5e,
v5p and v6e: peak bf16, HBM capacity, bidirectional ICI bandwidth per chip, DCN per chip or per
host; NVIDIA's H100 SXM / H200 SXM datasheets: dense bf16 without sparsity, HBM, NVLink 4
900 GB/s bidirectional, one 400 Gb/s InfiniBand NIC per GPU; A100, L4 and RTX 4090: their
rows' comments). Links are stored one direction. GPU chips carry the figures XLA:GPU compiles
against (`GpuSpec`: compute capability, SMs, clocks, L2, shared memory), which decide the
Pallas kernel family (pallas_kernels/capability.py): Mosaic GPU on Hopper (sm_90) only,
Triton on A100 (sm_80), L4 and RTX 4090 (sm_89). Debugging on one GPU: `a100x1` (80 GB),
`a100-40gx1`, `l4x1`, `rtx4090x1`.
A v4 / v5p chip holds two TensorCores: compile-only v4 topologies give one device per core, so
per-device figures divide the chip's by the devices per chip. MFU (train/trainer.py) and the
pre-flight memory check read the same rows (`chip_of_kind`).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import math
import os
import re

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip's public figures (per chip)."""
  name: str
  platform: str              # 'tpu' | 'cuda'
  device_kinds: tuple        # what jax's devices report as device_kind (compile-only and real)
  hbm_bytes: int
  peak_bf16_flops: float     # dense
  ici_bytes_per_s: float     # chip-to-chip (ICI / NVLink), one direction, all links
  dcn_bytes_per_s: float     # data-center network per chip, one direction
  hbm_bytes_per_s: float = 0.0
  # fixed time of one collective op over the chip's links, whatever its bytes (0: no figure)
  collective_latency_s: float = 0.0
  gpu: 'GpuSpec | None' = None  # the CUDA plugin's target config (GPU chips)

  @property
  def compute_capability(self) -> tuple[int, int] | None:
    return self.gpu.cc if self.gpu else None


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What XLA:GPU compiles against for one NVIDIA chip (GpuTargetConfigProto's device info):
  compute capability, SMs, boost clock, L2, shared memory per SM and the per-block opt-in,
  FP32 lanes and resident threads per SM (64K registers per SM and per block on all of them)."""
  cc: tuple[int, int]
  sms: int
  clock_ghz: float
  l2_bytes: int
  smem_per_sm: int
  fpus_per_sm: int = 128
  threads_per_sm: int = 2048

  @property
  def smem_optin(self) -> int:
    """Shared memory a block may opt into: the capability table's (pallas_kernels)."""
    from pallas_kernels import capability  # pylint: disable=import-outside-toplevel
    return capability.smem_optin_bytes(self.cc)


# Hopper SXM (H100 / H200 whitepaper): 132 SMs at 1.98 GHz boost, 50 MiB L2, 228 KiB shared
# memory per SM of which 227 KiB opt-in per block.
HOPPER = GpuSpec((9, 0), 132, 1.98, 50 * 2**20, 228 * 1024)
# A100 SXM4 (NVIDIA A100 Tensor Core GPU Architecture whitepaper; CUDA C++ Programming Guide,
# compute capability 8.0): 108 SMs at 1.41 GHz boost, 40 MiB L2, 164 KiB shared memory per SM,
# 163 KiB opt-in per block, 64 FP32 lanes per SM, 2048 threads per SM.
AMPERE_A100 = GpuSpec((8, 0), 108, 1.41, 40 * 2**20, 164 * 1024, 64)
# Ada (NVIDIA Ada GPU Architecture whitepaper; CUDA C++ Programming Guide, compute capability
# 8.9: 100 KiB shared memory per SM, 99 KiB opt-in per block, 1536 threads per SM). L4: AD104,
# 58 SMs at 2.04 GHz boost, 48 MiB L2. RTX 4090: AD102, 128 SMs at 2.52 GHz boost, 72 MiB L2.
ADA_L4 = GpuSpec((8, 9), 58, 2.04, 48 * 2**20, 100 * 1024, 128, 1536)
ADA_4090 = GpuSpec((8, 9), 128, 2.52, 72 * 2**20, 100 * 1024, 128, 1536)


# Per-op collective latency, the figure the dry run's latency term multiplies by the ops a step
# issues. TPU ICI: about 1 us per link hop (ASTRA-sim's TPU validation, "link latency is 1 us
# as per TPU research team"), over the up-to-10 hops of a pod slice's torus axes: 10 us an op.
# NVLink with NCCL: about 6 us for an all-reduce between 2 H100s of an HGX node, rising with
# the GPUs taking part (NVIDIA/nccl issue 1259, NVLS), about 26 us in NCCL's own model for a
# 4 KB all-reduce on an H100 cluster (NVIDIA/nccl issue 1453): 15 us an op.
ICI_LATENCY_S, NVLINK_LATENCY_S = 10e-6, 15e-6


CHIPS = {c.name: c for c in (
    # Cloud TPU v4: 32 GiB HBM2 at 1,200 GB/s, 275 TFLOP/s bf16, ICI 2,400 Gbps per chip
    # one way; DCN about 25 Gbps per chip (a host of 4 chips)
    Chip('v4', 'tpu', ('TPU v4',), 32 * GIB, 275e12, 300e9, 25e9 / 8, 1200e9, ICI_LATENCY_S),
    # v5e: 16 GiB at 819 GB/s, 197 TFLOP/s, ICI 400 GB/s bidirectional; 2 x 100 Gbps NICs per
    # host of 8 chips
    Chip('v5e', 'tpu', ('TPU v5 lite', 'TPU v5e'), 16 * GIB, 197e12, 200e9, 25e9 / 8, 819e9,
         ICI_LATENCY_S),
    # v5p: 95 GiB HBM2e at 2,765 GB/s, 459 TFLOP/s, ICI 1,200 GB/s bidirectional, DCN 50 Gbps
    # per chip. Its devices report 'TPU v5' (compile-only and real), not 'TPU v5p'.
    Chip('v5p', 'tpu', ('TPU v5', 'TPU v5p'), 95 * GIB, 459e12, 600e9, 50e9 / 8, 2765e9,
         ICI_LATENCY_S),
    # v6e (Trillium): 32 GiB at 1,638 GB/s, 918 TFLOP/s, ICI 800 GB/s bidirectional; DCN taken
    # as v5e's per chip (the spec table gives none)
    Chip('v6e', 'tpu', ('TPU v6 lite', 'TPU v6e'), 32 * GIB, 918e12, 400e9, 25e9 / 8, 1638e9,
         ICI_LATENCY_S),
    # H100 SXM 80 GB: 989 TFLOP/s dense bf16, 3.35 TB/s; NVLink 4 900 GB/s bidirectional;
    # the allocator's device memory size as XLA sees it
    Chip('h100', 'cuda', ('NVIDIA H100 80GB HBM3', 'NVIDIA H100'), 84_942_979_072, 989e12, 450e9,
         50e9, 3.352e12, NVLINK_LATENCY_S, HOPPER),
    # H200 SXM 141 GB: same compute as H100, 4.8 TB/s HBM3e
    Chip('h200', 'cuda', ('NVIDIA H200',), 150_754_820_096, 989e12, 450e9, 50e9, 4.8e12,
         NVLINK_LATENCY_S, HOPPER),
    # A100 SXM4 80 GB (NVIDIA A100 datasheet): 312 TFLOP/s dense bf16, HBM2e 2,039 GB/s;
    # NVLink 3 600 GB/s bidirectional; DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU.
    # Memory as nvidia-smi reports it (81,920 MiB; the 40 GB part 40,960 MiB).
    Chip('a100', 'cuda', ('NVIDIA A100-SXM4-80GB', 'NVIDIA A100 80GB PCIe', 'NVIDIA A100'),
         81_920 * 2**20, 312e12, 300e9, 25e9, 2.039e12, NVLINK_LATENCY_S, AMPERE_A100),
    # A100 SXM4 40 GB: the same compute, HBM2 1,555 GB/s
    Chip('a100-40g', 'cuda', ('NVIDIA A100-SXM4-40GB', 'NVIDIA A100-PCIE-40GB'), 40_960 * 2**20,
         312e12, 300e9, 25e9, 1.555e12, NVLINK_LATENCY_S, AMPERE_A100),
    # L4 (NVIDIA L4 datasheet): 24 GB GDDR6 at 300 GB/s (nvidia-smi: 23,034 MiB), 242 TFLOP/s
    # bf16 with sparsity = 121 dense; no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional; no
    # network figure (0). Per-op latency: NVLink's figure, for want of a PCIe one.
    Chip('l4', 'cuda', ('NVIDIA L4',), 23_034 * 2**20, 121e12, 32e9, 0.0, 300e9,
         NVLINK_LATENCY_S, ADA_L4),
    # GeForce RTX 4090 (Ada whitepaper, appendix): 24 GB GDDR6X at 1,008 GB/s (nvidia-smi:
    # 24,564 MiB), 165.2 TFLOP/s dense bf16 with float32 accumulation (330.3 accumulating in
    # fp16); no NVLink: PCIe Gen4 x16
    Chip('rtx4090', 'cuda', ('NVIDIA GeForce RTX 4090',), 24_564 * 2**20, 165.2e12, 32e9, 0.0,
         1.008e12, NVLINK_LATENCY_S, ADA_4090),
)}
GPU_CHIPS = tuple(name for name, c in CHIPS.items() if c.platform == 'cuda')
# device kinds of chips with no target row (MFU only)
OTHER_PEAKS = {'B200': 2250e12}

# TPU chips per default topology (v4 / v5p: 3-D tori; v5e / v6e: 2-D)
_TORUS_3D = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8',
             256: '4x8x8', 512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16', 4096: '16x16x16'}
_TORUS_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16',
             256: '16x16'}
_CORES_PER_CHIP = {'v4': 2, 'v5p': 2, 'v5e': 1, 'v6e': 1}
EXTRAS = {'tpu': ("libtpu", "pip install -e '.[tpu]'"),
          'cuda': ('jax_cuda12_plugin', "pip install -e '.[cuda]'")}
EXAMPLES = ('v5p-8', 'v5p-128', 'v5p:4x4x4', 'v5e-16', 'v5e:16x16', 'v6e-64', 'v6e:8x8',
            'v4-128', 'v4:4x4x4', 'h100x8', 'h200x8', '2x8xh100', 'a100x1', 'a100-40gx1',
            'a100x8', 'l4x1', 'rtx4090x1')


@dataclasses.dataclass(frozen=True)
class Target:
  """A named set of devices: a TPU slice topology or GPU nodes."""
  name: str
  chip: Chip
  topology: str   # TPU: 'AxBxC'; GPU: 'PxHxD' (partitions x hosts x devices per host)
  chips: int
  kernel_family: str | None = None  # a Pallas family asked for every gmm op (None: the chip's)

  @property
  def platform(self) -> str:
    return self.chip.platform

  @functools.cached_property
  def num_devices(self) -> int:
    return len(self.devices())

  @property
  def devices_per_chip(self) -> int:
    return self.num_devices // self.chips

  @property
  def hbm_bytes_per_device(self) -> int:
    return self.chip.hbm_bytes // self.devices_per_chip

  @property
  def peak_flops_per_device(self) -> float:
    return self.chip.peak_bf16_flops / self.devices_per_chip

  def devices(self) -> list:
    """The target's compile-only devices (the extra's compiler; an error naming the pip
    command when the extra is missing)."""
    return list(_devices(self.platform, self.chip.name, self.topology))

  def describe(self) -> dict:
    return {'target': self.name, 'chip': self.chip.name, 'platform': self.platform,
            'topology': self.topology, 'chips': self.chips, 'devices': self.num_devices,
            'hbm_bytes_per_device': self.hbm_bytes_per_device,
            'peak_flops_per_device': self.peak_flops_per_device,
            'ici_bytes_per_s': self.chip.ici_bytes_per_s,
            'dcn_bytes_per_s': self.chip.dcn_bytes_per_s}


def with_memory(target: Target, bytes_per_device: int) -> Target:
  """The target with another memory per device (headroom kept for something else, or a
  smaller part of a shared chip)."""
  chip = dataclasses.replace(target.chip, hbm_bytes=int(bytes_per_device) * target.devices_per_chip)
  return dataclasses.replace(target, chip=chip)


def with_kernel_family(target: Target, family: str | None) -> Target:
  """The target with the Pallas kernel family `family` asked for (aot.kernel_runtime checks
  that its chip runs it); None or '': the chip's own choice."""
  return dataclasses.replace(target, kernel_family=family or None)


def check_extra(platform: str):
  module, pip = EXTRAS[platform]
  if importlib.util.find_spec(module) is None:
    raise ValueError(f'the {platform} compiler is not installed here ({module} missing): '
                     f'run {pip}')


@functools.lru_cache(maxsize=None)
def _devices(platform: str, chip: str, topology: str) -> tuple:
  check_extra(platform)
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  if platform == 'tpu':
    if jax.config.jax_platforms == 'cpu':
      # a process that only compiles holds no TPU: several may load libtpu at once (test
      # workers, a dry run beside a fit), which its lockfile would refuse
      os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
    desc = topologies.get_topology_desc(platform='tpu', topology_name=f'{chip}:{topology}')
  else:
    desc = topologies.get_topology_desc(platform='cuda', topology=topology,
                                        target_config=gpu_target_config(CHIPS[chip]))
  return tuple(desc.devices)


def gpu_target_config(chip: Chip) -> str:
  """The GpuTargetConfigProto text XLA:GPU compiles against: the chip's GpuSpec (compute
  capability, SMs, clock, L2, shared memory) and its memory size and bandwidth; cuDNN 9.8, CUDA
  12.9 (no GPU needed; the field names are the proto's, checked against the plugin's
  descriptor; figures approximate: buffer sizes follow them, no tile is autotuned)."""
  g = chip.gpu
  info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
              shared_memory_per_core=g.smem_per_sm, threads_per_core_limit=g.threads_per_sm,
              core_count=g.sms, fpus_per_core=g.fpus_per_sm, block_dim_limit_x=2147483647,
              block_dim_limit_y=65535, block_dim_limit_z=65535,
              memory_bandwidth=int(chip.hbm_bytes_per_s), l2_cache_size=g.l2_bytes,
              clock_rate_ghz=g.clock_ghz, device_memory_size=chip.hbm_bytes,
              shared_memory_per_block_optin=g.smem_optin)
  body = ''.join(f'  {k}: {v}\n' for k, v in info.items())
  body += f'  cuda_compute_capability {{ major: {g.cc[0]} minor: {g.cc[1]} }}\n'
  body += '  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n'
  return (f'gpu_device_info {{\n{body}}}\nplatform_name: "CUDA"\n'
          'dnn_version_info { major: 9 minor: 8 patch: 0 }\n'
          'runtime_version { major: 12 minor: 9 }\n'
          f'device_description_str: "{chip.device_kinds[0]}"\n')


def _tpu(gen: str, topology: str, name: str) -> Target:
  dims = [int(d) for d in topology.split('x')]
  want = 3 if gen in ('v4', 'v5p') else 2
  if min(dims) < 1:
    raise ValueError(f'target {name!r}: every topology dimension must be >= 1')
  if len(dims) != want:
    raise ValueError(f'target {name!r}: a {gen} topology has {want} dimensions (e.g. '
                     f'{gen}:{"4x4x4" if want == 3 else "8x8"})')
  return Target(name, CHIPS[gen], topology, math.prod(dims))


def get(name: str) -> Target:
  """The target named `name` (module docstring); an unknown name lists the known forms and
  the nearest ones."""
  key = name.strip().lower()
  m = re.fullmatch(r'(v4|v5p|v5e|v6e):(\d+(?:x\d+)+)', key)
  if m:
    return _tpu(m.group(1), m.group(2), key)
  m = re.fullmatch(r'(v4|v5p|v5e|v6e|v5litepod)-(\d+)', key)
  if m:
    gen = 'v5e' if m.group(1) == 'v5litepod' else m.group(1)
    n = int(m.group(2))
    cores = _CORES_PER_CHIP[gen]
    chips, table = n // cores, (_TORUS_3D if gen in ('v4', 'v5p') else _TORUS_2D)
    if n % cores or chips not in table:
      sizes = ', '.join(f'{gen}-{c * cores}' for c in table)
      raise ValueError(f'target {name!r}: no default topology for {n} '
                       f'{"TensorCores" if cores > 1 else "chips"} of {gen}; known: {sizes} '
                       f'(or name the topology, {gen}:AxB{"xC" if gen in ("v4", "v5p") else ""})')
    return _tpu(gen, table[chips], key)
  gpus = '|'.join(sorted(map(re.escape, GPU_CHIPS), key=len, reverse=True))
  m = re.fullmatch(rf'({gpus})x(\d+)', key) or re.fullmatch(rf'(\d+)x(\d+)x({gpus})', key)
  if m and int(m.group(2)) < 1 or m and m.group(1).isdigit() and int(m.group(1)) < 1:
    raise ValueError(f'target {name!r}: node and GPU counts must be >= 1')
  if m and m.group(1) in CHIPS:
    per_node = int(m.group(2))
    return Target(key, CHIPS[m.group(1)], f'1x1x{per_node}', per_node)
  if m:
    nodes, per_node = int(m.group(1)), int(m.group(2))
    return Target(key, CHIPS[m.group(3)], f'1x{nodes}x{per_node}', nodes * per_node)
  near = difflib.get_close_matches(key, EXAMPLES, n=3, cutoff=0.4)
  raise ValueError(f'unknown target {name!r}' + (f' (did you mean {", ".join(near)}?)' if near
                   else '') + f'; known forms: {", ".join(EXAMPLES)}')


def chip_of_kind(device_kind: str) -> Chip | None:
  """The chip whose devices report `device_kind` (exact first, then a known kind contained in
  it: 'NVIDIA H100 PCIe' -> h100, 'NVIDIA A100-SXM4-80GB' -> a100); None when unknown."""
  for chip in CHIPS.values():
    if device_kind in chip.device_kinds:
      return chip
  for chip in CHIPS.values():  # a known kind as a whole word: 'NVIDIA L4' is not an L40S
    if any(re.search(re.escape(k) + r'(?![0-9A-Za-z])', device_kind)
           for k in chip.device_kinds if k.startswith('NVIDIA')) or \
        chip.name.upper() in device_kind.upper().split():
      return chip
  return None


def devices_per_chip(devices) -> int:
  """Devices that share one chip (two TensorCores of a v4 / v5p chip exposed one by one):
  devices over distinct chip coordinates; 1 where devices have none (GPUs, CPUs)."""
  coords = {(getattr(d, 'slice_index', 0), tuple(d.coords)) for d in devices
            if getattr(d, 'coords', None) is not None}
  return max(1, len(devices) // len(coords)) if coords else 1


def peak_flops(device_kind: str, devices_per_chip: int = 1) -> float:
  """Peak dense bf16 FLOP/s of one device of `device_kind` (0.0 when unknown)."""
  chip = chip_of_kind(device_kind)
  if chip is not None:
    return chip.peak_bf16_flops / devices_per_chip
  return next((v for k, v in OTHER_PEAKS.items() if k in device_kind), 0.0)
