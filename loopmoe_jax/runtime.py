"""Where and how the model's programs are built, decided once outside the model and passed in.

    model = LoopedMoE(cfg, runtime=Runtime.for_platform('tpu'))   # a program for a TPU
    model = LoopedMoE(exp.model, runtime=exp.runtime())           # an experiment's run settings
    model = LoopedMoE(cfg, runtime=Runtime.of(remat='full'))      # run settings by hand

`cfg` (config.ModelConfig) is the architecture alone. A `Runtime` holds the run settings
(`run`, config.RunConfig: dispatch backend, remat policy, attention implementation, loss
chunks, ...: how the same parameters run), names the platform a program is built for and how
its Pallas kernels are built (compiled or interpreted, their family and tiles), and the device
mesh the program runs under (`mesh`; `local` inside a shard_map over all of it, where every
value is one device's). Every module and function whose program depends on it takes it as an
argument (`LoopedMoE.runtime`, down to `dispatch.dispatch` and
`pallas_kernels.gmm`); nothing reads it from module globals, so a program kept for reuse keys
on the model that carries it (train/step.py). `Runtime()` is this machine: the platform
`jax.default_backend()`, kernels interpreted on a CPU, compiled elsewhere, and the mesh of
`jax.set_mesh` when the program is traced: `resolved()` is the one place that reads it, and
every module that splits work over the mesh (the MoE layer, attention's fused kernels, the
core's collectives) takes its decision from the resolved runtime: how the looped core runs its
passes is `core_path`, and the shape a weight has inside the core's shard_map `local_shape`.

Building for another platform (`for_platform('tpu')` on this CPU) gives the programs that
platform runs: its dispatch backend, attention implementation, exchange, and Pallas kernels
lowered to Mosaic / Triton calls, for `.trace(...).lower(lowering_platforms=...)` and the
accelerators' compilers (aot.py); nothing built so runs here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax

from loopmoe_jax.config.run import RunConfig
from loopmoe_jax.core_plan import Path
from loopmoe_jax.sharding import batch_size_of, spec
from pallas_kernels.ops import platform_of

PLATFORMS = ('cpu', 'gpu', 'tpu')

# Inside a shard_map over the whole mesh (the looped core's, core_once.py) each device holds a
# view of a weight that is whole but for these logical dimensions, which keep their split over
# the named mesh axis: a device runs its own experts (`Runtime.local_shape`).
LOCAL_SPLIT = {'experts': 'expert'}


def split_inside(name: str, entry) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(kept, gathered): of the mesh axes in `entry` (a PartitionSpec entry: None, an axis or
  a tuple of axes) that split a weight's dimension `name`, those that stay split inside the
  core's shard_map (LOCAL_SPLIT) and those core_once gathers over."""
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  kept = tuple(a for a in axes if a == LOCAL_SPLIT.get(name))
  return kept, tuple(a for a in axes if a not in kept)


def platform_name(name: str) -> str:
  """'cpu', 'gpu' or 'tpu' for a platform or a jax backend name ('cuda' and 'rocm' are 'gpu',
  pallas_kernels.ops.platform_of); anything else is a ValueError naming it."""
  out = platform_of(name)
  if out not in PLATFORMS:
    raise ValueError(f'platform {name!r}: must be one of {list(PLATFORMS)} (or cuda, rocm)')
  return out


def _frozen_tiles(tiles: Mapping[str, Mapping[str, Any]] | None) -> tuple:
  return tuple(sorted((op, tuple(sorted(t.items()))) for op, t in (tiles or {}).items()))


