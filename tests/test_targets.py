"""Accelerator targets and the real compilers on this CPU (loopmoe_jax/targets.py, aot.py).

Tests marked `tpu_compile` / `cuda_compile` compile with libtpu / XLA:GPU over compile-only
devices and are skipped, naming the pip command, where that extra is not installed (CI installs
both). They check: meshes a real torus accepts (every axis the size asked, each device once,
expert groups on contiguous ICI blocks; on GPU nodes inside one node); the tiny config's train
step compiled with every Pallas kernel the model traced (the compiled program's Mosaic /
Triton / Mosaic GPU / cuDNN custom calls against the lowered program's); the dry run's memory
equal to the compiled program's `memory_analysis()`; its collective bytes equal to a hand count
on a small sharded program; the compiler preset taking effect (async and overlapped collectives
counted with and without); the peak FLOP/s found for every kind the topologies report.
"""
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import tiny
from loopmoe_jax.train import compile_cache
from loopmoe_jax import aot, attention_impls, hlo, sharding, targets
from loopmoe_jax.config.mesh import MeshConfig

HAS = {p: importlib.util.find_spec(targets.EXTRAS[p][0]) is not None for p in targets.EXTRAS}


MARKS = {p: (getattr(pytest.mark, f'{p}_compile'),
             pytest.mark.skipif(not HAS[p], reason=f'the {p} compiler is not installed: '
                                f'{targets.EXTRAS[p][1]}')) for p in targets.EXTRAS}


def needs(platform):
  marker, skip = MARKS[platform]
  return lambda fn: marker(skip(fn))


# Names, table, errors (no compiler needed) ---------------------------------------------------

def test_target_names_resolve_to_topologies_and_bad_names_list_near_ones():
  """Pod and debug-GPU names resolve to their chip, topology, chip count and memory; an
  unknown name lists the near ones."""
  cases = {'v5p-128': ('v5p', '4x4x4', 64), 'V5P:4x4x4': ('v5p', '4x4x4', 64),
           'v5p-8': ('v5p', '2x2x1', 4), 'v4-128': ('v4', '4x4x4', 64),
           'v5e-256': ('v5e', '16x16', 256), 'v5litepod-16': ('v5e', '4x4', 16),
           'v6e:8x8': ('v6e', '8x8', 64), 'h200x8': ('h200', '1x1x8', 8),
           '2x8xh100': ('h100', '1x2x8', 16), 'a100x1': ('a100', '1x1x1', 1),
           'a100-40gx1': ('a100-40g', '1x1x1', 1), 'a100x8': ('a100', '1x1x8', 8),
           'l4x1': ('l4', '1x1x1', 1), 'rtx4090x1': ('rtx4090', '1x1x1', 1),
           '2x8xa100': ('a100', '1x2x8', 16)}
  for name, (chip, topo, chips) in cases.items():
    t = targets.get(name)
    assert (t.chip.name, t.topology, t.chips) == (chip, topo, chips), name
  gib = {'a100': 80, 'a100-40g': 40, 'l4': 22.49, 'rtx4090': 23.99}
  for chip, want in gib.items():
    assert round(targets.CHIPS[chip].hbm_bytes / 2**30, 2) == want, chip
  for bad, near in (('h300x8', 'h200x8'), ('rtx4080x1', 'rtx4090x1'), ('a10x1', 'a100x1')):
    with pytest.raises(ValueError, match=rf"unknown target '{bad}' \(did you mean {near}"):
      targets.get(bad)
  with pytest.raises(ValueError, match=r"v5p-100.*known: v5p-8, v5p-16"):
    targets.get('v5p-100')
  with pytest.raises(ValueError, match='a v6e topology has 2 dimensions'):
    targets.get('v6e:4x4x4')
  with pytest.raises(ValueError, match='node and GPU counts must be >= 1'):
    targets.get('l4x0')


def test_missing_extra_names_the_pip_command(monkeypatch):
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
  targets._devices.cache_clear()
  with pytest.raises(ValueError, match=re.escape("pip install -e '.[tpu]'")):
    targets.get('v5p-8').devices()
  with pytest.raises(ValueError, match=re.escape("pip install -e '.[cuda]'")):
    targets.get('h100x8').devices()
  targets._devices.cache_clear()


def test_chip_rows_are_found_by_every_device_kind_they_name():
  for chip in targets.CHIPS.values():
    for kind in chip.device_kinds:
      assert targets.chip_of_kind(kind) is chip
      assert targets.peak_flops(kind) == chip.peak_bf16_flops
  # real v5p devices report 'TPU v5' (the lookup that read 'TPU v5p' found nothing)
  assert targets.peak_flops('TPU v5') == 459e12 and targets.peak_flops('TPU v5 lite') == 197e12
  assert targets.chip_of_kind('NVIDIA H100 PCIe').name == 'h100'
  assert targets.peak_flops('NVIDIA A100-SXM4-80GB') == 312e12
  assert targets.chip_of_kind('NVIDIA A100-SXM4-40GB').hbm_bytes == 40 * 2**30
  assert targets.chip_of_kind('NVIDIA L40S') is None  # not an L4
  assert targets.peak_flops('cpu') == 0.0


def test_gpu_target_config_carries_the_chip_row():
  text = targets.gpu_target_config(targets.CHIPS['h200'])
  assert f"device_memory_size: {targets.CHIPS['h200'].hbm_bytes}" in text
  assert 'device_description_str: "NVIDIA H200"' in text and 'major: 9 minor: 0' in text


@pytest.mark.parametrize('name,cc,sms,optin', [('a100', '8 minor: 0', 108, 166912),
                                               ('l4', '8 minor: 9', 58, 101376),
                                               ('rtx4090', '8 minor: 9', 128, 101376),
                                               ('h100', '9 minor: 0', 132, 232448)])
def test_gpu_target_configs_carry_each_chips_capability_sms_and_shared_memory(name, cc, sms,
                                                                              optin):
  text = targets.gpu_target_config(targets.CHIPS[name])
  assert f'cuda_compute_capability {{ major: {cc} }}' in text
  assert f'core_count: {sms}\n' in text and f'shared_memory_per_block_optin: {optin}\n' in text
  assert f'device_description_str: "{targets.CHIPS[name].device_kinds[0]}"' in text


