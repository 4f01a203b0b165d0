"""`jaxformer compile`: the run's programs compiled for TPU topologies by
libtpu's compile-only client on this CPU machine.

Compiling is the cost here (a real-size train step takes minutes of CPU),
so each program is compiled once, in a module fixture: real sizes where the
test is about fitting in HBM, a shrunk model where it is about the logic.
The fixtures print what `jaxformer compile` prints (`pytest -s` shows it).
"""
import json
import math

import jax
import pytest
from flax.core import meta

pytest.importorskip(
    'libtpu', reason='libtpu has wheels for Linux x86_64 only; elsewhere '
    'install it as `pip install -e ".[tpu]"` does on Linux x86_64.')

from jaxformer.aot import programs
from jaxformer.aot import report as report_lib
from jaxformer.aot import topology as topology_lib
from jaxformer.aot.compile_run import compile_run
from jaxformer.cli import main as cli
from jaxformer.aot import hlo
from jaxformer.config.settings import load_config  # noqa: E402

# A shrunk translator: quickstart's runlocal with 4 heads, so that 4-way
# tensor parallelism splits them.
SMALL = ['--config.model.d_model=64', '--config.model.num_heads=4',
         '--config.model.d_ff=128']


def _program(report, kind):
  [program] = [p for p in report['programs'] if p['kind'] == kind]
  return program


# --------------------------------------------------------------- pure parts

HLO = """HloModule jit_train_step, entry_computation_layout={...}

%fused (param_0: bf16[4,8]) -> bf16[4,8] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  ROOT %neg = bf16[4,8]{1,0} negate(%param_0)
}

ENTRY %main (p0: f32[16,1024], p1: bf16[4,8]) -> (f32[], bf16[64,8]) {
  %p0 = f32[16,1024]{1,0} parameter(0), metadata={op_name="x"}
  %p1 = bf16[4,8]{1,0} parameter(1)
  %all-reduce.1 = (f32[16,1024]{1,0}, bf16[4,8]{1,0}) all-reduce(%p0, %p1), replica_groups={{0,1}}, to_apply=%add
  %all-gather-start.2 = (bf16[4,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%p1), dimensions={0}
  %all-gather-done.2 = bf16[64,8]{1,0} all-gather-done(%all-gather-start.2)
  %reduce-scatter.3 = f32[1,1024]{1,0} reduce-scatter(%p0), dimensions={0}, to_apply=%add
  %collective-permute.4 = bf16[4,8]{1,0} collective-permute(%p1), source_target_pairs={{0,1},{1,0}}
  %while.5 = (bf16[4,8]{1,0}, s32[]) while(%init), condition=%wide.windowed_dot_general_cond_rs.2, body=%wide.windowed_dot_general_body_rs.2.clone.sunk
  %while.6 = (bf16[4,8]{1,0}, s32[]) while(%init), condition=%cond, body=%scan_body
  ROOT %t = (f32[], bf16[64,8]{1,0}) tuple(%all-reduce.1, %all-gather-done.2)
}
"""


def test_collectives_are_counted_once_with_their_operand_bytes():
  stats = hlo.collective_stats(HLO)
  one = {'count': 1, 'instructions': 1, 'windowed': 0}
  assert stats['all-reduce'] == {**one, 'bytes': 16 * 1024 * 4 + 64}
  # An asynchronous start/done pair counts once.
  assert stats['all-gather'] == {**one, 'bytes': 64}
  # A windowed einsum's loop is a reduce-scatter, whatever else loops.
  assert stats['reduce-scatter'] == {**one, 'bytes': 16 * 1024 * 4,
                                     'windowed': 1}
  assert stats['collective-permute'] == {**one, 'bytes': 64}
  assert stats['all-to-all'] == {'count': 0, 'bytes': 0.0, 'windowed': 0,
                                 'instructions': 0}


