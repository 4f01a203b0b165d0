"""The programs of a run, lowered as `jaxformer train` and `evaluate` run
them, from the same `RunSpec` (model, optimizer, mesh, axis rules,
shardings): the train step for each batch shape, the eval step and, for
translation, the decode loop; and every host's start-up, rehearsed by the
code `train` runs on each (`run/host_plan.py`).
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from jaxformer.data import task_batches
from jaxformer.inference import evaluate
from jaxformer.inference import search
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.run import host_plan
from jaxformer.train import flops as flops_lib
from jaxformer.train import run_spec
from jaxformer.train.run_spec import RunSpec

KINDS = ('train', 'eval', 'decode')


@dataclasses.dataclass
class Program:
  """One program of a run: `lower()` returns its `jax.stages.Lowered`."""
  name: str
  kind: str  # train | eval | decode
  lower: object
  model_flops: float | None = None  # Per step, all devices (train only).


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
  split = mesh_lib.row_shards(mesh)
  if rows % split:
    axes = ' x '.join(mesh_lib.batch_spec(mesh)[0])
    raise ValueError(
        f'{what}: {rows} rows do not divide over the batch axes {axes} '
        f'= {split}; set {key} so that they do.')


def compiled_run(config: ml_collections.ConfigDict, devices) -> RunSpec:
  """The run `jaxformer train` builds of `config` on `devices`, with the
  vocabulary train would give it (`run_spec.with_expected_vocabulary`)."""
  config = run_spec.with_expected_vocabulary(config)
  return RunSpec.build(config, run_spec.run_mesh(config, devices))


def rehearse_hosts(run: RunSpec) -> list[host_plan.HostPlan]:
  """Every process's start-up plan on the run's mesh, by the code `jaxformer
  train` runs on each host (`host_plan.plan_host`): the first host whose
  layout train would refuse raises train's error."""
  processes = sorted({d.process_index for d in run.mesh.devices.flat})
  abstract, shardings = run.state_layout
  return [host_plan.plan_host(run.config, run.mesh, p, shardings, abstract)
          for p in processes]


def build_programs(run: RunSpec, kinds=KINDS, buckets=None) -> list[Program]:
  """The run's programs (see the module docstring); decoding is beam search
  of config.decode.beam_size (greedy if 1)."""
  abstract, shardings = run.state_layout
  state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings)

  def under_mesh(fn):
    def lower(*args):
      with mesh_lib.activate(run.mesh, run.rules):
        return fn().lower(*args)
    return lower

  programs = []
  if 'train' in kinds:
    programs += _train_programs(run, state, shardings, buckets, under_mesh)
  if 'eval' in kinds:
    programs.append(_eval_program(run, state.params, shardings.params,
                                  under_mesh))
  if 'decode' in kinds and run.task.translates:
    programs.append(_decode_program(run, state.params, under_mesh))
  return programs


def _train_programs(run: RunSpec, state, shardings, buckets, under_mesh
                    ) -> list[Program]:
  """The train step of each batch shape (`buckets`: of those widths)."""
  accum = run.config.train.grad_accum_steps
  programs = []
  for rows, source, target in train_shapes(run.config, run.row_shards,
                                           buckets):
    name = run.task.shape_name(rows, source, target)
    _check_rows(f'train batch {name}', rows // accum, run.mesh,
                'data.batch_size / data.tokens_per_batch')
    batch = run.batch_struct(rows, source, target)
    programs.append(Program(
        f'train {name}', 'train',
        lambda b=batch: under_mesh(lambda: run.train_step(shardings))(
            state, b),
        flops_lib.training_flops_per_step(run.model_config, run.task, rows,
                                          source, target)))
  return programs


def _eval_program(run: RunSpec, params, param_shardings, under_mesh
                  ) -> Program:
  """The eval step on one evaluation batch."""
  data = run.config.data
  rows = task_batches.eval_batch_rows(run.config, run.row_shards)
  _check_rows(f'eval batch of {rows} rows', rows, run.mesh, 'data.batch_size')
  batch = run.batch_struct(rows, data.max_source_length,
                           data.max_target_length)
  name = run.task.shape_name(rows, data.max_source_length,
                             data.max_target_length)
  return Program(
      f'eval {name}', 'eval',
      lambda: under_mesh(lambda: run.eval_step(param_shardings))(params,
                                                                 batch))


def _decode_program(run: RunSpec, params, under_mesh) -> Program:
  """The decode loop of `evaluate.decode_split` (`jaxformer evaluate` and
  the final test-split report): its batch size, lengths and beam."""
  data, settings = run.config.data, run.config.decode
  model_config = run.model_config
  split = mesh_lib.row_shards(run.mesh)
  rows = -(-settings.batch_size // split) * split
  decode_len = search.decode_length(data.max_target_length,
                                    settings.max_extra_len,
                                    model_config.max_len)
  inputs = jax.ShapeDtypeStruct((rows, data.max_source_length), jnp.int32,
                                sharding=mesh_lib.batch_sharding(run.mesh))
  beam = settings.beam_size

  def decode_fn():
    return jax.jit(lambda p, x: evaluate.decode_tokens(
        p, model_config, x, beam_size=beam, alpha=settings.alpha,
        max_decode_len=decode_len))
  what = f'beam {beam}' if beam > 1 else 'greedy'
  return Program(f'decode {what} {rows}x{data.max_source_length}->'
                 f'{decode_len}', 'decode',
                 lambda: under_mesh(decode_fn)(params, inputs))