def test_kernel_family_follows_the_compute_capability():
  from pallas_kernels import capability, defaults
  assert capability.gpu_families((9, 0)) == dict(defaults.GPU_DEFAULT)
  assert capability.gpu_families((8, 9)) == capability.gpu_families((8, 0)) == {
      'gmm': 'gpu', 'tgmm': 'gpu'}
  assert capability.gpu_families((7, 5)) is None
  # Ada's 99 KiB opt-in: the Triton tgmm's 3 stages of 48 KiB (the compiler asked 147456 bytes
  # of 101376) pipeline 2 deep; A100's 163 KiB take the defaults; Hopper its default families,
  # named (a program for it is its own on any machine)
  ada, ampere, hopper = (8, 9), (8, 0), (9, 0)
  assert capability.gpu_tiles(ada) == {'gmm': {'family': 'gpu', 'cc': ada},
                                       'tgmm': {'family': 'gpu', 'cc': ada, 'num_stages': 2}}
  assert capability.gpu_tiles(ampere) == {op: {'family': 'gpu', 'cc': ampere} for op in defaults.OPS}
  assert capability.gpu_tiles(hopper) == {op: {'family': f, 'cc': hopper}
                                          for op, f in defaults.GPU_DEFAULT.items()}
  assert capability.gpu_tiles((7, 0)) is None and capability.gpu_tiles(None) is None
  # float32 operands: two stages of the default tiles outgrow Ada's opt-in (an f32 decode step
  # asked 131072 bytes), so the contraction tiles halve; 16-bit ones keep theirs
  assert capability.gpu_tiles(ada, itemsize=4) == {
      'gmm': {'family': 'gpu', 'cc': ada, 'tile_k': 32},
      'tgmm': {'family': 'gpu', 'cc': ada, 'num_stages': 2, 'tile_m': 32}}


def test_a_forced_family_the_target_cannot_run_names_the_capability_and_what_runs():
  with pytest.raises(ValueError, match=re.escape(
      "--kernel_family=mgpu: kernel family 'mgpu' (Mosaic GPU) needs compute capability 9.0+, "
      'the target has 8.9; what runs there: gmm: gpu (Triton), tgmm: gpu (Triton)')):
    aot.kernel_runtime(targets.with_kernel_family(targets.get('rtx4090x1'), 'mgpu'))
  with pytest.raises(ValueError, match="mgpu_ws' .* the target has 8.0"):
    aot.kernel_runtime(targets.with_kernel_family(targets.get('a100x1'), 'mgpu_ws'))
  with pytest.raises(ValueError, match="--kernel_family=gpu: target v5p-8 is a TPU: use 'tpu'"):
    aot.kernel_runtime(targets.with_kernel_family(targets.get('v5p-8'), 'gpu'))
  for bad in ('foo', 'tpu'):  # not a GPU family: refused up front, naming the flag
    with pytest.raises(ValueError, match=rf'--kernel_family={bad}: target rtx4090x1 is a GPU: '
                                         'one of gpu, mgpu, mgpu_ws'):
      aot.kernel_runtime(targets.with_kernel_family(targets.get('rtx4090x1'), bad))
  forced = aot.kernel_runtime(targets.with_kernel_family(targets.get('h100x8'), 'gpu'))
  assert dict(forced.kernel_tiles)['gmm'] == (('cc', (9, 0)), ('family', 'gpu'))
  # no family asked: Hopper's default families, the same kernels and tiles as the platform's
  # default on this CPU (the H100 program is unchanged)
  from pallas_kernels import ops
  h100 = aot.kernel_runtime(targets.get('h100x8')).kernels
  assert ops.tiling(h100['target'], overrides=h100['tiles'], platform='gpu') == ops.tiling(
      None, platform='gpu')


def test_on_a_real_ada_gpu_the_default_is_triton_and_mosaic_gpu_is_refused(monkeypatch):
  """On this machine's GPU (faked: an sm_89 backend) the default families are its compute
  capability's, and a kernel asking for Mosaic GPU is refused before it is lowered."""
  import pallas_kernels as pk
  from pallas_kernels import capability
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  monkeypatch.setattr(capability, 'local_cc', lambda: (8, 9))
  assert pk.ops.families(None, 'gpu') == {'gmm': 'gpu', 'tgmm': 'gpu'}
  # the Triton weight gradient pipelines 2 stages within Ada's shared memory (3 elsewhere)
  gmm_cfg, tgmm_cfg = (dict(op) for op in pk.ops.tiling(None, platform='gpu'))
  assert (gmm_cfg['num_stages'], tgmm_cfg['num_stages']) == (3, 2)
  assert dict(pk.ops.tiling(None, platform='cpu')[1])['num_stages'] == 3
  lhs, rhs = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"kernel family 'mgpu' \(Mosaic GPU\) \(gmm\) needs "
                     r'compute capability 9.0\+, the target has 8.9'):
    pk.gmm(lhs, rhs, jnp.array([4, 4]), target='mgpu', platform='gpu', interpret=False)
  with pytest.raises(ValueError, match=r"kernel family 'mgpu' \(Mosaic GPU\) \(gmm\) needs"):
    pk.ops.tiling(None, overrides={'gmm': {'family': 'mgpu'}}, platform='gpu')  # named here
  # a program built here for another GPU target is that target's, not this machine's: the
  # H100's Mosaic GPU gmm and 3-stage Triton tgmm, the L4's 2-stage tgmm on a faked Hopper
  for name, host, want in (('h100x8', (8, 9), (('mgpu', None), ('gpu', 3))),
                           ('l4x1', (9, 0), (('gpu', 3), ('gpu', 2)))):
    monkeypatch.setattr(capability, 'local_cc', lambda host=host: host)
    kw = aot.kernel_runtime(targets.get(name)).kernels
    got = [dict(op) for op in pk.ops.tiling(kw['target'], overrides=kw['tiles'],
                                            platform='gpu')]
    assert [(c['family'], c.get('num_stages')) for c in got] == list(want), name


# Topologies and meshes -----------------------------------------------------------------------

@needs('tpu')
@pytest.mark.parametrize('name', ['v4:2x2x2', 'v5e:4x4', 'v5p:2x2x2', 'v6e:4x4'])
def test_every_tpu_kind_finds_its_peak_and_memory(name):
  t = targets.get(name)
  devices = t.devices()
  kind = devices[0].device_kind
  per_chip = targets.devices_per_chip(devices)
  assert per_chip == t.devices_per_chip  # from coordinates == from the chip count
  assert targets.chip_of_kind(kind) is t.chip, kind
  assert targets.peak_flops(kind, per_chip) * t.num_devices == t.chip.peak_bf16_flops * t.chips
  assert t.hbm_bytes_per_device * t.num_devices == t.chip.hbm_bytes * t.chips


@needs('cuda')
@pytest.mark.parametrize('name,peak', [('h100x8', 989e12), ('h200x8', 989e12),
                                       ('a100x1', 312e12), ('a100-40gx1', 312e12),
                                       ('l4x1', 121e12), ('rtx4090x1', 165.2e12)])
def test_gpu_kinds_find_their_peak_and_memory(name, peak):
  """The compile-only device's kind finds its chip row, and its published bf16 dense peak."""
  from loopmoe_jax.train import preflight
  t = targets.get(name)
  device = t.devices()[0]
  assert targets.chip_of_kind(device.device_kind) is t.chip
  assert targets.peak_flops(device.device_kind) == t.chip.peak_bf16_flops == peak
  assert device.compute_capability == '.'.join(map(str, t.chip.compute_capability))
  # a device without allocator stats (compile-only here) takes its chip's memory
  assert preflight.device_memory_bytes(device) == t.chip.hbm_bytes


