"""`jaxformer compile`: a run's programs compiled ahead of time for a TPU
topology, on any machine with libtpu installed (`pip install -e ".[tpu]"`).

libtpu's compile-only client lays out every device of the named topology,
all hosts included, on this machine (`jax.experimental.topologies`); the
programs are lowered and compiled for them exactly as `jaxformer train`
builds them (model, optimizer, mesh, axis rules, shardings), but nothing
runs. Per program: per-device memory against the chip's HBM, the
collectives and custom calls in the compiled HLO and XLA's cost model.
Every choice of a code path by platform (`model/backend.py`: attention
kernels, the CPU-only decoding kernels) sees the TPU devices the program is
compiled for, not this machine's CPU.

Before compiling, every host's start-up is rehearsed (`rehearse_hosts`):
the compile-only devices carry each chip's process index, and
`host_plan.plan_host`, which `jaxformer train` runs on its own host, runs
for each process of the topology: a layout that train would refuse is
refused here with the same message, and the report lists the row shards
each host feeds.

Collective counts are runs per step: a collective in a loop body (a
scanned layer, a chunk of the output layer) counts once per iteration, by
the loop's trip count (`hlo.runs_per_computation`; libtpu's compiled text
does not annotate trip counts, so they are read from the loop's counter and
condition), beside the number of instructions. The output layer's loop over
chunks (`train/chunked_loss.py`) is reported with its trip count and the rows
per chip of its logits matmuls. XLA's cost model still counts a loop's body
once, for `nn.scan`, for the output layer's chunks and for the windowed
einsums of FSDP on TPU (see `train/flops.py`), so its FLOPs can fall short
of the model's; the MFU printed uses the model FLOPs of `train/flops.py`
over the cost model's time estimate.
"""
import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import ml_collections

from jaxformer.aot import report_cache
from jaxformer.inference import search
from jaxformer.inference import evaluate
from jaxformer.aot import hlo
from jaxformer.run import host_plan
from jaxformer.runtime import library_logs
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.checkpoints import trained
from jaxformer.data import task_batches
from jaxformer.model import config as model_config_lib
from jaxformer.train.tasks import get_task
from jaxformer.train import flops as flops_lib
from jaxformer.train import schedule as schedules
from jaxformer.train.step import compile_eval_step, compile_train_step

# Another process holding libtpu (a training run on this TPU VM, a second
# test worker) must not stop a compile-only client, which uses no TPU.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
  kind: str  # As in libtpu's topology name ('v5e:2x4').
  hbm_gib: float
  peak_bf16_flops: float  # Per chip (both TensorCores of a megacore chip).


