"""The train step compiled for TPU devices from this CPU host, through
libtpu's compile-only client: with attention_impl='auto' it runs the Pallas
splash kernel (a Mosaic custom call), sharded over the batch axes."""
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.model import ModelConfig
from jaxformer.train.tasks import get_task
from jaxformer.train import schedule as schedules
from jaxformer.train.state import state_shardings
from jaxformer.train.step import compile_train_step

TRAIN = ml_collections.ConfigDict(dict(
    schedule='rsqrt', learning_rate=1.0, warmup_steps=4, num_steps=10,
    b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0, grad_clip_norm=0.0))
# head_dim 128: the TPU's lane width.
MODEL = ModelConfig(vocab_size=256, d_model=256, num_heads=2, d_ff=256,
                    num_encoder_layers=1, num_decoder_layers=1, max_len=128,
                    dtype='bfloat16', scan_layers=True)


@pytest.fixture(scope='module')
def v5e_devices():
  """The 4 chips of a v5e 2x2 slice, as compile-only devices."""
  pytest.importorskip('libtpu', reason='libtpu is not installed: pip install '
                      '"libtpu==0.0.42.*" (jax 0.10.2) to compile for TPUs')
  # Other processes on this host may hold libtpu's lock; compiling only,
  # this process needs no TPU of its own.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  from jax.experimental import topologies
  # Where libtpu is installed, it must compile for v5e: a failure here is
  # one, not a reason to skip.
  return topologies.get_topology_desc('v5e:2x2', 'tpu').devices


def compiled_train_step(devices, attention_impl: str, rows=8, length=128,
                        compile_it=True, model=MODEL, mesh_shape=(4, 1, 1)):
  """(HLO text, memory analysis or None) of the train step of `model` on a
  (data, fsdp, tensor) `mesh_shape` mesh of `devices`, compiled (or only
  lowered: compile_it=False)."""
  mesh = jax.sharding.Mesh(np.array(devices).reshape(mesh_shape),
                           mesh_lib.MESH_AXES)
  rules = mesh_lib.DEFAULT_AXIS_RULES
  task = get_task('translation')
  config = model.replace(attention_impl=attention_impl)
  tx = schedules.make_optimizer(TRAIN, schedules.make_schedule(TRAIN, 256))
  example = {'inputs': np.ones((1, length), np.int32),
             'targets': np.ones((1, length), np.int32)}
  abstract, shardings = state_shardings(task, task.model(config), tx, example,
                                        mesh, rules)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      abstract, shardings)
  batch_sharding = mesh_lib.batch_sharding(mesh)
  batch = {key: jax.ShapeDtypeStruct((rows, length), jnp.int32,
                                     sharding=batch_sharding)
           for key in ('inputs', 'targets')}
  with mesh_lib.activate(mesh, rules):
    step = compile_train_step(
        mesh, shardings, task=task,
        model=task.model(config, deterministic=False), tx=tx,
        schedule=schedules.make_schedule(TRAIN, 256), label_smoothing=0.1,
        grad_accum_steps=1, prng_impl='threefry2x32')
    lowered = step.lower(state, batch)
  if not compile_it:
    return lowered.as_text(), None
  compiled = lowered.compile()
  return compiled.as_text(), compiled.memory_analysis()


@pytest.mark.slow
def test_auto_attention_compiles_to_the_splash_kernel_for_tpu(v5e_devices):
  hlo, _ = compiled_train_step(v5e_devices, 'auto')
  # Mosaic kernels are custom calls to tpu_custom_call; forward and the
  # backward's dq and dkv kernels, for 3 attention layers.
  assert hlo.count('custom_call_target="tpu_custom_call"') >= 3
  einsum_hlo, _ = compiled_train_step(v5e_devices, 'einsum', compile_it=False)
  assert 'tpu_custom_call' not in einsum_hlo


# 4 query heads over 2 key/value heads, with the other blocks of today.
GROUPED = MODEL.replace(num_heads=4, num_kv_heads=2, head_dim=128,
                        position_embedding='rope', norm_type='rms',
                        norm_position='pre', activation='swiglu')


@pytest.mark.slow
@pytest.mark.parametrize('tensor', [2, 4])
def test_grouped_query_attention_compiles_to_splash_over_tensor(v5e_devices,
                                                                tensor):
  """tensor=2 splits the 2 kv heads with their query heads; tensor=4 cannot,
  so they stay whole and are repeated for the kernel."""
  hlo, _ = compiled_train_step(v5e_devices, 'auto', model=GROUPED,
                               mesh_shape=(4 // tensor, 1, tensor))
  assert hlo.count('custom_call_target="tpu_custom_call"') >= 3


DECODER = ModelConfig(vocab_size=512, d_model=32, num_heads=2, d_ff=64,
                      num_encoder_layers=1, num_decoder_layers=1, max_len=160)


def lowered_decode(devices, beam_size: int) -> str:
  """StableHLO of a search lowered for `devices` with no mesh in context,
  as `jax.jit(...).lower` with sharded arguments does: greedy search
  (beam 1) or beam search, 140 tokens (long enough for cache buckets), 4
  sentences (few enough for the int8 screen)."""
  from jaxformer.inference import beam_search, search
  from jaxformer.model import EncoderDecoder
  mesh = jax.sharding.Mesh(np.array(devices).reshape(-1, 1, 1),
                           mesh_lib.MESH_AXES)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  tokens = jnp.ones((4, 8), jnp.int32)
  params = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
      jax.eval_shape(EncoderDecoder(DECODER).init, jax.random.PRNGKey(0),
                     tokens, tokens)['params'])
  inputs = jax.ShapeDtypeStruct((4, 8), jnp.int32,
                                sharding=mesh_lib.batch_sharding(mesh))
  if beam_size == 1:
    searcher = lambda p, x: search.greedy_decode(  # noqa: E731
        p, DECODER, x, max_decode_len=140)
  else:
    searcher = lambda p, x: beam_search.beam_search(  # noqa: E731
        p, DECODER, x, beam_size=beam_size, max_decode_len=140)[0]
  return jax.jit(searcher).lower(params, inputs).as_text()


def cpu_kernel_marks(text: str) -> dict[str, int]:
  """Traces of `cpu_kernels` in StableHLO: lax.switch (int8 screen, cache
  buckets), optimization barriers (transposed matmuls, screen) and int8
  products."""
  return {'switch': text.count('stablehlo.case'),
          'barrier': text.count('optimization_barrier'),
          'int8 dot': len(re.findall(r'dot_general.*xi8>', text))}


@pytest.mark.parametrize('beam_size', [1, 4])
def test_decoding_lowered_for_tpu_takes_no_cpu_kernel(v5e_devices, beam_size):
  """The platform is that of the devices a program is built for, not this
  host's backend: the same search lowered for this host's CPU takes them."""
  tpu = cpu_kernel_marks(lowered_decode(v5e_devices, beam_size))
  assert tpu == {'switch': 0, 'barrier': 0, 'int8 dot': 0}
  cpu = cpu_kernel_marks(lowered_decode(jax.devices('cpu')[:1], beam_size))
  assert cpu['switch'] > 0 and cpu['barrier'] > 0
  assert (cpu['int8 dot'] > 0) == (beam_size == 1)
