"""Transformer (base) on WMT14 English -> German, as in the paper.

Expected: ~27.3 BLEU on newstest2014 (paper, after averaging the last 5
checkpoints, beam 4, alpha 0.6); ~12 hours on 8 P100-class GPUs for 100k
steps, a few hours on a v4-8 or 8 H100/H200 GPUs (bf16).

  jaxformer train --config configs/wmt14_ende_base.py --workdir gs://BUCKET/base
  jaxformer average --workdir gs://BUCKET/base --last 5 --out gs://BUCKET/base-avg

tfds downloads and prepares WMT14 on first use (set data.tfds.data_dir).

The model computes in bfloat16 on GPUs and TPUs and in float32 on CPUs
(model.dtype='auto'); `:bf16` or `:f32` after the file name fixes one.

Sized for a v5e-8 (data parallel, bf16) or 8 GPUs: `jaxformer compile
--config configs/wmt14_ende_base.py:bf16 --topology v5e-8
--config.mesh.data=8 --config.model.scan_layers=true --buckets 256`
printed, per chip of 16 GiB: train step of the widest bucket, 96x(256+256),
0.71 GiB arguments + 2.45 GiB temporaries = 3.19 GiB, splash attention
(9 Mosaic kernels in the scanned layer), the output layer in 2 chunks of
1,536 rows per chip, 27 all-reduce runs per step (7 instructions, 0.29
GiB); eval
step 32x(256+256) 0.39 GiB; beam-4 decode of 64 x 256 -> 256 tokens
0.82 GiB (0.24 GiB of it the parameters). All fit; no time estimate from
the cost model for v5e.
"""
from jaxformer.config.settings import default_config
from jaxformer.model import config as model_config


def get_config(arg: str = ''):
  config = default_config()
  config.model = model_config.base()  # 512/2048/8 heads/6+6, dropout 0.1
  config.model.update(max_len=256, share_embeddings='all')
  config.data.source = 'tfds'
  config.data.tfds.update(name='wmt14_translate/de-en', source_language='en',
                          target_language='de', train_split='train',
                          dev_split='validation', test_split='test')
  config.data.tokenizer.update(type='bpe', vocab_size=37000,
                               character_coverage=1.0, sample_size=2_000_000)
  config.data.update(max_source_length=256, max_target_length=256,
                     batching='bucket', tokens_per_batch=25_000)
  config.train.update(num_steps=100_000, schedule='rsqrt', learning_rate=1.0,
                      warmup_steps=4000, label_smoothing=0.1, log_every=100)
  config.eval.update(every=5000, bleu_examples=1000)
  config.decode.update(beam_size=4, alpha=0.6, max_extra_len=50)
  config.checkpoint.update(every=2500, keep=5, best_metric='bleu')
  dtypes = {'': 'auto', 'bf16': 'bfloat16', 'f32': 'float32'}
  if arg not in dtypes:
    raise ValueError(f'{__file__}:{arg}: the argument is one of '
                     f'{sorted(dtypes)} (the compute dtype).')
  config.model.dtype = dtypes[arg]
  return config