CHIPS = {
    'v4': Chip('v4', 32, 275e12),
    'v5e': Chip('v5e', 16, 197e12),
    'v5p': Chip('v5p', 95, 459e12),
    'v6e': Chip('v6e', 32, 918e12),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A Google accelerator type: v4 and v5p names count TensorCores (2 per
  chip, one JAX device per chip), v5e and v6e names count chips."""
  name: str
  chip: Chip
  grid: str  # Chips along each axis of the slice.
  chips_per_host: tuple[int, int, int] | None = None  # None: libtpu's default.

  @property
  def chips(self) -> int:
    return math.prod(int(n) for n in self.grid.split('x'))


def _topologies():
  table = {}
  for cores, grid in ((8, '2x2x1'), (16, '2x2x2'), (32, '2x2x4'),
                      (64, '2x4x4')):
    table[f'v4-{cores}'] = Topology(f'v4-{cores}', CHIPS['v4'], grid)
  for cores, grid in ((8, '2x2x1'), (16, '2x2x2'), (32, '2x2x4'),
                      (64, '2x4x4'), (128, '4x4x4'), (512, '4x8x8')):
    table[f'v5p-{cores}'] = Topology(f'v5p-{cores}', CHIPS['v5p'], grid)
  for chip in ('v5e', 'v6e'):
    for chips, grid in ((4, '2x2'), (8, '2x4'), (16, '4x4'), (32, '4x8'),
                        (64, '8x8'), (128, '8x16'), (256, '16x16')):
      # A -8 slice is one host of 8 chips; larger ones have 4 per host.
      table[f'{chip}-{chips}'] = Topology(
          f'{chip}-{chips}', CHIPS[chip], grid,
          (2, 4, 1) if chips == 8 else None)
  return table


TOPOLOGIES = _topologies()


def topology(name: str) -> Topology:
  if name not in TOPOLOGIES:
    raise ValueError(f'Unknown topology {name!r}; known: '
                     f'{", ".join(TOPOLOGIES)}.')
  return TOPOLOGIES[name]


def topology_devices(topo: Topology) -> list:
  """The compile-only devices of `topo`, one per chip, all hosts."""
  from jax.experimental import topologies
  try:
    import libtpu  # noqa: F401  (only whether it is installed)
  except ImportError:
    raise RuntimeError(
        'jaxformer compile needs libtpu: pip install -e ".[tpu]" (wheels '
        'exist for Linux x86_64 only).') from None
  kwargs = {}
  if topo.chip.kind in ('v4',):  # One device per chip, as on a v4 VM.
    kwargs['chip_config_name'] = 'megacore'
  if topo.chips_per_host:
    kwargs['chips_per_host_bounds'] = topo.chips_per_host
  with library_logs.without_libtpu_host_lines():  # Not a TPU VM: expected.
    description = topologies.get_topology_desc(
        f'{topo.chip.kind}:{topo.grid}', 'tpu', **kwargs)
  return list(description.devices)


# ------------------------------------------------------- compiled programs

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


@dataclasses.dataclass
class Program:
  """One program of a run: `lower()` returns its `jax.stages.Lowered`."""
  name: str
  kind: str  # train | eval | decode
  lower: object
  model_flops: float | None = None  # Per step, all devices (train only).


def batch_struct(config: ml_collections.ConfigDict, rows: int, source: int,
                 target: int, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """A global batch of `config.task` (`Task.batch_shapes`: token arrays
  [rows, source] and/or [rows, target], the labels or values) split over
  the batch axes."""
  sharding = mesh_lib.batch_sharding(mesh)
  shapes = get_task(config.task).batch_shapes(config, rows, source, target)
  return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
          for key, (shape, dtype) in shapes.items()}


def train_shapes(config: ml_collections.ConfigDict, row_shards: int,
                 buckets=None) -> list[tuple[int, int, int]]:
  """(global rows, source width, target width) of every batch the input
  pipeline can produce on a mesh of `row_shards` row shards ('bucket': each
  bucket, or those of width in `buckets`; 'pack' and the other tasks: the
  one shape)."""
  shapes = task_batches.train_batch_shapes(config, row_shards)
  if buckets:
    widths = {max(s, t) for _, s, t in shapes}
    unknown = sorted(set(buckets) - widths)
    if unknown:
      raise ValueError(f'--buckets {unknown}: not a bucket width of this '
                       f'config; its widths are {sorted(widths)}.')
    shapes = [shape for shape in shapes if max(shape[1:]) in buckets]
  return shapes


def _check_rows(what: str, rows: int, mesh, key: str):
  split = mesh.shape['data'] * mesh.shape['fsdp']
  if rows % split:
    raise ValueError(
        f'{what}: {rows} rows do not divide over the batch axes data x fsdp '
        f'= {split}; set {key} so that they do.')


def build_programs(config: ml_collections.ConfigDict, mesh,
                   kinds=('train', 'eval', 'decode'), buckets=None,
                   layout=None) -> list[Program]:
  """The run's programs on `mesh`, as `jaxformer train` and `evaluate`
  build them: the train step for each batch shape, the eval step and, for
  translation, the decode loop (beam search of config.decode.beam_size;
  greedy if 1)."""
  model_config = model_config_lib.from_config_dict(config.model)
  task = get_task(config.task)
  train = config.train
  rules = config.mesh.axis_rules
  abstract, shardings = layout or state_layout(config, mesh)
  state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings)
  programs = []

  def under_mesh(fn):
    def lower(*args):
      with mesh_lib.activate(mesh, rules):
        return fn().lower(*args)
    return lower

  if 'train' in kinds:
    accum = train.grad_accum_steps
    schedule = schedules.make_schedule(train, model_config.d_model)
    tx = schedules.make_optimizer(train, schedule)
    step = lambda: compile_train_step(  # noqa: E731
        mesh, shardings, task=task,
        model=task.model(model_config, deterministic=False), tx=tx,
        schedule=schedule, label_smoothing=train.label_smoothing,
        grad_accum_steps=accum, prng_impl=train.prng_impl)
    for rows, source, target in train_shapes(
        config, mesh_lib.row_shards(mesh), buckets):
      name = task.shape_name(rows, source, target)
      _check_rows(f'train batch {name}', rows // accum, mesh,
                  'data.batch_size / data.tokens_per_batch')
      batch = batch_struct(config, rows, source, target, mesh)
      programs.append(Program(
          f'train {name}', 'train',
          lambda b=batch: under_mesh(step)(state, b),
          flops_lib.training_flops_per_step(model_config, task, rows,
                                            source, target)))
  data = config.data
  if 'eval' in kinds:
    rows = task_batches.eval_batch_rows(config, mesh_lib.row_shards(mesh))
    _check_rows(f'eval batch of {rows} rows', rows, mesh, 'data.batch_size')
    batch = batch_struct(config, rows, data.max_source_length,
                         data.max_target_length, mesh)
    eval_step = lambda: compile_eval_step(  # noqa: E731
        mesh, shardings.params, task=task, model=task.model(model_config))
    name = task.shape_name(rows, data.max_source_length,
                       data.max_target_length)
    programs.append(Program(
        f'eval {name}', 'eval',
        lambda: under_mesh(eval_step)(state.params, batch)))
  if 'decode' in kinds and task.translates:
    programs.append(_decode_program(config, model_config, mesh, state.params,
                                    under_mesh))
  return programs


def state_layout(config: ml_collections.ConfigDict, mesh):
  """(abstract train state, shardings) of the run, with its optimizer."""
  schedule = schedules.make_schedule(
      config.train, model_config_lib.from_config_dict(config.model).d_model)
  return trained.train_state_layout(
      config, mesh, schedules.make_optimizer(config.train, schedule))


def rehearse_hosts(config: ml_collections.ConfigDict, mesh, layout
                   ) -> list[host_plan.HostPlan]:
  """Every process's start-up plan on `mesh`, by the code `jaxformer
  train` runs on each host (`host_plan.plan_host`): the first host whose
  layout train would refuse raises train's error."""
  processes = sorted({d.process_index for d in mesh.devices.flat})
  abstract, shardings = layout
  return [host_plan.plan_host(config, mesh, p, shardings, abstract)
          for p in processes]


def _decode_program(config, model_config, mesh, params, under_mesh):
  """The decode loop of `evaluate.decode_split` (`jaxformer evaluate` and
  the final test-split report): its batch size, lengths and beam."""
  data, settings = config.data, config.decode
  split = mesh.shape['data'] * mesh.shape['fsdp']
  rows = -(-settings.batch_size // split) * split
  decode_len = search.decode_length(data.max_target_length,
                                    settings.max_extra_len,
                                    model_config.max_len)
  inputs = jax.ShapeDtypeStruct((rows, data.max_source_length), jnp.int32,
                                sharding=mesh_lib.batch_sharding(mesh))
  beam = settings.beam_size

  def decode_fn():
    return jax.jit(lambda p, x: evaluate.decode_tokens(
        p, model_config, x, beam_size=beam, alpha=settings.alpha,
        max_decode_len=decode_len))
  what = f'beam {beam}' if beam > 1 else 'greedy'
  return Program(f'decode {what} {rows}x{data.max_source_length}->'
                 f'{decode_len}', 'decode',
                 lambda: under_mesh(decode_fn)(params, inputs))


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


def with_expected_vocabulary(config: ml_collections.ConfigDict
                             ) -> ml_collections.ConfigDict:
  """`jaxformer train` sizes the model's vocabulary by its tokenizer: one
  trained to data.tokenizer.vocab_size pieces, unless a model file is given
  (then model.vocab_size stands for it). Classes: data.labels if given,
  else model.num_classes (train reads them from the data)."""
  tokenizer = config.data.tokenizer
  config = ml_collections.ConfigDict(config.to_dict())
  if config.data.labels:
    config.model.num_classes = len(config.data.labels)
  if not (tokenizer.model_path or tokenizer.source_model_path):
    config.model.vocab_size = tokenizer.vocab_size
    config.model.target_vocab_size = 0
  return config


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


def compile_run(config: ml_collections.ConfigDict, topology_name: str,
                kinds=('train', 'eval', 'decode'), buckets=None,
                log=None) -> dict:
  """Compiles the run of `config` for `topology_name`; returns the report
  ('programs': one `program_report` each)."""
  topo = topology(topology_name)
  config = with_expected_vocabulary(config)
  devices = topology_devices(topo)
  mesh = host_plan.run_mesh(config, devices)
  layout = state_layout(config, mesh)
  plans = rehearse_hosts(config, mesh, layout)
  hosts = len(plans)
  report = {'topology': topo.name, 'chips': len(devices), 'hosts': hosts,
            'vocab_size': config.model.vocab_size,
            'device_kind': devices[0].device_kind,
            'hbm_gib': topo.chip.hbm_gib,
            'peak_bf16_flops': topo.chip.peak_bf16_flops,
            'mesh': dict(mesh.shape),
            'hosts_plan': [plan.summary() for plan in plans], 'programs': []}
  if log:
    log(format_header(report))
    log(format_hosts(report))
  programs = build_programs(config, mesh, kinds, buckets, layout)
  if log:
    log(f'compiling {len(programs)} programs')
  for program in programs:
    report['programs'].append(
        report_cache.report(program, topo, len(devices), program_report))
    if log:
      log(format_program(report['programs'][-1]))
  return report


# ------------------------------------------------------------------ output

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