def _groups(mesh, axis):
  arr = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
  return arr.reshape(-1, arr.shape[-1])


def _is_box(coords, torus):
  """The coordinates fill a sub-block of the torus: per physical axis a run of consecutive
  values (cyclically), and as many points as the block's volume."""
  coords = np.array(coords)
  extent = 1
  for ax, n in enumerate(torus):
    vals = sorted(set(coords[:, ax]))
    k = len(vals)
    gaps = [(vals[(i + 1) % k] - vals[i]) % n for i in range(k)]
    if k > 1 and k < n and sorted(gaps)[:-1] != [1] * (k - 1):
      return False
    extent *= k
  return extent == len({tuple(c) for c in coords}) == len(coords)


@needs('tpu')
@pytest.mark.parametrize('name,axes', [
    ('v5p:4x4x4', dict(data=1, fsdp=8, expert=8)),     # the README's Foil-2 pod mesh
    ('v5p:4x4x4', dict(data=4, expert=16)),
    ('v6e:8x8', dict(data=1, fsdp=8, expert=8)),
    ('v6e:8x8', dict(data=2, fsdp=2, expert=8, tensor=2))])
def test_meshes_a_torus_accepts_keep_expert_groups_on_contiguous_blocks(name, axes):
  t = targets.get(name)
  devices = t.devices()
  mesh = sharding.make_mesh(MeshConfig(**axes), devices)
  assert {a: mesh.shape[a] for a in axes} == axes
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
  torus = sharding._torus_shape(devices)
  for axis in ('expert', 'tensor'):
    if mesh.shape[axis] > 1:
      for group in _groups(mesh, axis):
        assert _is_box([d.coords for d in group], torus), (axis, [d.coords for d in group])


@needs('cuda')
def test_gpu_nodes_keep_expert_and_tensor_inside_a_node():
  devices = targets.get('2x8xh100').devices()
  mesh = sharding.make_mesh(MeshConfig(data=2, expert=4, tensor=2), devices)
  for axis in ('expert', 'tensor'):
    for group in _groups(mesh, axis):
      assert len({d.process_index for d in group}) == 1


# The tiny train step on the real compilers ----------------------------------------------------

TINY = {'tpu': ('v5p:2x2x1', dict(data=1, fsdp=2, expert=2)),
        'cuda': ('h100x8', dict(data=2, expert=4))}


def _tiny_cfg(platform):
  cfg = tiny(dispatch='auto')
  cfg.model.dtype = 'bfloat16'
  cfg.model.head_dim = 64 if platform == 'cuda' else 16  # cuDNN takes multiples of 8
  cfg.model.num_heads = 2
  for k, v in TINY[platform][1].items():
    cfg.mesh[k] = v
  return cfg


@functools.lru_cache(maxsize=None)
def _compiled(platform, preset):
  """(compiled program, lowered StableHLO text, report) of the tiny step on the platform."""
  target = targets.get(TINY[platform][0])
  cfg = _tiny_cfg(platform)
  lowered, _, _, _ = aot.lower_step(cfg, target)
  with compile_cache.off():
    compiled = lowered.compile(aot.compiler_options(platform, preset))
  report = aot.target_report(cfg, target, preset, use_cache=False) if preset == 'pod' else None
  return compiled, lowered.as_text(), report


LOWERED_CALLS = {'tpu': {'mosaic': '@tpu_custom_call'},
                 'cuda': {'triton': '@__gpu$xla.gpu.triton', 'mosaic_gpu': '@mosaic_gpu',
                          'cudnn_attention': '@__cudnn$fmha'}}


@pytest.mark.slow
@pytest.mark.parametrize('platform', [pytest.param('tpu', marks=MARKS['tpu']),
                                      pytest.param('cuda', marks=MARKS['cuda'])])
def test_tiny_train_step_compiles_every_kernel_the_model_traced(platform):
  """Every Mosaic (TPU), Triton, Mosaic GPU and cuDNN attention (GPU) call of the lowered
  step is in the compiled program."""
  compiled, lowered, report = _compiled(platform, 'pod')
  text = compiled.as_text()
  for family, target in aot.KERNEL_CALLS[platform].items():
    traced = lowered.count(LOWERED_CALLS[platform][family])
    assert traced > 0, family  # the model asks for this kernel family on this platform
    compiled_calls = text.count(f'custom_call_target="{target}')
    # none dropped (the preset's loop pipelining may peel an iteration, copying its calls)
    assert compiled_calls >= traced, (family, compiled_calls, traced)
    assert report['lowered_for']['kernel_calls'][family] == compiled_calls
  assert report['lowered_for']['ragged_all_to_all'] > 0  # the platform's ragged exchange


@pytest.mark.slow
@pytest.mark.parametrize('platform', [pytest.param('tpu', marks=MARKS['tpu']),
                                      pytest.param('cuda', marks=MARKS['cuda'])])
def test_dry_run_memory_is_the_compiled_programs(platform):
  compiled, _, report = _compiled(platform, 'pod')
  mem = compiled.memory_analysis()
  b = report['bytes_per_device']
  assert (b['arguments'], b['outputs'], b['aliases'], b['temporaries'], b['code']) == (
      mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
      mem.temp_size_in_bytes, mem.generated_code_size_in_bytes)
  assert b['total'] == (b['arguments'] + b['outputs'] - b['aliases'] + b['temporaries'] +
                        b['code'])
  assert report['fits'] == (b['total'] <= report['hbm_bytes_per_device'])
  # collectives of the compiled program, by kind, as the report states them
  assert report['collectives'] == hlo.collective_bytes(compiled.as_text())
  # the parameters' bytes per device fit inside the program's arguments
  assert report['params_bytes_per_device'] + report['opt_state_bytes_per_device'] <= b['arguments']


@pytest.mark.slow
@pytest.mark.parametrize('platform', [pytest.param('tpu', marks=MARKS['tpu']),
                                      pytest.param('cuda', marks=MARKS['cuda'])])
def test_compiler_preset_makes_collectives_overlap(platform):
  pod = hlo.collective_ops(hlo.collectives(_compiled(platform, 'pod')[0].as_text()))
  none = hlo.collective_ops(hlo.collectives(_compiled(platform, 'none')[0].as_text()))
  total = lambda ops, f: sum(v[f] for v in ops.values())
  assert total(pod, 'overlapped') > total(none, 'overlapped'), (pod, none)


def _one_gpu_cfg():
  cfg = _tiny_cfg('cuda')  # bfloat16, heads of 64: cuDNN attention
  cfg.mesh.data = cfg.mesh.expert = 1
  return cfg


