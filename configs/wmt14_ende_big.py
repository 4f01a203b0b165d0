"""Transformer (big) on WMT14 English -> German, as in the paper.

Expected: ~28.4 BLEU on newstest2014 (paper, averaging the last 20
checkpoints, beam 4, alpha 0.6); 3.5 days on 8 P100 GPUs for 300k steps;
about a day on a v4-32 or 8 H100/H200 GPUs in bfloat16.

  jaxformer train --config configs/wmt14_ende_big.py:bf16 --workdir gs://BUCKET/big
"""
from jaxformer.config import default_config
from jaxformer.model import config as model_config


def get_config(arg: str = ''):
  config = default_config()
  config.model = model_config.big()  # 1024/4096/16 heads/6+6, dropout 0.3
  config.model.update(max_len=256, share_embeddings='all')
  config.data.source = 'tfds'
  config.data.tfds.update(name='wmt14_translate/de-en', source_language='en',
                          target_language='de', train_split='train',
                          dev_split='validation', test_split='test')
  config.data.tokenizer.update(type='bpe', vocab_size=37000,
                               character_coverage=1.0, sample_size=2_000_000)
  config.data.update(max_source_length=256, max_target_length=256,
                     batching='bucket', tokens_per_batch=25_000)
  config.train.update(num_steps=300_000, schedule='rsqrt', learning_rate=1.0,
                      warmup_steps=4000, label_smoothing=0.1, log_every=100)
  config.eval.update(every=10_000, bleu_examples=1000)
  config.decode.update(beam_size=4, alpha=0.6, max_extra_len=50)
  config.checkpoint.update(every=5000, keep=20, best_metric='bleu')
  if arg == 'bf16':
    config.model.dtype = 'bfloat16'
  return config
