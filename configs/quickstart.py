"""Quick start: a small translator trained on CPU in minutes on the built-in
English -> German numbers dataset.

  jaxformer train --config configs/quickstart.py --workdir runs/quickstart

`configs/quickstart.py:runlocal` shrinks it further for tests.

Sized for one CPU host (2 cores). On a TPU it is tiny: `jaxformer compile
--config configs/quickstart.py --topology v5e-4` (data=4, vocabulary 512)
printed: train step 64x(40+40) 44.5 MiB per chip of 16 GiB (fits), cost
model 0.59 ms per step, MFU 3.5%; eval step 7.0 MiB; beam-4 decode of 100 x
40 -> 56 tokens 27.4 MiB.
"""
from jaxformer.config.settings import default_config


def get_config(arg: str = ''):
  config = default_config()
  config.model.update(
      d_model=128, num_heads=4, d_ff=512, num_encoder_layers=2,
      num_decoder_layers=2, max_len=128, embedding_dropout=0.1,
      residual_dropout=0.1, share_embeddings='all')
  config.data.builtin.update(num_train=50_000, num_dev=500, num_test=500)
  config.data.tokenizer.vocab_size = 512
  config.data.update(max_source_length=40, max_target_length=40,
                     batch_size=64)
  config.train.update(num_steps=600, schedule='warmup_rsqrt',
                      learning_rate=2e-3, warmup_steps=200,
                      grad_clip_norm=1.0, log_every=100)
  config.eval.update(every=300, bleu_examples=200)
  config.decode.update(beam_size=4, alpha=0.6, max_extra_len=16,
                       batch_size=100)
  config.checkpoint.update(every=300, keep=2)
  if arg == 'runlocal':
    config.model.update(d_model=32, d_ff=64, num_encoder_layers=1,
                        num_decoder_layers=1)
    config.data.builtin.update(num_train=2000, num_dev=40, num_test=40)
    config.data.tokenizer.vocab_size = 256
    config.data.batch_size = 16
    config.train.update(num_steps=20, warmup_steps=5, log_every=5)
    config.eval.update(every=10, bleu_examples=16)
    config.checkpoint.update(every=10)
  return config
