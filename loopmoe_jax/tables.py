"""The dry run's printed tables (scripts/dry_run.py): the report of the CPU proxy or of a
target's compiler (`table`, `target_table`) and the remat policies side by side
(`policy_table`). The reports themselves are dry_run.py's and aot.py's."""
from __future__ import annotations


def policy_table(rows: dict[str, dict]) -> str:
  """One line per remat policy: temporaries and FLOPs, and both over the policy 'none'."""
  base = rows.get('none')
  lines = [f"{'remat':<14}{'temporaries/device':>20}{'FLOPs/device':>14}{'over analytic':>15}"
           f"{'temp/none':>11}{'FLOPs/none':>12}"]
  for p, r in rows.items():
    rel = (f"{r['temp_bytes_per_device'] / base['temp_bytes_per_device']:>11.3f}"
           f"{r['flops_per_step_per_device'] / base['flops_per_step_per_device']:>12.3f}"
           if base else '')
    lines.append(f"{p:<14}{r['temp_bytes_per_device'] / 2**30:>16.3f} GiB"
                 f"{r['flops_per_step_per_device']:>14.4g}{r['flops_over_analytic']:>15.3f}{rel}")
  return '\n'.join(lines)


def table(report: dict) -> str:
  gib = lambda b: f'{b / 2**30:.3f} GiB' if b >= 2**27 else f'{b / 2**20:.3f} MiB'
  mesh = ' x '.join(f'{a}={n}' for a, n in report['mesh'].items() if n > 1) or 'one device'
  rows = [('devices', f"{report['devices']} ({mesh}), collectives of the "
                      f"{report['platform']} program"),
          ('params (total)', gib(report['params_bytes_total'])),
          ('params / device', gib(report['params_bytes_per_device']))]
  rows += [(f'  {g}', gib(b)) for g, b in report['params_bytes_per_device_by_group'].items()]
  rows += [('optimizer state / device', gib(report['opt_state_bytes_per_device'])),
           ('temporaries / device', f"{gib(report['temp_bytes_per_device'] or 0)} "
                                    f"({report['temp_bytes_program'].split(' (')[0]})"),
           ('matmul FLOPs / device / step', f"{report['flops_per_step_per_device']:.4g} = "
            f"{report['flops_over_analytic']:.3f} x analytic "
            f"{report['analytic_flops_per_step_per_device']:.4g} (remat {report['remat']}, "
            f"attention {report['attention_impl']})")]
  rows += [(f'{kind} / step', gib(b)) for kind, b in
           sorted(report['collective_bytes_per_step'].items())]
  rows += [('  activation all-gather / step', gib(report['act_allgather_bytes_per_step'])),
           ('  gradient reduction / step', gib(report['grad_reduce_bytes_per_step']) +
            f" ({report['grad_reduce_ops_per_step']} ops)")]
  rows += [(f'analytic {k} / step', gib(v)) for k, v in
           report['analytic_collective_bytes_per_step'].items()]
  if report['lowered_for']:
    lf = report['lowered_for']
    rows.append((f"lowered for {lf['platform']}", f"{lf['custom_calls']} custom calls "
                 f"(Pallas kernels), {lf['ragged_all_to_all']} ragged all-to-all"))
  width = max(len(r[0]) for r in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


def target_table(report: dict) -> str:
  """The target-specific lines of the dry run's printout."""
  gib = lambda b: f'{b / 2**30:,.3f} GiB'
  b = report['bytes_per_device']
  rows = [('target', f"{report['target']}: {report['devices']} x {report['device_kind']}, "
                     f"{report['temp_bytes_program']}, compile {report['compile_s']} s"
                     + (' (cached)' if report['cached'] else '')),
          ('bytes / device', ', '.join(f'{k} {gib(b[k])}' for k in
                                       ('arguments', 'outputs', 'aliases', 'temporaries', 'code'))),
          ('total / device', f"{gib(b['total'])} of {gib(report['hbm_bytes_per_device'])} "
                             f"({100 * report['hbm_fraction']:.1f}%): "
                             + ('fits' if report['fits'] else report['advice']))]
  for kind, ops in report['collective_ops'].items():
    rows.append((f'{kind} / step', f"{gib(report['collectives'].get(kind, 0))} in {ops['ops']} ops, "
                 f"{ops['async']} async, {ops['overlapped']} overlapping compute"))
  tb = report['time_bounds_s']
  rows.append(('time bounds / step', f"communication >= {tb['communication'] * 1e3:.4g} ms, "
               f"compute >= {tb['compute'] * 1e3:.4g} ms (ratio "
               f"{tb['communication_over_compute']:.3g}; links and peak FLOP/s, no overlap)"))
  rows.append(('estimated step', f"{tb['estimated_step'] * 1e3:.4g} ms = "
               f"{tb['estimated_step'] / tb['compute']:.3g} x compute (latency "
               f"{tb['latency'] * 1e3:.4g} ms over every op; not overlapped "
               f"{tb['exposed'] * 1e3:.4g} ms)"))
  if report['compiled_flops_over_analytic']:
    rows.append(('compiled FLOPs / analytic', f"{report['compiled_flops_over_analytic']:.3f} "
                 '(custom calls not counted)'))
  rows.append(('kernels compiled', ', '.join(f'{k} {n}' for k, n in
                                             report['lowered_for']['kernel_calls'].items())))
  width = max(len(r[0]) for r in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)