# Loops as libtpu compiles them (a counter from a constant, no trip count
# annotated) and as XLA's CPU and GPU backends annotate them, nested.
LOOPS = """HloModule jit_train_step, entry_computation_layout={...}

%outer_cond (p.0: (s32[], f32[8])) -> pred[] {
  %n.0 = s32[]{:T(128)} constant(6)
  %p.0 = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i.0 = s32[]{:T(128)} get-tuple-element(%p.0), index=0
  ROOT %lt.0 = pred[]{:T(512)} compare(%i.0, %n.0), direction=LT
}

%inner_body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %x.1 = f32[8]{0} get-tuple-element(%p.1), index=1
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %all-reduce.1 = f32[8]{0} all-reduce(%x.1), to_apply=%add
  ROOT %t.1 = (s32[], f32[8]{0}) tuple(%i.1, %all-reduce.1)
}

%outer_body (p.2: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.2 = (s32[], f32[8]{0}) parameter(0)
  %x.2 = f32[8]{0} get-tuple-element(%p.2), index=1
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %zero.2 = s32[] constant(0)
  %init.2 = (s32[], f32[8]{0}) tuple(%zero.2, %x.2)
  %while.2 = (s32[], f32[8]{0}) while(%init.2), condition=%inner_cond, body=%inner_body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"3"}}
  %logits.2 = f32[12,128,37000]{2,1,0:T(8,128)} convolution(%x.2, %x.2), dim_labels=bf_io->bf, metadata={op_name="jit(train_step)/decode_logits/output_layer/while/body/logits_v37000/dot_general"}
  %d_x.2 = f32[12,128,512]{2,1,0} convolution(%x.2, %x.2), dim_labels=bf_io->bf, metadata={op_name="jit(train_step)/decode_logits/output_layer/while/body/dot_general"}
  ROOT %t.2 = (s32[], f32[8]{0}) tuple(%i.2, %x.2)
}

ENTRY %main.3 (x.3: f32[8]) -> f32[8] {
  %x.3 = f32[8]{0} parameter(0)
  %zero.3 = s32[]{:T(128)} constant(0)
  %copy.3 = s32[]{:T(128)} copy(%zero.3)
  %init.3 = (s32[]{:T(128)}, f32[8]{0}) tuple(%copy.3, %x.3)
  %while.3 = (s32[], f32[8]{0}) while(%init.3), condition=%outer_cond, body=%outer_body, metadata={op_name="jit(train_step)/decode_logits/output_layer/while"}
  %all-gather.3 = f32[64]{0} all-gather(%x.3), dimensions={0}
  ROOT %y.3 = f32[8]{0} get-tuple-element(%while.3), index=1
}
"""


def test_collectives_in_loops_count_once_per_iteration():
  runs, unknown = hlo.runs_per_computation(LOOPS)
  assert (runs['outer_body'], runs['inner_body'], unknown) == (6, 18, 0)
  stats = hlo.collective_stats(LOOPS)
  assert stats['all-reduce'] == {'count': 18, 'instructions': 1,
                                 'bytes': 18 * 32, 'windowed': 0}
  assert stats['all-gather']['count'] == 1
  # The output layer's loop and its logits matmul, 12 x 128 rows a chip;
  # with the vocabulary split 4 ways the same rows.
  assert hlo.output_layer(LOOPS) == {'loops': [6], 'rows_per_device': [1536]}
  split = LOOPS.replace('f32[12,128,37000]', 'f32[1536,9250]')
  assert hlo.output_layer(split)['rows_per_device'] == [1536]
  # A counter that does not start from a constant: unknown, counted once.
  unknown_start = LOOPS.replace('copy(%zero.3)', 'copy(%x.3)')
  assert hlo.runs_per_computation(unknown_start) == (runs | {
      'outer_body': 1, 'inner_body': 3}, 1)
  report = {'loops': [6], 'rows_per_device': [1536]}
  assert report_lib.format_output_layer(report) == (
      'a loop of 6; 1,536 rows per chip in its logits matmuls')
  assert report_lib.format_output_layer(
      {'loops': [], 'rows_per_device': [320]}) == (
          'one chunk (no loop); 320 rows per chip in its logits matmuls')


def test_custom_calls_are_counted_by_target():
  text = ('%a = bf16[8]{0} custom-call(%p), custom_call_target="tpu_custom_call"'
          ', backend_config="..."\n'
          '%b = bf16[8]{0} custom-call(%a), custom_call_target="tpu_custom_call"\n'
          '%c = f32[2]{0} custom-call(%b), custom_call_target="Sharding"\n')
  assert hlo.custom_calls(text) == {'tpu_custom_call': 2, 'Sharding': 1}
  assert hlo.custom_calls(HLO) == {}


