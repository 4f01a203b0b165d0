"""Quick regression: the value of the number written out in a built-in
English sentence, scaled to [0, 1]. An encoder-only Transformer on CPU.

  jaxformer train --config configs/regress_quick.py --workdir runs/regress
  echo "she bought forty-two red apples ." | jaxformer predict --workdir runs/regress

Your own data: --config.data.source=tsv (lines 'text<TAB>value', with
model.regression_dim space-separated numbers).
`configs/regress_quick.py:runlocal` shrinks it for tests.

Sized for one CPU host. `jaxformer compile --config configs/regress_quick.py
--topology v5e-4` (data=4) printed: train step 64x24 12.0 MiB per chip of
16 GiB (fits), cost model 0.10 ms per step, MFU 1.3%; eval step 3.2 MiB.
"""
from jaxformer.config import default_config


def get_config(arg: str = ''):
  config = default_config()
  config.task = 'regression'
  config.model.update(
      d_model=64, num_heads=4, d_ff=256, num_encoder_layers=2,
      num_decoder_layers=0, max_len=64, embedding_dropout=0.0,
      residual_dropout=0.0, pooling='mean', position_embedding='learned',
      regression_dim=1)
  config.data.builtin.update(dataset='number_value', num_train=20_000,
                             num_dev=500, num_test=500)
  config.data.tokenizer.vocab_size = 256
  config.data.update(max_source_length=24, batch_size=64)
  config.train.update(num_steps=1500, schedule='warmup_cosine',
                      learning_rate=2e-3, warmup_steps=100,
                      grad_clip_norm=1.0, label_smoothing=0.0, log_every=50)
  config.eval.update(every=500, bleu_examples=0, final_split='')
  config.checkpoint.update(every=500, keep=2, best_metric='pearson',
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