def _decode_step(cfg, target_name, batch=4, slots=1024, per_row=False, **run):
  """(compiled decode step of `cfg` on one device of the target with the run settings `run`,
  cache bytes, the ops of the optimized program that make an array at least one slot's size:
  copies, transposes, slices and scatters of the cache). `per_row`: a position per row (the
  batch program's cache)."""
  from loopmoe_jax.decode import cache_shapes, decode_step
  from loopmoe_jax.model import LoopedMoE, for_init
  target = targets.get(target_name)
  shard = jax.sharding.SingleDeviceSharding(target.devices()[0])
  spec = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shard)
  params = jax.eval_shape(lambda: for_init(LoopedMoE(cfg)).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params'])
  cache = dict(jax.tree.map(spec, cache_shapes(cfg, batch, slots)))
  if per_row:
    cache['position'] = spec(jax.ShapeDtypeStruct((batch,), jnp.int32))
  runtime = aot.kernel_runtime(target).with_run(**run)
  step = jax.jit(lambda p, c, t: decode_step(cfg, p, c, t, runtime=runtime), donate_argnums=1)
  with compile_cache.off():  # compile-only devices: nothing to load a kept program onto
    compiled = step.lower(jax.tree.map(spec, params), cache,
                          jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=shard)).compile()
  one_slot = batch * cfg.kv_heads * slots * cfg.resolved_head_dim
  big = []
  for line in compiled.as_text().splitlines():
    m = re.match(r'\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(', line)
    if m and m.group(2) not in ('parameter', 'get-tuple-element', 'bitcast', 'custom-call') and (
        np.prod([int(d) for d in m.group(1).split(',') if d]) >= one_slot):
      big.append(line.strip()[:120])
  return compiled, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)), big


@needs('cuda')
@pytest.mark.parametrize('layout', [dict(), dict(tie_attention=False),
                                    dict(exit='kl', exit_threshold=0.01)],
                         ids=['tied', 'untied', 'early_exit'])
def test_a_decode_step_keeps_its_cache_in_place_on_the_gpu(layout):
  """A decode step compiled by XLA:GPU for an H100 writes the new K/V into the cache where it
  lies: no cache-sized transpose or copy in the optimized program (the scan once sliced each
  pass's slot out and back and the dots transposed the [B, S, G, K] cache: 28 such ops and
  more temporaries than the whole cache), and temporaries well under the cache. Under early
  exit too (a cond per pass copied the carried cache: 11 copies, temporaries 80 MiB over a
  64 MiB cache; the passes now run in a loop that stops, early_exit._decode_passes)."""
  from loopmoe_jax.experiment import build
  cfg = build(_one_gpu_cfg()).model.replace(num_loops=3, **layout)
  compiled, cache_bytes, big = _decode_step(cfg, 'h100x1')
  big = [line for line in big if re.search(r' (transpose|copy)\(', line)]
  assert not big, big
  assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 4


@needs('tpu')
@pytest.mark.parametrize('head_dim,dtype', [(128, 'float32'), (32, 'float32'), (128, 'bfloat16')],
                         ids=['heads of 128', 'slots minor', 'packed rows'])
def test_a_tpu_decode_step_reads_its_cache_once_in_the_pallas_kernels(head_dim, dtype):
  """On a TPU a decode step's attention runs in the Pallas decode kernels: the cache is
  written by DMA and read where it lies (heads under 128 lanes: in the slots-minor layout XLA
  keeps it in), so the optimized program holds no cache-sized op but the kernels' calls, its
  temporaries are a sliver of the cache, and its bytes (XLA's count, plus at most the whole
  cache the kernels read) are under the XLA path's, which copies the carried cache to and
  from its scatter's and its products' layouts. (bfloat16: the MoE's permute and combine
  kernels compile for one chip too, permute.py.)"""
  from loopmoe_jax.experiment import build
  cfg = build(tiny()).model.replace(num_loops=3, head_dim=head_dim, num_heads=4,
                                    num_kv_heads=2, d_model=64, dtype=dtype)
  size = dict(batch=8, slots=4096)
  compiled, cache_bytes, big = _decode_step(cfg, 'v5p:2x2x1', **size)
  assert not big, big
  assert 'tpu_custom_call' in compiled.as_text()
  assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 8
  xla, _, xla_big = _decode_step(cfg, 'v5p:2x2x1', **size, attention_impl='xla')
  assert xla_big  # the XLA path moves the cache around
  accessed = lambda c: (c.cost_analysis()[0] if isinstance(c.cost_analysis(), list)
                        else c.cost_analysis())['bytes accessed']
  assert accessed(compiled) + cache_bytes < accessed(xla)


@needs('tpu')
@pytest.mark.parametrize('head_dim,per_row', [(128, False), (32, False), (32, True)],
                         ids=['heads of 128', 'slots minor', 'a position per row'])
def test_a_tpu_decode_step_with_early_exit_keeps_its_cache_in_place(head_dim, per_row):
  """Early exit's decode step on a TPU: its passes run in a loop that carries the cache (a
  cond per pass copied it) and the skipped passes' slots are filled in a window of the step's
  slots (whole lane tiles where XLA keeps the cache slots-minor: it copied the whole cache to
  another layout to read one slot, and to gather each row's under a position per row, the
  batch program's cache); the only cache-sized ops left are the fill's in-place updates, and
  the temporaries a sliver of the cache (before, a bf16 step with heads of 64 held 163.6 MiB
  of temporaries over its 64 MiB cache, 162.0 MiB with a position per row; docs/results.md,
  stop 65)."""
  from loopmoe_jax.experiment import build
  cfg = build(tiny()).model.replace(num_loops=3, head_dim=head_dim, num_heads=4,
                                    num_kv_heads=2, d_model=64, exit='kl', exit_threshold=0.01)
  compiled, cache_bytes, big = _decode_step(cfg, 'v5p:2x2x1', batch=8, slots=4096,
                                            per_row=per_row)
  moves = [line for line in big if not re.search(r' dynamic-update-slice\(', line)]
  assert not moves, moves
  assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 8


@needs('cuda')
@pytest.mark.parametrize('name,head_dim,dtype', [('h100x1', 32, 'float32'),
                                                 ('a100x1', 64, 'bfloat16'),
                                                 ('rtx4090x1', 128, 'float32')])
def test_a_gpu_decode_step_reads_its_cache_in_the_pallas_kernel(name, head_dim, dtype):
  """On a GPU a decode step's products run in the Triton decode kernel, which reads the
  filled slots where they lie: the only cache-sized ops XLA:GPU keeps are the in-place
  writes (scatters), and its temporaries are a sliver of the cache; XLA's products copy
  the pass's slot out, convert and multiply it whole (a read of every slot, filled or not).
  (float32 on an RTX 4090: the MoE's Triton tiles and the kernel's key blocks fit Ada's
  shared memory, capability.py, decode_attention_gpu.key_block.)"""
  from loopmoe_jax.experiment import build, load_config
  cfg = build(load_config('configs/default.py')).model.replace(num_loops=3, head_dim=head_dim,
                                                               dtype=dtype)
  size = dict(batch=8, slots=4096)
  reads = lambda big: [line for line in big if 'scatter' not in line.split('=')[0]]
  compiled, cache_bytes, big = _decode_step(cfg, name, **size)
  assert not reads(big), big
  assert compiled.as_text().count('__triton') >= 2 * 3  # the layers' kernels (and the MoE's)
  assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 32
  xla, _, xla_big = _decode_step(cfg, name, **size, attention_impl='xla')
  assert reads(xla_big)
  assert xla.memory_analysis().temp_size_in_bytes > cache_bytes / 32