# Sends to the Megascale runtime as libtpu compiles them for 2 slices
# (shortened from the quickstart's train step): a shard whose minor
# dimension (8 of an attention weight's 128 columns over fsdp=16) the
# 8 x 128 tiles pad to 128, zeroed by ZeroCrop; small vectors joined into
# one all-reduce within the slice; a shard the tiles do not pad.
MEGASCALE = 'frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}'
CROSS_SLICE = f"""HloModule jit_train_step

ENTRY %main (p0: f32[4,32,8], p1: f32[6020], p2: f32[512,8]) -> f32[] {{
  %p0 = f32[4,32,8]{{1,2,0:T(8,128)}} parameter(0)
  %zero-crop = f32[4,128,8]{{1,2,0:T(8,128)}} custom-call(%p0), custom_call_target="ZeroCrop"
  %bitcast.1 = f32[4,8,128]{{2,1,0:T(8,128)}} bitcast(%zero-crop)
  %send.1 = (f32[4,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) send(%bitcast.1, %after-all.1), is_host_transfer=true, {MEGASCALE}
  %p1 = f32[6020]{{0:T(1024)}} parameter(1)
  %zero-crop.2 = f32[6144]{{0:T(1024)}} custom-call(%p1), custom_call_target="ZeroCrop"
  %bitcast.2 = f32[6,8,128]{{2,1,0:T(8,128)}} bitcast(%zero-crop.2)
  %all-reduce.2 = (f32[6,8,128]{{2,1,0:T(8,128)}}, f32[16]{{0}}) all-reduce(%bitcast.2, %p1), replica_groups={{{{0,1}}}}
  %get-tuple-element.2 = f32[6,8,128]{{2,1,0:T(8,128)}} get-tuple-element(%all-reduce.2), index=0
  %send.2 = (f32[6,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) send(%get-tuple-element.2, %after-all.2), is_host_transfer=true, {MEGASCALE}
  %recv.2 = (f32[6,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) recv(%after-all.2), is_host_transfer=true, {MEGASCALE}
  %p2 = f32[512,8]{{0,1:T(8,128)}} parameter(2)
  %bitcast.3 = f32[4,8,128]{{2,1,0:T(8,128)}} bitcast(%p2)
  %send.3 = (f32[4,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) send(%bitcast.3, %after-all.3), is_host_transfer=true, {MEGASCALE}
  ROOT %r = f32[] constant(0)
}}
"""


def test_cross_slice_sends_count_their_padding_apart():
  """`bytes` is what the sends carry, tile padding included; `data_bytes`
  the values (docs/pods.md, "More than one slice")."""
  assert hlo.cross_slice_stats(CROSS_SLICE) == {'all-reduce': {
      'count': 3, 'bytes': 4 * (4096 + 6144 + 4096),
      'data_bytes': 4 * (1024 + 6020 + 4096)}}
  line = report_lib.format_program({
      'program': 'train', 'kind': 'train', 'compile_seconds': 1.0,
      'memory_gib': dict.fromkeys(('arguments', 'outputs', 'aliased', 'code',
                                   'temporaries', 'total'), 0.0),
      'hbm_gib': 16, 'fits': True, 'collectives': hlo.collective_stats(''),
      'cross_slice': hlo.cross_slice_stats(CROSS_SLICE),
      'loops_of_unknown_trip_count': 0, 'custom_calls': {},
      'output_layer': hlo.output_layer(''), 'flops_per_device': 0.0,
      'estimated_seconds': None, 'mfu': None,
      'model_flops_per_device': None, 'loops_undercounted': False})
  assert 'across slices (DCN) per step: all-reduce 3 (0.1 MiB sent, ' in line
  assert 'MiB of values, the rest tile padding)' in line


def test_shape_bytes():
  assert hlo.shape_bytes('bf16[8,128]{1,0:T(8,128)(2,1)}') == 2048
  assert hlo.shape_bytes('(f32[2]{0}, s32[], pred[3])') == 8 + 4 + 3


def test_topology_names_follow_google_accelerator_types():
  v5p = topology_lib.topology('v5p-64')  # TensorCores: 32 chips of 2.
  assert (v5p.chips, v5p.chip.hbm_gib) == (32, 95)
  assert topology_lib.topology('v5p-256').chips == 128
  assert topology_lib.topology('v4-8').chips == 4
  assert topology_lib.topology('v5e-8').chips == 8  # v5e and v6e count chips.
  assert topology_lib.topology('v6e-256').chips == 256
  with pytest.raises(ValueError, match='Unknown topology .v5e-7.*v5e-8'):
    topology_lib.topology('v5e-7')


@pytest.mark.parametrize('name, chips, hosts', [
    ('v5e-8', 8, 1), ('v5e-16', 16, 4), ('v5p-64', 32, 8), ('v4-8', 4, 1),
    ('v6e-256', 256, 64)])
def test_compile_only_devices_of_every_host(name, chips, hosts):
  devices = topology_lib.topology_devices(topology_lib.topology(name))
  assert len(devices) == chips
  assert len({d.process_index for d in devices}) == hosts


