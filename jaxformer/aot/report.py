"""What `jaxformer compile` reports of a compiled program: per-device
memory against the chip's HBM, the collectives and custom calls in the
compiled HLO (`hlo.py`), XLA's cost model and the MFU of the model's FLOPs
over its time estimate; and the report in words, with what to change for a
program that does not fit.
"""
import re
import time

import jax

from jaxformer.aot import hlo
from jaxformer.aot.programs import Program
from jaxformer.aot.topology import Topology

GIB = 1024 ** 3


def memory_stats(compiled) -> dict[str, float]:
  """Per-device bytes; total = arguments + outputs - aliased + temporaries
  + generated code."""
  m = compiled.memory_analysis()
  stats = {'arguments': m.argument_size_in_bytes,
           'outputs': m.output_size_in_bytes,
           'aliased': m.alias_size_in_bytes,
           'temporaries': m.temp_size_in_bytes,
           'code': m.generated_code_size_in_bytes}
  stats['total'] = (stats['arguments'] + stats['outputs'] - stats['aliased']
                    + stats['temporaries'] + stats['code'])
  return {k: float(v) for k, v in stats.items()}


def cost_stats(compiled) -> tuple[float, float | None]:
  """(FLOPs per device, estimated seconds or None) from XLA's cost model;
  a non-positive estimate is no estimate."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  seconds = float(cost.get('optimal_seconds', 0.0) or 0.0)
  return float(cost.get('flops', 0.0)), seconds if seconds > 0 else None


def program_report(program: Program, topo: Topology, num_devices: int
                   ) -> dict:
  """Compiles `program` and measures it (see the module docstring)."""
  start = time.perf_counter()
  try:
    compiled = program.lower().compile()
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    return _out_of_memory_report(program, topo, str(e),
                                 time.perf_counter() - start)
  seconds_to_compile = time.perf_counter() - start
  memory = memory_stats(compiled)
  flops, seconds = cost_stats(compiled)
  text = compiled.as_text()
  hbm = topo.chip.hbm_gib * GIB
  report = {
      'program': program.name, 'kind': program.kind,
      'compile_seconds': round(seconds_to_compile, 1),
      'memory_gib': {k: v / GIB for k, v in memory.items()},
      'hbm_gib': topo.chip.hbm_gib, 'fits': memory['total'] <= hbm,
      'shortfall_gib': max(0.0, (memory['total'] - hbm) / GIB),
      'collectives': hlo.collective_stats(text),
      'loops_of_unknown_trip_count': hlo.runs_per_computation(text)[1],
      'output_layer': hlo.output_layer(text),
      'custom_calls': hlo.custom_calls(text),
      'flops_per_device': flops, 'estimated_seconds': seconds,
      'model_flops_per_device': None, 'mfu': None,
  }
  if topo.slices > 1:
    report['cross_slice'] = hlo.cross_slice_stats(text)
  report['loops_undercounted'] = False
  if program.model_flops:
    per_device = program.model_flops / num_devices
    report['model_flops_per_device'] = per_device
    # Below the model's FLOPs, the cost model counted loop bodies once
    # (scanned layers): its time is then too short and the MFU too high.
    report['loops_undercounted'] = flops < 0.9 * per_device
    if seconds:
      report['mfu'] = per_device / seconds / topo.chip.peak_bf16_flops
  return report


def _out_of_memory_report(program: Program, topo: Topology, message: str,
                          seconds: float) -> dict:
  """The report of a program the TPU compiler refused for want of HBM
  ('... temporaries (20.65G) exceeds available HBM (15.75G)'): its memory is
  at least the temporaries it names."""
  sizes = re.findall(r'\(([0-9.]+)([KMGT])\)', message)
  scale = {'K': 2 ** -20, 'M': 2 ** -10, 'G': 1.0, 'T': 1024.0}
  needed = float(sizes[0][0]) * scale[sizes[0][1]] if sizes else float('nan')
  memory = {'arguments': 0.0, 'outputs': 0.0, 'aliased': 0.0, 'code': 0.0,
            'temporaries': needed, 'total': needed}
  return {
      'program': program.name, 'kind': program.kind,
      'compile_seconds': round(seconds, 1), 'memory_gib': memory,
      'hbm_gib': topo.chip.hbm_gib, 'fits': False,
      'shortfall_gib': max(0.0, needed - topo.chip.hbm_gib),
      'compiler_error': message.strip().splitlines()[0],
      'collectives': hlo.collective_stats(''), 'custom_calls': {},
      'loops_of_unknown_trip_count': 0, 'output_layer': hlo.output_layer(''),
      'flops_per_device': 0.0,
      'estimated_seconds': None, 'model_flops_per_device': None, 'mfu': None,
      'loops_undercounted': False}


LEVERS = {
    'train': ('--config.mesh.fsdp=N (shard parameters and optimizer state '
              'over N chips)', '--config.model.remat_policy=full or dots '
              '(recompute activations in the backward pass)',
              '--config.model.scan_layers=true (one layer of activations '
              'live at a time under remat)',
              'a smaller batch (data.tokens_per_batch or data.batch_size)',
              '--config.train.grad_accum_steps=K (the same batch in K '
              'microbatches)'),
    'eval': ('--config.mesh.fsdp=N', 'a smaller data.batch_size'),
    'decode': ('--config.mesh.fsdp=N', 'a smaller search.batch_size or '
               'decode.beam_size'),
}


def misfit_message(report: dict) -> str:
  """What to change, for each program that does not fit ('' if all do)."""
  lines = []
  for program in report['programs']:
    if program['fits']:
      continue
    lines.append(
        f'{program["program"]} does not fit: '
        f'{program["memory_gib"]["total"]:.2f} GiB per chip, '
        f'{program["shortfall_gib"]:.2f} GiB more than the '
        f'{program["hbm_gib"]:g} GiB of HBM. Levers: '
        + '; '.join(LEVERS[program['kind']]) + '.')
  return '\n'.join(lines)


def _bytes(n: float) -> str:
  return f'{n / GIB:.2f} GiB' if n >= GIB / 10 else f'{n / 1024 ** 2:.1f} MiB'


def _flop(n: float) -> str:
  return f'{n / 1e12:.3f} TFLOP' if n >= 1e11 else f'{n / 1e9:.2f} GFLOP'


def format_program(p: dict) -> str:
  m = p['memory_gib']
  if 'compiler_error' in p:
    return (f'{p["program"]}  (compiler gave up after '
            f'{p["compile_seconds"]:.0f} s)\n  memory per chip: at least '
            f'{m["total"]:.2f} GiB of temporaries of {p["hbm_gib"]:g} GiB '
            f'HBM: fits: no\n  ({p["compiler_error"]})')
  lines = [
      f'{p["program"]}  ({"from the cache; " * bool(p.get("from_cache"))}'
      f'compiled in {p["compile_seconds"]:.0f} s)',
      f'  memory per chip: {_bytes(m["arguments"] * GIB)} arguments, '
      f'{_bytes(m["temporaries"] * GIB)} temporaries, '
      f'{_bytes(m["outputs"] * GIB)} outputs, {_bytes(m["aliased"] * GIB)} '
      f'aliased, {_bytes(m["total"] * GIB)} total of {p["hbm_gib"]:g} GiB '
      f'HBM: fits: {"yes" if p["fits"] else "no"}',
      '  collectives run per step: ' + ', '.join(
          f'{op} {s["count"]}' + (f' ({_bytes(s["bytes"])})' if s['count']
                                  else '')
          + (f' + {s["windowed"]} in windowed einsums' if s['windowed']
             else '')
          + (f' [{s["instructions"]} in the program]'
             if s['instructions'] not in (0, s['count']) else '')
          for op, s in p['collectives'].items())]
  if 'cross_slice' in p:
    lines.append('  across slices (DCN) per step: ' + (', '.join(
        f'{op} {s["count"]} ({_bytes(s["bytes"])} sent'
        + (f', {_bytes(s["data_bytes"])} of values, the rest tile padding)'
           if s.get('data_bytes', s['bytes']) < s['bytes'] else ')')
        for op, s in p['cross_slice'].items()) or 'nothing'))
  if p['loops_of_unknown_trip_count']:
    lines.append(f'  ({p["loops_of_unknown_trip_count"]} loop(s) of unknown '
                 'trip count: their collectives counted once)')
  if 'output_layer' in p and p['kind'] != 'decode':
    lines.append('  output layer: ' + format_output_layer(p['output_layer']))
  if p['custom_calls']:
    lines.append('  custom calls: ' + ', '.join(
        f'{target} {n}' for target, n in sorted(p['custom_calls'].items())))
  cost = f'  cost model: {_flop(p["flops_per_device"])} per chip'
  if p['estimated_seconds'] is None:
    cost += ', no estimate'
  else:
    cost += f', {p["estimated_seconds"] * 1e3:.2f} ms'
    if p['mfu'] is not None:
      cost += f', MFU {100 * p["mfu"]:.1f}%'
  if p['model_flops_per_device']:
    cost += f'; model FLOPs {_flop(p["model_flops_per_device"])} per chip'
  if p.get('loops_undercounted'):
    cost += ('\n  (the cost model counted loop bodies once: scanned layers, '
             'windowed einsums; its time is a lower bound, the MFU an upper '
             'one)')
  lines.append(cost)
  return '\n'.join(lines)


def format_hosts(report: dict) -> str:
  """One line per host: the row shards it feeds and its share of the state."""
  lines = ['start-up of each host (as `jaxformer train` runs it): accepted']
  for host in report['hosts_plan']:
    lines.append(
        f'  process {host["process"]}: row shards {host["row_shards"]} of '
        f'{host["of"]}, {_rows(host["local_rows"])} rows per training batch'
        + f', {host["local_eval_rows"]} per evaluation batch; '
        f'{_bytes(host["state_bytes"])} of train state')
  return '\n'.join(lines)


def _rows(counts: list[int]) -> str:
  if len(counts) == 1:
    return str(counts[0])
  return f'{min(counts)}-{max(counts)} (by bucket)'


def format_output_layer(layer: dict) -> str:
  """'2 chunks (a loop of 2), 1536 rows per chip in its logits matmuls'."""
  loops = layer['loops']
  if not loops:
    chunks = 'one chunk (no loop)'
  else:
    chunks = ', '.join(f'a loop of {n if n is not None else "?"}'
                       for n in loops)
  rows = '/'.join(f'{r:,}' for r in layer['rows_per_device']) or '?'
  return f'{chunks}; {rows} rows per chip in its logits matmuls'


def format_header(report: dict) -> str:
  mesh = ' '.join(f'{k}={v}' for k, v in report['mesh'].items())
  return (f'{report["topology"]}: {report["chips"]} x {report["device_kind"]}'
          f' on {report["hosts"]} host(s), {report["hbm_gib"]:g} GiB HBM and '
          f'{report["peak_bf16_flops"] / 1e12:.0f} TFLOP/s bf16 per chip; '
          f'mesh {mesh}; vocabulary {report["vocab_size"]}')