@dataclasses.dataclass(frozen=True)
class Runtime:
  """How and for what the model's programs are built (hashable: part of a kept program's key).

  platform: 'cpu', 'gpu' or 'tpu', the one programs are built for; None: this machine's
    (`jax.default_backend()`).
  interpret: Pallas kernels in interpret mode; None: when the platform is the CPU.
  kernel_family: one Pallas kernel family for every grouped-matmul op ('tpu', 'gpu', 'mgpu',
    'mgpu_ws'); None: the platform's (pallas_kernels.ops.families).
  kernel_tiles: per-op overrides of the kernels' tiles as `pallas_kernels.gmm`'s `tiles`
    ({'gmm': {'family': ..., 'tile_m': ...}, 'tgmm': {...}}), kept as sorted tuples (`with_tiles`).
  mesh: the device mesh (a jax AbstractMesh) programs run under; None: the one `jax.set_mesh`
    sets when they are traced (`resolved`), or one device.
  local: inside a shard_map over every mesh axis (the looped core's, core_once.py): rows,
    experts and statistics are this device's, and nothing more is split.
  run: how the parameters run (config section `run`: dispatch backend, remat, attention
    implementation, loss chunks, ...; config.RunConfig). None of it changes a parameter.
  exchange_dropless: the expert exchange's buffers for the dropless worst case whatever
    model.exchange_buffer_factor says (the replay of an overflowing step, train/step.dropless).
  pallas_check: the Pallas self-check's verdict on this machine, settled once
    (dispatch.settle): '' passed, else why it failed; None: not checked.
  empty_cache: a decode step into an empty cache (a prompt's prefill from position 0,
    decode.decode_step's `empty_cache`): where XLA's products would serve the chunk (no
    decode kernel does; a 'first_pass' core), its attention reads the chunk alone
    (attention.prefill_attend), not every slot of the cache.
  """
  platform: str | None = None
  interpret: bool | None = None
  kernel_family: str | None = None
  kernel_tiles: tuple = ()
  mesh: Any = None
  local: bool = False
  run: RunConfig = RunConfig()
  exchange_dropless: bool = False
  pallas_check: str | None = None
  empty_cache: bool = False

  def __post_init__(self):
    if self.platform is not None:
      object.__setattr__(self, 'platform', platform_name(self.platform))

  @classmethod
  def for_platform(cls, name: str) -> 'Runtime':
    """Programs for platform `name` ('cpu', 'gpu'/'cuda', 'tpu'): kernels compiled unless it
    is this machine's platform and a CPU."""
    name = platform_name(name)
    here = platform_name(jax.default_backend())
    return cls(platform=name, interpret=None if name == here else False)

  @classmethod
  def of(cls, run: RunConfig | None = None, **run_fields) -> 'Runtime':
    """This machine's runtime with the run settings `run` (default RunConfig()), the fields
    `run_fields` replaced: `Runtime.of(remat='full')`."""
    return cls(run=(run or RunConfig()).replace(**run_fields))

  def replace(self, **kw) -> 'Runtime':
    """The same runtime with the fields `kw` replaced."""
    return dataclasses.replace(self, **kw)

  def with_run(self, **kw) -> 'Runtime':
    """The same runtime with the run settings `kw` replaced (run.remat='full': remat='full')."""
    return self.replace(run=self.run.replace(**kw))

  def with_tiles(self, tiles: Mapping[str, Mapping[str, Any]]) -> 'Runtime':
    """The same runtime with the kernels' per-op tiles (and families) `tiles`."""
    return dataclasses.replace(self, kernel_tiles=_frozen_tiles(tiles))

  def constrain(self, x, names):
    """with_sharding_constraint by logical names on this runtime's mesh (`resolved`: the one
    given, or that of `jax.set_mesh`); a no-op without one (one device, decoding, tests of the
    model alone) and inside a shard_map over the whole mesh (the looped core's, core.Core)."""
    rt = self.resolved()
    if not rt.sharded:
      return x
    return jax.lax.with_sharding_constraint(x, spec(names, rt.mesh.axis_names))

  def resolved(self) -> 'Runtime':
    """This runtime with its mesh: the one given, else the mesh of `jax.set_mesh` in force
    (None for none or one device; inside a shard_map over all of it, `local`). The one place
    the ambient mesh is read; idempotent."""
    if self.mesh is not None:
      return self
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      return self
    return dataclasses.replace(self, mesh=mesh, local=self.local or mesh.are_all_axes_manual)

  def local_view(self) -> 'Runtime':
    """The runtime of a body run inside a shard_map over the whole mesh (core_once)."""
    return dataclasses.replace(self.resolved(), local=True)

  def local_shape(self, shape, names) -> tuple[int, ...]:
    """The shape a weight declared as `shape` (logical dimension `names`) has here: itself,
    or inside a shard_map over the whole mesh (`local`) the device's view: each dimension
    whole but over the mesh axes that the rules table gives it and LOCAL_SPLIT keeps split
    (a layer's experts over `expert`; a router's expert dimension is whole)."""
    if not self.local:
      return tuple(shape)
    return tuple(n // math.prod(self.axis(a) for a in split_inside(name, entry)[0])
                 for n, name, entry in zip(shape, names, spec(names, self.mesh.axis_names)))

  def core_path(self, batch: int, *, decode: bool = False, record: bool = False,
                probe: bool = False, initializing: bool = False) -> Path:
    """How the looped core runs its passes on a batch of `batch` rows, decided here alone (a
    resolved runtime): 'unroll' with run.loop_impl='unroll' (a Python loop
    over the passes; decoding always scans); 'once' when run.core_collectives='once' applies
    (core_once.py): a multi-device mesh without `tensor` (heads and expert widths would need
    manual collectives) whose batch shards split the rows, training or evaluation (not
    decoding, routing records, probes or init, which make or read what the whole pass holds);
    else 'scan' (one nn.scan of the passes under XLA's partitioning)."""
    if self.run.loop_impl == 'unroll' and not decode:
      return Path.UNROLL
    once = (self.run.core_collectives == 'once' and self.sharded and self.axis('tensor') == 1
            and batch % batch_size_of(self.mesh) == 0
            and not (decode or record or probe or initializing))
    return Path.ONCE if once else Path.SCAN

  @property
  def sharded(self) -> bool:
    """Work splits over a multi-device mesh here (a resolved runtime, not `local`)."""
    return self.mesh is not None and self.mesh.size > 1 and not self.local

  def axis(self, name: str) -> int:
    """The size of mesh axis `name` (1 without a mesh)."""
    return 1 if self.mesh is None else int(self.mesh.shape.get(name, 1))

  @property
  def target_platform(self) -> str:
    """The platform programs are built for: 'cpu', 'gpu' or 'tpu'."""
    return self.platform or platform_name(jax.default_backend())

  @property
  def kernels(self) -> dict:
    """Keyword arguments of every pallas_kernels call (platform, interpret, target, tiles)."""
    tiles = {op: dict(t) for op, t in self.kernel_tiles} or None
    return dict(platform=self.target_platform, interpret=self.interpret, target=self.kernel_family,
                tiles=tiles)

  @property
  def routing_kernels(self) -> dict:
    """Keyword arguments of the routing, permute and combine kernels (no tiles)."""
    return dict(platform=self.target_platform, interpret=self.interpret, target=self.kernel_family)


HERE = Runtime()  # this machine