def test_bucket_shapes_round_rows_to_the_multiple():
  config = load_config('configs/wmt14_ende_base.py')
  shapes = programs.train_shapes(config, 8)
  # 25,000 // 8 = 3,125 rows, rounded down to stay within the token budget.
  assert shapes[0] == (3120, 8, 8)
  assert shapes[-1] == (96, 256, 256)
  assert all(rows % 8 == 0 for rows, _, _ in shapes)
  assert programs.train_shapes(config, 8, buckets=[8, 256]) == [
      shapes[0], shapes[-1]]
  with pytest.raises(ValueError, match='not a bucket width'):
    programs.train_shapes(config, 8, buckets=[9])


def test_misfit_message_names_program_shortfall_and_levers():
  report = {'programs': [{
      'program': 'train 104x(256+256)', 'kind': 'train', 'fits': False,
      'memory_gib': {'total': 20.5}, 'shortfall_gib': 4.5, 'hbm_gib': 16}]}
  message = report_lib.misfit_message(report)
  assert 'train 104x(256+256) does not fit' in message
  assert '4.50 GiB more than the 16 GiB' in message
  for lever in ('mesh.fsdp', 'model.remat_policy', 'model.scan_layers',
                'data.tokens_per_batch', 'train.grad_accum_steps'):
    assert lever in message


# ---------------------------------------------------- compiled, real sizes

@pytest.fixture(scope='module')
def base_on_v5e8():
  """wmt14_ende_base in bf16, data-parallel over a v5e-8: the train step of
  its widest bucket (the most attention memory per token)."""
  # Scanned layers: the unrolled 6+6 layers took 40 minutes to compile on a
  # busy 2-core host, the scanned ones a few.
  config = load_config('configs/wmt14_ende_base.py:bf16',
                       ['--config.mesh.data=8',
                        '--config.model.scan_layers=true'])
  return compile_run(config, 'v5e-8', kinds=('train',), buckets=[256],
                     log=print)


@pytest.mark.slow
def test_base_fits_a_v5e8(base_on_v5e8):
  train = _program(base_on_v5e8, 'train')
  assert base_on_v5e8['mesh'] == {'data': 8, 'fsdp': 1, 'tensor': 1}
  assert train['program'] == 'train 96x(256+256)'
  assert train['fits'], train
  memory = train['memory_gib']
  # Parameters and Adam moments in float32: ~63M x 12 bytes, replicated.
  assert 0.6 < memory['arguments'] < 1.0
  assert 0 < memory['total'] < 16
  # Data parallelism: the gradients are all-reduced, nothing is gathered.
  assert train['collectives']['all-reduce']['count'] >= 1
  assert train['collectives']['all-gather']['count'] == 0
  assert train['flops_per_device'] > 0
  # 96 x 256 positions, 12 rows a chip: 2 chunks of 128 positions, not 256
  # chunks of 1 as when the global batch sized them.
  assert train['output_layer'] == {'loops': [2], 'rows_per_device': [1536]}


@pytest.fixture(scope='module')
def big_on_v5p64():
  """wmt14_ende_big in bf16 on a v5p-64 (32 chips, 8 hosts), FSDP over all
  chips, scanned and rematerialised layers: its widest bucket's step."""
  config = load_config('configs/wmt14_ende_big.py:bf16', [
      '--config.mesh.data=1', '--config.mesh.fsdp=32',
      '--config.model.scan_layers=true', '--config.model.remat_policy=full'])
  return compile_run(config, 'v5p-64', kinds=('train',), buckets=[256],
                     log=print)


@pytest.mark.slow
def test_big_with_fsdp_fits_a_v5p64(big_on_v5p64):
  assert (big_on_v5p64['chips'], big_on_v5p64['hosts']) == (32, 8)
  train = _program(big_on_v5p64, 'train')
  assert train['fits'], train
  # ~213M parameters and two Adam moments in float32, split 32 ways.
  assert train['memory_gib']['arguments'] < 0.4
  # FSDP: parameters all-gathered for use, gradients reduce-scattered back
  # (on TPU mostly as windowed einsums, rings of collective-permutes).
  collectives = train['collectives']
  assert collectives['all-gather']['count'] > 0
  assert (collectives['reduce-scatter']['count']
          + collectives['reduce-scatter']['windowed']) > 0
  # attention_impl='auto' on a TPU is the Pallas splash kernel: Mosaic
  # custom calls (self, cross and causal attention, forward and backward).
  assert train['custom_calls'].get('tpu_custom_call', 0) >= 3


# ------------------------------------------------- compiled, shrunk models