@pytest.mark.slow
@needs('cuda')
@pytest.mark.parametrize('name', ['a100x1', 'rtx4090x1'])
def test_tiny_step_compiles_every_kernel_for_one_debug_gpu(name):
  """On sm_80 / sm_89 the model traces Triton kernels (no Mosaic GPU: wgmma is Hopper's) and
  cuDNN attention, and the CUDA plugin compiles every one of them for the target."""
  target = targets.get(name)
  lowered, _, _, _ = aot.lower_step(_one_gpu_cfg(), target)
  text = lowered.as_text()
  traced = {f: text.count(call) for f, call in LOWERED_CALLS['cuda'].items()}
  assert traced['triton'] > 0 and traced['cudnn_attention'] > 0, traced
  assert traced['mosaic_gpu'] == 0, traced
  summary, _ = aot.compile_summary(_one_gpu_cfg(), target, use_cache=False)
  for family, n in traced.items():
    assert summary['kernel_calls'][family] >= n, (family, summary['kernel_calls'], traced)


@needs('cuda')
def test_a_gpu_no_pallas_family_runs_on_takes_the_xla_dispatch_and_says_so(monkeypatch, caplog):
  """A compute capability below every family's (7.0, a V100-like row): `auto` dispatch lowers
  to ragged_dot with no Pallas kernel, the choice said in one warning line; run.dispatch=
  'pallas' is refused naming why and what works."""
  gpu = dataclasses.replace(targets.AMPERE_A100, cc=(7, 0))
  chip = dataclasses.replace(targets.CHIPS['a100'], name='v100', gpu=gpu,
                             device_kinds=('Tesla V100-SXM2-32GB',))
  monkeypatch.setitem(targets.CHIPS, 'v100', chip)
  target = targets.Target('v100x1', chip, '1x1x1', 1)
  cfg = _one_gpu_cfg()
  cfg.run.attention_impl = 'chunked'  # cuDNN's flash attention needs sm_80 too
  with caplog.at_level('INFO', logger='loopmoe_jax'):
    lowered, _, _, _ = aot.lower_step(cfg, target)
  text = lowered.as_text()
  assert 'ragged_dot' in text and text.count(LOWERED_CALLS['cuda']['triton']) == 0
  said = [r.getMessage() for r in caplog.records if 'v100x1' in r.getMessage()]
  assert said == ['v100x1 kernels, no Pallas GPU kernel family compiles for compute capability '
                  '7.0 (Triton needs 8.0+): the MoE dispatch runs XLA (run.dispatch=xla: '
                  'jax.lax.ragged_dot)']
  cfg.run.dispatch = 'pallas'
  with pytest.raises(ValueError, match=re.escape(
      "target v100x1: run.dispatch='pallas': no Pallas GPU kernel family compiles for compute "
      'capability 7.0 (Triton needs 8.0+); use auto or xla')):
    aot.lower_step(cfg, target)


@needs('tpu')
def test_a_config_that_does_not_fit_says_by_how_much_and_what_to_change():
  t = targets.get('v5p:2x2x1')
  small = dataclasses.replace(t, chip=dataclasses.replace(t.chip, hbm_bytes=4 * 2**20))
  report = aot.target_report(_tiny_cfg('tpu'), small, use_cache=False)
  assert not report['fits'] and report['headroom_bytes'] < 0
  over = -report['headroom_bytes'] / 2**30
  assert f'{over:,.2f} GiB over' in report['advice'] and 'run.remat' in report['advice']


# Collective bytes of a compiled program against a hand count ----------------------------------

SCHEDULED = """\
HloModule m, is_scheduled=true

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %ars = f32[8,4]{1,0:T(8,128)} all-reduce-start(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  %f = f32[8,4]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %ard = f32[8,4]{1,0} all-reduce-done(%ars)
  ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%i, %ard)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%async_collective_fusion.1 (a: bf16[2,8]) -> bf16[8,8] {
  %a = bf16[2,8]{1,0} parameter(0)
  ROOT %ag = bf16[8,8]{1,0:T(8,128)(2,1)} all-gather(%a), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
}

ENTRY %main (a: bf16[2,8]) -> bf16[8,8] {
  %w = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body
  %cps = (f32[16]{0}, f32[16]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%y), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16]{0} collective-permute-done(%cps)
  %rs = ((bf16[64,8]{1,0}, s64[4]{0}, /*index=2*/s64[4]{0}), bf16[32,8]{1,0}) ragged-all-to-all-start(%big, %out, %o, %s), channel_id=4, replica_groups={{0,1,2,3}}, backend_config={"is_sync":true}
  %d = f32[8]{0} dot(%u, %v), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %rd = bf16[32,8]{1,0} ragged-all-to-all-done((bf16[64,8]{1,0}, bf16[32,8]{1,0}) %rs)
  ROOT %f2 = bf16[8,8]{1,0} fusion(%a), kind=kCustom, calls=%async_collective_fusion.1
}
"""


def test_scheduled_program_start_done_pairs_are_read_by_their_outputs():
  """A scheduled module by hand: an async all-reduce with a fusion before its done, in a loop
  of 3; a collective-permute-start whose tuple holds operand, output and two contexts, its done
  right after it; a ragged all-to-all the scheduler made synchronous (is_sync) whose done
  prints its operand's shape; an all-gather at the ROOT of a TPU async collective fusion."""
  colls = {c['kind']: c for c in hlo.collectives(SCHEDULED)}
  assert colls['all-reduce']['bytes'] == 8 * 4 * 4 and colls['all-reduce']['times'] == 3
  assert colls['all-reduce']['async'] and colls['all-reduce']['overlapped']
  assert colls['collective-permute']['bytes'] == 16 * 4  # the output, not the tuple's sum
  assert colls['collective-permute']['async'] and not colls['collective-permute']['overlapped']
  ragged = colls['ragged-all-to-all']
  assert ragged['bytes'] == 32 * 8 * 2 and not ragged['async'] and not ragged['overlapped']
  assert colls['all-gather']['bytes'] == 8 * 8 * 2  # a ROOT line
  assert colls['all-gather']['async'] and colls['all-gather']['overlapped']
  assert hlo.collective_ops(hlo.collectives(SCHEDULED)) == {
      'all-gather': {'ops': 1, 'async': 1, 'overlapped': 1},
      'all-reduce': {'ops': 3, 'async': 3, 'overlapped': 3},
      'collective-permute': {'ops': 1, 'async': 1, 'overlapped': 0},
      'ragged-all-to-all': {'ops': 1, 'async': 0, 'overlapped': 0}}


