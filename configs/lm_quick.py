"""Quick language model: a decoder-only Transformer over the built-in English
sentences (one document per line, packed into rows), on CPU in minutes.

  jaxformer train --config configs/lm_quick.py --workdir runs/lm
  jaxformer generate --workdir runs/lm --prompt "yesterday she bought"

Your own text: --config.data.source=text --config.data.text.train=train.txt
(one document per line; likewise dev and test).
`configs/lm_quick.py:runlocal` shrinks it for tests.

Sized for one CPU host. `jaxformer compile --config configs/lm_quick.py
--topology v5e-4` (data=4) printed: train step 32x64 11.0 MiB per chip of
16 GiB (fits), cost model 0.12 ms per step, MFU 1.7%; eval step 1.4 MiB.
"""
from jaxformer.config import default_config


def get_config(arg: str = ''):
  config = default_config()
  config.task = 'language_model'
  config.model.update(
      d_model=64, num_heads=4, d_ff=256, num_encoder_layers=0,
      num_decoder_layers=2, max_len=64, embedding_dropout=0.0,
      residual_dropout=0.0, share_embeddings='all')
  config.data.builtin.update(dataset='sentences', num_train=20_000,
                             num_dev=500, num_test=500)
  config.data.tokenizer.vocab_size = 256
  config.data.update(max_target_length=64, batch_size=32)
  config.train.update(num_steps=1500, schedule='warmup_cosine',
                      learning_rate=2e-3, warmup_steps=100,
                      grad_clip_norm=1.0, label_smoothing=0.0, log_every=50)
  config.eval.update(every=500, bleu_examples=0, final_split='')
  config.checkpoint.update(every=500, keep=2, best_metric='perplexity',
                           best_mode='min')
  if arg == 'runlocal':
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1)
    config.data.builtin.update(num_train=1000, num_dev=64, num_test=64)
    config.data.tokenizer.vocab_size = 200
    config.data.update(max_target_length=32, batch_size=16)
    config.train.update(num_steps=30, warmup_steps=5, log_every=10,
                        learning_rate=3e-3)
    config.eval.update(every=0)
    config.checkpoint.update(every=30, async_save=False)
  return config