@pytest.fixture(scope='module')
def tensor_parallel():
  """A shrunk translator with heads, MLP and vocabulary split 4 ways."""
  config = load_config('configs/quickstart.py:runlocal', SMALL + [
      '--config.mesh.data=2', '--config.mesh.tensor=4'])
  return compile_run(config, 'v5e-8', log=print)


@pytest.mark.slow
def test_tensor_parallel_layout_compiles_every_program(tensor_parallel):
  assert tensor_parallel['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 4}
  names = [p['program'] for p in tensor_parallel['programs']]
  assert names == ['train 16x(40+40)', 'eval 16x(40+40)',
                   'decode beam 4 100x40->56']
  for program in tensor_parallel['programs']:
    assert program['fits'] and program['memory_gib']['total'] > 0
    # Partial sums of split matmuls are all-reduced over `tensor`.
    assert program['collectives']['all-reduce']['count'] >= 1
  assert _program(tensor_parallel, 'train')['model_flops_per_device'] > 0


def gradient_bytes_per_chip(run) -> int:
  """The float32 bytes of the parameters one chip holds."""
  abstract, shardings = run.state_layout
  leaves = jax.tree.leaves(meta.unbox(abstract.params))
  layouts = jax.tree.leaves(
      meta.unbox(shardings.params),
      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return sum(4 * math.prod(s.shard_shape(x.shape))
             for x, s in zip(leaves, layouts))


@pytest.mark.slow
def test_two_slices_send_the_gradient_once_in_padded_tiles():
  """The quickstart's step over 2 x v5e-16, FSDP within each slice: only
  all-reduces cross slices, of about one gradient's values (the tied
  embedding's three parts cross apart), in tiles that pad the small
  shards (docs/pods.md, "More than one slice")."""
  config = load_config('configs/quickstart.py', [
      '--config.mesh.dcn_data=2', '--config.mesh.fsdp=-1',
      '--config.mesh.data=1'])
  report = compile_run(config, 'v5e-16', kinds=('train',), num_slices=2)
  [sent] = [p['cross_slice'] for p in report['programs']]
  assert set(sent) == {'all-reduce'}
  devices = topology_lib.topology_devices(topology_lib.topology('v5e-16', 2))
  gradient = gradient_bytes_per_chip(programs.compiled_run(config, devices))
  assert gradient <= sent['all-reduce']['data_bytes'] <= 1.25 * gradient
  assert sent['all-reduce']['bytes'] > 2 * sent['all-reduce']['data_bytes']


@pytest.mark.slow
def test_oversized_batch_does_not_fit_and_says_what_to_change(
    tmp_path, capsys):
  """262,144 rows of 40 + 40 tokens with an 8,000-piece vocabulary: 65,536
  per v5e chip, whose activations for the backward pass need more than its
  16 GiB (a quarter of that batch fits in 8 GiB: the loss never holds the
  [rows, 40, 8000] logits whole)."""
  path = tmp_path / 'report.json'
  code = cli.main([
      'compile', '--config', 'configs/quickstart.py:runlocal',
      '--topology', 'v5e-4', '--programs', 'train', '--json', str(path),
      '--config.data.batch_size=262144',
      '--config.data.tokenizer.vocab_size=8000'])
  captured = capsys.readouterr()
  assert code == 1
  assert 'fits: no' in captured.out
  assert 'train 262144x(40+40) does not fit' in captured.err
  assert 'GiB more than the 16 GiB of HBM' in captured.err
  for lever in ('mesh.fsdp', 'model.remat_policy', 'model.scan_layers',
                'train.grad_accum_steps'):
    assert lever in captured.err
  report = json.loads(path.read_text())
  [train] = report['programs']
  assert not train['fits'] and train['shortfall_gib'] > 0


@pytest.mark.slow
def test_llama_tiny_compiles_with_gqa_over_fsdp_and_tensor():
  """configs/lm_llama.py:tiny (RoPE, RMSNorm, SwiGLU, 4 heads over 2 kv
  heads), its train step with the kv heads split over `tensor` and the
  parameters over `fsdp`: the TPU compiler takes the layout (at these
  sizes attention is the einsum one, not splash)."""
  config = load_config('configs/lm_llama.py:tiny', [
      '--config.mesh.data=1', '--config.mesh.fsdp=2', '--config.mesh.tensor=2'])
  report = compile_run(config, 'v5e-4', kinds=('train',), log=print)
  train = _program(report, 'train')
  assert report['mesh'] == {'data': 1, 'fsdp': 2, 'tensor': 2}
  assert train['program'] == 'train 16x64' and train['fits'], train
  # Partial sums over `tensor`, parameters gathered over `fsdp`.
  assert train['collectives']['all-reduce']['count'] >= 1