def _small_program(devices):
  """A shard_map over 4 devices: a psum of [256, 128] float32 three times in a loop, and an
  all-gather of [64, 128] bfloat16 per device into [256, 128]."""
  mesh = jax.sharding.Mesh(np.array(devices[:4]), ('x',))

  def body(a, b):
    def step(_, acc):
      return acc + jax.lax.psum(jnp.sin(acc), 'x')
    a = jax.lax.fori_loop(0, 3, step, a)
    return a, jax.lax.all_gather(b, 'x', tiled=True)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P('x')), out_specs=(P(), P()),
                     check_vma=False)
  a = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
  b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P('x')))
  with compile_cache.off():
    return jax.jit(fn).lower(a, b).compile()


@pytest.mark.parametrize('platform,name', [
    pytest.param('tpu', 'v5p:2x2x1', marks=MARKS['tpu']),
    pytest.param('cuda', 'h100x8', marks=MARKS['cuda'])])
def test_collective_bytes_equal_a_hand_count(platform, name):
  compiled = _small_program(targets.get(name).devices())
  got = hlo.collective_bytes(compiled.as_text())
  assert got.get('all-reduce', 0) == 3 * 256 * 128 * 4
  assert got.get('all-gather', 0) == 256 * 128 * 2
  assert set(got) == {'all-reduce', 'all-gather'}


# The fit finder ------------------------------------------------------------------------------

@pytest.mark.slow
@needs('tpu')
def test_fit_finder_marks_the_cheapest_candidate_that_fits_and_reruns_from_its_cache(
    tmp_path, monkeypatch):
  from loopmoe_jax import fit
  monkeypatch.setenv('LOOPMOE_COMPILE_CACHE', str(tmp_path))
  cfg = _tiny_cfg('tpu')
  # assignment rows under every policy: by token rows (the 'auto' choice under full) this
  # tiny model's full remat keeps more than its none (43.1 against 33.3 MB: the expanded
  # expert outputs kept for the weights' gradient), so no candidate would fit one byte short
  cfg.run.exchange_rows = 'assignment'
  whole = _compiled('tpu', 'pod')[2]['bytes_per_device']['total']
  # a device one byte short of what the config as given needs
  target = targets.with_memory(targets.get(TINY['tpu'][0]), whole - 1)
  search = {'run.remat': ('none', 'full'), 'train.microbatches': (1, 2)}
  rows, best = fit.find(cfg, target, search, log=lambda _: None)
  assert rows[0]['run'] == {'run.remat': 'none', 'train.microbatches': 1}
  assert rows[0]['bytes_per_device']['total'] == whole and rows[0]['fits'] is False
  assert best is not None and rows[best]['fits']
  assert rows[best]['bytes_per_device']['total'] <= target.hbm_bytes_per_device
  flops = [r['flops_per_step_per_device'] for r in rows]
  assert flops == sorted(flops)  # cheapest first; every row before the best is compiled, no fit
  assert all(r['fits'] is False for r in rows[:best])
  assert all(r['bytes_per_device'] is None for r in rows[best + 1:])
  full = [r for r in rows if r['run']['run.remat'] == 'full']
  assert all(r['flops_over_none'] > 1 for r in full)
  again, best_again = fit.find(cfg, target, search, log=lambda _: None)
  assert best_again == best and all(r['cached'] for r in again[:best + 1])
  assert [r['bytes_per_device'] for r in again] == [r['bytes_per_device'] for r in rows]


def test_fit_finder_ranks_exchange_variants_by_their_estimated_step(monkeypatch):
  """Candidates that differ only in the exchange's settings (fit.STEP_KEYS, the same
  FLOPs) are all compiled once one fits and the shortest estimated step wins; the next
  candidate that differs otherwise is not compiled. The compiler is a stand-in here: the
  settings and their order are fit.find's own."""
  from loopmoe_jax import fit
  steps = {(1, 'full'): 0.3, (2, 'full'): 0.2, (1, 'none'): None, (2, 'none'): None,
           (1, 'full_keep_exchange'): 0.15, (2, 'full_keep_exchange'): None}
  compiled = []

  def candidate(cfg, target, settings, preset, flops):
    key = (settings['run.exchange_streams'], settings['run.remat'])
    compiled.append(key)
    fits = steps[key] is not None
    return {'bytes_per_device': {'total': 1 if fits else 1 << 50}, 'fits': fits,
            'time_bounds_s': {'estimated_step': steps[key] or 1.0}, 'cached': True}
  monkeypatch.setattr(aot, 'candidate', candidate)
  cfg = _tiny_cfg('tpu')
  search = {'run.remat': ('none', 'full', 'attention'), 'run.exchange_streams': (1, 2)}
  traced = []
  monkeypatch.setattr(fit.dry_run, 'step_flops', lambda cfg, n: traced.append(
      cfg['run']['remat']) or {'none': 1.0, 'full': 2.0, 'attention': 3.0}[cfg['run']['remat']])
  rows, best = fit.find(cfg, targets.get(TINY['tpu'][0]), search, log=lambda _: None)
  assert rows[best]['run'] == {'run.remat': 'full', 'run.exchange_streams': 2}
  assert compiled == [(1, 'none'), (2, 'none'), (1, 'full'), (2, 'full')]
  # full_keep_exchange has full's recompute: traced as full, compiled beside it, ranked by
  # its step (a variant of it that does not fit is a row, not the best)
  compiled.clear()
  search['run.remat'] += ('full_keep_exchange',)
  rows, best = fit.find(cfg, targets.get(TINY['tpu'][0]), search, log=lambda _: None)
  assert rows[best]['run'] == {'run.remat': 'full_keep_exchange', 'run.exchange_streams': 1}
  assert compiled[2:] == [(1, 'full'), (2, 'full'), (1, 'full_keep_exchange'),
                          (2, 'full_keep_exchange')]
  assert 'full_keep_exchange' not in traced
  assert all(r['bytes_per_device'] is None for r in rows if r['run']['run.remat'] == 'attention')


