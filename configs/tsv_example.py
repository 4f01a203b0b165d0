"""Your own parallel text: TSV files with `source<TAB>target` per line
(plain or .gz).

  jaxformer train --config configs/tsv_example.py --workdir runs/mine \
      --config.data.tsv.train=train.tsv --config.data.tsv.dev=dev.tsv \
      --config.data.tsv.test=test.tsv

Sized for one GPU or a v5e-4: `jaxformer compile --config
configs/tsv_example.py --topology v5e-4 --buckets 8` (data=4, vocabulary
8000) printed for the train step of its narrowest bucket, 1024 x (8+8):
87 MiB of arguments, 0.20 GiB of temporaries, 0.39 GiB in all per chip of
16 GiB (fits); cost model 99 GFLOP per chip, no time estimate.
"""
from jaxformer.config import default_config


def get_config(arg: str = ''):
  config = default_config()
  config.model.update(d_model=256, num_heads=4, d_ff=1024,
                      num_encoder_layers=3, num_decoder_layers=3, max_len=256,
                      share_embeddings='all')
  config.data.source = 'tsv'
  config.data.tsv.update(train='data/train.tsv', dev='data/dev.tsv',
                         test='data/test.tsv')
  config.data.tokenizer.update(type='bpe', vocab_size=8000)
  config.data.update(max_source_length=128, max_target_length=128,
                     batching='bucket', tokens_per_batch=8192)
  config.train.update(num_steps=20_000, schedule='rsqrt', learning_rate=1.0,
                      warmup_steps=4000)
  config.eval.update(every=2000, bleu_examples=500)
  config.checkpoint.update(every=2000, keep=3)
  return config
