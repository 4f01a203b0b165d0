"""`jaxformer compile` of LoRA fine-tuning at a small shape (the 8B table
of docs/finetune-llama.md is made the same way): the adapters' train
state is a sliver of the full fine-tune's, an int8 base a quarter of a
float32 one's kernels, an nf4 base less again."""
import pytest

pytest.importorskip(
    'libtpu', reason='libtpu has wheels for Linux x86_64 only; elsewhere '
    'install it as `pip install -e ".[tpu]"` does on Linux x86_64.')

from jaxformer.aot.compile_run import compile_run  # noqa: E402
from jaxformer.config.settings import load_config  # noqa: E402

SMALL = ['--config.model.num_decoder_layers=2', '--config.data.batch_size=8',
         '--config.data.max_target_length=256', '--config.model.max_len=256']
LORA = ['--config.model.lora.targets=q,k,v,o,gate,up,down',
        '--config.model.lora.rank=16']


def train_memory(overrides):
  config = load_config('configs/lm_llama.py:125m', SMALL + overrides)
  report = compile_run(config, 'v5e-8', kinds=('train',), log=print)
  [train] = [p for p in report['programs'] if p['kind'] == 'train']
  assert train['fits'], train
  return train['memory_gib']


@pytest.mark.slow
def test_lora_train_state_is_a_sliver_of_the_full_one():
  full = train_memory([])
  lora_f32 = train_memory(LORA)
  lora_int8 = train_memory(LORA + ['--config.model.lora.base_dtype=int8'])
  lora_nf4 = train_memory(LORA + ['--config.model.lora.base_dtype=nf4'])
  print(f'arguments per chip, GiB: full {full["arguments"]:.4f}, LoRA '
        f'(float32 base) {lora_f32["arguments"]:.4f}, LoRA (int8 base) '
        f'{lora_int8["arguments"]:.4f}, LoRA (nf4 base) '
        f'{lora_nf4["arguments"]:.4f}')
  # Adam's two moments of every parameter are gone: about a third left.
  assert lora_f32['arguments'] < 0.45 * full['arguments']
  assert lora_nf4['arguments'] < lora_int8['arguments'] < (
      lora_f32['arguments'])