def test_the_estimated_step_adds_what_the_program_does_not_overlap():
  """time_bounds by hand on three collectives of an 8-GPU node (450 GB/s links, 15 us an op):
  the latency counts every op; the exposed time is the ops that overlap nothing, bytes and
  latency; the estimate is the larger of compute and the overlapped ops' time, plus that. A
  chip without a latency figure is refused naming its row."""
  chip = targets.CHIPS['h100']
  t = targets.Target('h100x8', chip, '1x1x8', 8)
  t.__dict__['num_devices'] = 8  # no compile-only devices needed
  colls = [dict(times=10, bytes=450_000, overlapped=True),     # 10 x (1 us + 15 us)
           dict(times=4, bytes=4_500_000, overlapped=False),   # 4 x (10 us + 15 us)
           dict(times=1, bytes=0, overlapped=False)]           # 15 us
  got = aot.time_bounds(colls, 1e-4, t)
  assert got['latency'] == pytest.approx(15 * 15e-6)
  assert got['exposed'] == pytest.approx(4 * 25e-6 + 15e-6)
  assert got['communication'] == pytest.approx((4.5e6 + 18e6) / 450e9)
  assert got['estimated_step'] == pytest.approx(max(1e-4, 10 * 16e-6) + 115e-6)
  assert aot.time_bounds(colls, 1e-3, t)['estimated_step'] == pytest.approx(1e-3 + 115e-6)
  bare = dataclasses.replace(t, chip=dataclasses.replace(chip, collective_latency_s=0.0))
  bare.__dict__['num_devices'] = 8
  with pytest.raises(ValueError, match="chip 'h100' has no collective_latency_s in "
                                       "loopmoe_jax/targets.py CHIPS"):
    aot.time_bounds(colls, 1e-4, bare)


def test_a_compiler_refusal_for_memory_is_read_not_raised():
  """libtpu's refusal of a program whose temporaries exceed the chip's memory (its own words)
  is read into bytes, in the units it prints; any other error is not a refusal."""
  line = ('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO '
          'temporaries (139.80G) exceeds available HBM (95.74G).')
  got = aot.refusal(RuntimeError(line + '\nmore'))
  assert got == {'temporaries': int(139.80 * 2**30), 'available': int(95.74 * 2**30)}
  assert aot.refusal(RuntimeError(line.replace('139.80G', '512M')))['temporaries'] == 2**29
  assert aot.refusal(RuntimeError('INTERNAL: something else')) is None


# the README main job's smoke model at 4096 sequences of 4096 tokens on v5p:2x2x1 (fsdp 2 x
# expert 2): about 1,000 sequences a device, whose temporaries libtpu refuses without remat
TOO_BIG = ('--config=configs/default.py:smoke', '--config.data.seq_len=4096',
           '--config.data.batch_size=4096', '--config.mesh.data=1', '--config.mesh.fsdp=2',
           '--config.mesh.expert=2')


@pytest.mark.slow
@needs('tpu')
def test_a_step_the_compiler_refuses_is_a_row_and_one_line_not_a_crash(tmp_path, monkeypatch):
  """A train step libtpu refuses for memory: the dry run's report says so (fits false, the
  bytes the compiler asked for beside the state and batch a device holds), the fit finder
  takes the refusal as a row that does not fit and goes on to the candidate that does (16
  microbatches), and the script exits 1 with one line naming what it needs and by how much
  it is over, and still writes its JSON. The refusal is cached like a compile."""
  from loopmoe_jax import fit
  from loopmoe_jax.experiment import load_config
  monkeypatch.setenv('LOOPMOE_COMPILE_CACHE', str(tmp_path / 'cache'))
  cfg, target = load_config(TOO_BIG[0].split('=', 1)[1]), targets.get('v5p:2x2x1')
  for flag in TOO_BIG[1:]:
    key, value = flag[len('--config.'):].split('=')
    section, field = key.split('.')
    cfg[section][field] = int(value)
  report = aot.target_report(cfg, target)
  mem = report['bytes_per_device']
  assert report['fits'] is False and 'RESOURCE_EXHAUSTED' in report['refused']
  assert mem['temporaries'] == aot.refusal(RuntimeError(report['refused']))['temporaries']
  assert mem['total'] == mem['arguments'] + mem['temporaries'] > target.hbm_bytes_per_device
  line = aot.does_not_fit(report)
  over = (mem['total'] - target.hbm_bytes_per_device) / 2**30
  assert f'over by {over:,.2f} GiB' in line and 'run.remat' in line and 'try scripts/plan.py' in line
  assert aot.target_report(cfg, target)['cached'] is True
  search = {'run.remat': ('none', 'full'), 'train.microbatches': (1, 16)}
  rows, best = fit.find(cfg, target, search, log=lambda _: None)
  assert rows[0]['run'] == {'run.remat': 'none', 'train.microbatches': 1}
  assert rows[0]['refused'] and rows[0]['fits'] is False  # a row, and the search goes on
  assert best == 1 and rows[1]['fits'] and not rows[1]['refused']
  assert 'refused by the compiler: over by' in fit.line(rows[0], target)
  out = tmp_path / 'dry.json'
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, 'scripts/dry_run.py', f'--target={target.name}',
                         f'--json={out}', *TOO_BIG], cwd=root, capture_output=True, text=True,
                        timeout=600)
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert proc.returncode == 1 and errors == ['error: ' + line], proc.stderr[-2000:]
  assert json.load(open(out))['fits'] is False


@pytest.mark.slow
@needs('tpu')
def test_the_planner_skips_what_cannot_divide_and_ranks_compiled_meshes(tmp_path, monkeypatch):
  """The tiny TPU config on v5p:2x2x1 (4 devices): every split of them over data x fsdp x
  expert x tensor is a row; those whose heads (1 KV head) or experts cannot divide are skipped
  naming the key, the others screened by their floor and analytic time; the two best by that
  estimate are compiled, each with an estimated step no shorter than its compute bound and no
  longer than compute plus every collective byte and op; the best plan is the fitting one of
  least estimated step, and its command carries its mesh and settings."""
  from loopmoe_jax import plan
  monkeypatch.setenv('LOOPMOE_COMPILE_CACHE', str(tmp_path))
  target = targets.get(TINY['tpu'][0])
  rows, best = plan.plan(_tiny_cfg('tpu'), target, {'run.remat': ('none', 'full')},
                         compile_meshes=2, log=lambda _: None)
  # 4 devices: expert 1 (tensor 1: 3 fsdp splits, 2: 2, 4: 1), expert 2 (2 + 1), expert 4 (1)
  assert [r["mesh"] for r in rows] == plan.meshes(4) and len(rows) == 10
  skipped = [r for r in rows if r.get('skipped')]
  assert all(r['mesh']['tensor'] > 1 for r in skipped if 'kv_heads' in r['skipped'])
  assert any('kv_heads' in r['skipped'] and 'model.num_kv_heads' in r['skipped'] for r in skipped)
  compiled = [r for r in rows if r['fits'] is not None]
  assert len(compiled) == 2 and best is not None and rows[best] in compiled
  for r in compiled:
    tb = r['time_bounds_s']
    assert r['compute_s'] <= r['estimated_step_s']
    assert r['estimated_step_s'] <= r['compute_s'] + tb['communication'] + tb['latency'] + 1e-12
  assert rows[best]['estimated_step_s'] == min(r['estimated_step_s'] for r in compiled if r['fits'])
  screened = [r for r in rows if not r.get('skipped')]
  assert all(r['analytic_step_s'] >= r['compute_s'] for r in screened)
  cmd = plan.command('configs/x.py', ['--config.data.batch_size=8'], rows[best])
  assert all(f'--config.mesh.{a}={n}' in cmd for a, n in rows[best]['mesh'].items())
  assert f"--config.run.remat={rows[best]['run']['run.remat']}" in cmd


