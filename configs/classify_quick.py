"""Quick classification: is the number written out in a built-in English
sentence even or odd? An encoder-only Transformer, trained on CPU in minutes.

  jaxformer train --config configs/classify_quick.py --workdir runs/classify
  echo "she bought forty-two red apples ." | jaxformer predict --workdir runs/classify

Your own data: --config.data.source=tsv --config.data.tsv.train=train.tsv
(lines 'text<TAB>label'; likewise dev and test).
`configs/classify_quick.py:runlocal` shrinks it for tests.

Sized for one CPU host. `jaxformer compile --config configs/classify_quick.py
--topology v5e-4` (data=4) printed: train step 64x24 12.1 MiB per chip of
16 GiB (fits), cost model 0.10 ms per step, MFU 1.2%; eval step 1.5 MiB.
"""
from jaxformer.config import default_config


def get_config(arg: str = ''):
  config = default_config()
  config.task = 'classification'
  config.model.update(
      d_model=64, num_heads=4, d_ff=256, num_encoder_layers=2,
      num_decoder_layers=0, max_len=64, embedding_dropout=0.0,
      residual_dropout=0.0, pooling='mean', position_embedding='learned')
  config.data.builtin.update(dataset='number_parity', num_train=20_000,
                             num_dev=500, num_test=500)
  config.data.tokenizer.vocab_size = 256
  config.data.update(max_source_length=24, batch_size=64)
  config.train.update(num_steps=1500, schedule='warmup_cosine',
                      learning_rate=2e-3, warmup_steps=100,
                      grad_clip_norm=1.0, label_smoothing=0.0, log_every=50)
  config.eval.update(every=500, bleu_examples=0, final_split='')
  config.checkpoint.update(every=500, keep=2, best_metric='accuracy',
                           best_mode='max')
  if arg == 'runlocal':
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1)
    config.data.builtin.update(num_train=1000, num_dev=64, num_test=64)
    config.data.tokenizer.vocab_size = 200
    config.data.batch_size = 32
    config.train.update(num_steps=30, warmup_steps=5, log_every=10,
                        learning_rate=3e-3)
    config.eval.update(every=0)
    config.checkpoint.update(every=30, async_save=False)
  return config
