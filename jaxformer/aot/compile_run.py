"""`jaxformer compile`: a run's programs compiled ahead of time for a TPU
topology, on any machine with libtpu installed (`pip install -e ".[tpu]"`).

libtpu's compile-only client lays out every device of the named topology,
all hosts included, on this machine (`jax.experimental.topologies`); the
programs are lowered and compiled for them exactly as `jaxformer train`
builds them (model, optimizer, mesh, axis rules, shardings), but nothing
runs. Several slices (`--num-slices`, with `mesh.dcn_data`) are laid out as
one topology, each device carrying its slice, and each program also reports
what it sends across slices. Per program: per-device memory against the chip's HBM, the
collectives and custom calls in the compiled HLO and XLA's cost model.
Every choice of a code path by platform (`model/backend.py`: attention
kernels, the CPU-only decoding kernels) sees the TPU devices the program is
compiled for, not this machine's CPU.

The run is `jaxformer train`'s own: one `RunSpec` (`train/run_spec.py`),
with the vocabulary train would give it (`programs.compiled_run`).
Before compiling, every host's start-up is rehearsed
(`programs.rehearse_hosts`): the compile-only devices carry each chip's
process index, and `host_plan.plan_host`, which `jaxformer train` runs on
its own host, runs for each process of the topology: a layout that train
would refuse is refused here with the same message, and the report lists
the row shards each host feeds.

Collective counts are runs per step: a collective in a loop body (a
scanned layer, a chunk of the output layer) counts once per iteration, by
the loop's trip count (`hlo.runs_per_computation`; libtpu's compiled text
does not annotate trip counts, so they are read from the loop's counter and
condition), beside the number of instructions. The output layer's loop over
chunks (`train/chunked_loss.py`) is reported with its trip count and the
rows per chip of its logits matmuls. XLA's cost model still counts a loop's body
once, for `nn.scan`, for the output layer's chunks and for the windowed
einsums of FSDP on TPU (see `train/flops.py`), so its FLOPs can fall short
of the model's; the MFU printed uses the model FLOPs of `train/flops.py`
over the cost model's time estimate.
"""
import ml_collections

from jaxformer.aot import programs as programs_lib
from jaxformer.aot import report as report_lib
from jaxformer.aot import report_cache
from jaxformer.aot import topology as topology_lib


def compile_run(config: ml_collections.ConfigDict, topology_name: str,
                kinds=programs_lib.KINDS, buckets=None, log=None,
                num_slices: int = 1) -> dict:
  """Compiles the run of `config` for `num_slices` slices of
  `topology_name`; returns the report ('programs': one
  `report.program_report` each)."""
  topo = topology_lib.topology(topology_name, num_slices)
  devices = topology_lib.topology_devices(topo)
  run = programs_lib.compiled_run(config, devices)
  plans = programs_lib.rehearse_hosts(run)
  report = {'topology': topo.name, 'chips': len(devices), 'hosts': len(plans),
            'vocab_size': run.config.model.vocab_size,
            'device_kind': devices[0].device_kind,
            'hbm_gib': topo.chip.hbm_gib,
            'peak_bf16_flops': topo.chip.peak_bf16_flops,
            'mesh': dict(run.mesh.shape),
            'hosts_plan': [plan.summary() for plan in plans], 'programs': []}
  if log:
    log(report_lib.format_header(report))
    log(report_lib.format_hosts(report))
  programs = programs_lib.build_programs(run, kinds, buckets)
  if log:
    log(f'compiling {len(programs)} programs')
  for program in programs:
    report['programs'].append(report_cache.report(
        program, topo, len(devices), report_lib.program_report))
    if log:
      log(report_lib.format_program(report['programs'][-1]))
  return report