def test_fit_search_flags_name_the_key():
  from loopmoe_jax import fit
  assert fit.parse_search(['run.remat=none,full', 'train.microbatches=1,2']) == {
      'run.remat': ('none', 'full'), 'train.microbatches': (1, 2)}
  with pytest.raises(ValueError, match="'model.d_model': not a setting the fit finder changes"):
    fit.parse_search(['model.d_model=64'])
  with pytest.raises(ValueError, match='expected KEY=V1,V2'):
    fit.parse_search(['run.remat'])


@pytest.mark.slow
@needs('tpu')
def test_tiny_step_compiles_on_the_split_foil2_pod_mesh():
  """The README's Foil-2 pod mesh (fsdp=8 x expert=8 on v5p:4x4x4, which needs a physical
  axis split) builds and the tiny step compiles on it, every device holding its own part."""
  cfg = _tiny_cfg('tpu')
  cfg.model.prelude_experts = cfg.model.core_experts = 8
  cfg.mesh.fsdp, cfg.mesh.expert, cfg.data.batch_size = 8, 8, 64
  target = targets.get('v5p:4x4x4')
  report = aot.target_report(cfg, target, use_cache=False)
  assert report['mesh']['fsdp'] == report['mesh']['expert'] == 8 and report['devices'] == 64
  assert report['fits'] and report['lowered_for']['kernel_calls']['mosaic'] > 0
  # parameters split 64 ways where they divide: a device holds well under a tenth of them
  assert report['params_bytes_per_device'] < report['params_bytes_total'] / 10


@pytest.mark.slow
@needs('tpu')
def test_tiny_step_compiles_every_kernel_for_v6e():
  """The same kernels compile with Mosaic for Trillium (v6e:2x2) as for v5p."""
  target = targets.get('v6e:2x2')
  lowered, _, _, _ = aot.lower_step(_tiny_cfg('tpu'), target)
  traced = lowered.as_text().count(LOWERED_CALLS['tpu']['mosaic'])
  summary, _ = aot.compile_summary(_tiny_cfg('tpu'), target, use_cache=False)
  assert traced > 0 and summary['kernel_calls']['mosaic'] >= traced
  assert summary['ragged_all_to_all'] > 0


@needs('tpu')
def test_a_mesh_the_torus_cannot_place_names_the_sizes_and_the_topology(monkeypatch):
  from jax.experimental import mesh_utils

  def refuse(*args, **kwargs):
    raise NotImplementedError('Failed to find assignment for logical_axis_index 4')
  monkeypatch.setattr(mesh_utils, 'create_device_mesh', refuse)
  with pytest.raises(ValueError, match=r'mesh: no placement of mesh.fsdp=8 x mesh.expert=8 on '
                     r'the 4x4x4 topology \(TPU v5\): Failed to find assignment'):
    sharding.make_mesh(MeshConfig(data=1, fsdp=8, expert=8), targets.get('v5p:4x4x4').devices())


@pytest.mark.parametrize('platform,impl', [('tpu', 'cudnn'), ('cuda', 'splash')])
def test_an_attention_the_target_cannot_run_is_refused_before_tracing(platform, impl, monkeypatch):
  """run.attention_impl naming another platform's kernel is refused by the runtime (the key,
  the platform and the target named) before the model is traced: nothing is lowered."""
  if not HAS[platform]:
    pytest.skip(f'the {platform} extra is not installed')
  from loopmoe_jax.train import step as steps  # pylint: disable=import-outside-toplevel
  traced = []
  monkeypatch.setattr(steps, 'shardings',  # the first use of the model (init traced)
                      lambda *a, **kw: traced.append(a))
  cfg = _tiny_cfg(platform)
  cfg.run.attention_impl = impl
  target = targets.get(TINY[platform][0])
  with pytest.raises(ValueError, match=rf"target {re.escape(target.name)}: run.attention_impl="
                     rf"'{impl}' does not run on platform '{'gpu' if platform == 'cuda' else 'tpu'}'"):
    aot.lower_step(cfg, target)
  assert not traced
  cfg.run.attention_impl = 'chunked'  # runs everywhere: the same check passes
  from loopmoe_jax.experiment import build  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.runtime import Runtime  # pylint: disable=import-outside-toplevel
  attention_impls.check(Runtime.for_platform(platform), build(cfg).model)


@needs('tpu')
def test_tiny_step_without_expert_devices_compiles_with_no_exchange():
  """A mesh without an expert axis (fsdp=4 on v5p:2x2x1), pod preset (async ragged
  all-to-alls) and the ragged exchange asked for: the step compiles and moves no tokens
  (one expert device keeps its rows; libtpu refuses an async ragged all-to-all over groups
  of one: 'Operand 2 to ragged all-to-all must be a pointer!'), by token rows and by
  assignment rows."""
  for rows, remat in (('token', 'full'), ('assignment', 'none')):
    cfg = _tiny_cfg('tpu')
    cfg.mesh.fsdp, cfg.mesh.expert = 4, 1
    cfg.run.expert_exchange, cfg.run.exchange_rows, cfg.run.remat = 'ragged', rows, remat
    report = aot.target_report(cfg, targets.get('v5p:2x2x1'), use_cache=False)
    assert report['fits'], rows
    assert not {'all-to-all', 'ragged-all-to-all'} & set(report['collective_ops']), rows


def test_planner_screen_counts_the_weight_gathers_by_hand():
  """plan.weight_gathers on fsdp=4 x expert=2: a dense weight split over both axes is
  gathered whole, twice a step; an expert weight only over fsdp (its experts stay put); a
  replicated weight not at all. plan.tensor_reductions is zero without a tensor axis."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from loopmoe_jax import plan, sharding
  from loopmoe_jax.sharding import MeshConfig
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=4, expert=2))
  params = [jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((4, 8, 8), jnp.float32),
            jax.ShapeDtypeStruct((16,), jnp.float32)]
  shardings = [NamedSharding(mesh, P(('fsdp', 'expert'), None)),
               NamedSharding(mesh, P('expert', 'fsdp', None)), NamedSharding(mesh, P())]
  dense = 2 * (8 * 16 - 16) * 4       # 128 elements, 16 held
  expert = 2 * (4 * 8 * 8 // 2 - 32) * 4  # 128 of this device's experts, 32 held
  assert plan.weight_gathers(params, shardings) == dense + expert
  from loopmoe_jax.experiment import build, load_config
  assert plan.tensor_reductions(build(load_config('configs/default.py:smoke')), mesh) == 0
