"""Your own parallel text: TSV files with `source<TAB>target` per line
(plain or .gz).

  jaxformer train --config configs/tsv_example.py --workdir runs/mine \
      --config.data.tsv.train=train.tsv --config.data.tsv.dev=dev.tsv \
      --config.data.tsv.test=test.tsv

Sized for one GPU or a v5e-4: `jaxformer compile --config
configs/tsv_example.py --topology v5e-4 --programs train --buckets 8,128`
(data=4, vocabulary 8000) printed, per chip of 16 GiB, for the train steps
of its narrowest and widest buckets: 1024 x (8+8), 87 MiB of arguments +
0.20 GiB of temporaries = 0.39 GiB, attention on the einsums (shorter than
a splash block); 64 x (128+128), 87 MiB + 0.22 GiB = 0.40 GiB, splash
attention (27 Mosaic kernels). Both fit; cost model 99 GFLOP per chip and
step, no time estimate for v5e.

`configs/tsv_example.py:cpu` is the recipe for a laptop (2 CPU cores, about
15 minutes); the default is the GPU/TPU recipe. See benchmarks/cpu_recipe.md.
"""
from jaxformer.config.settings import default_config


def get_config(arg: str = ''):
  if arg not in ('', 'cpu'):
    raise ValueError(f"configs/tsv_example.py:{arg}: unknown variant; use "
                     "'configs/tsv_example.py' (GPU/TPU) or "
                     "'configs/tsv_example.py:cpu'.")
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
  if arg == 'cpu':
    _cpu(config)
  return config


def _cpu(config):
  """2 CPU cores, 15 minutes: see benchmarks/cpu_recipe.md for the runs
  behind each choice."""
  # Small and fast beats big and slow in 15 minutes: d_model 192 with a
  # 4k shared vocabulary takes twice the steps of d_model 256 with 8k, and
  # scored 4 BLEU more; pre-LN trains stably at a high learning rate.
  # SwiGLU at 2/3 of the ReLU width (the same parameters and matmul FLOPs)
  # scored 2 BLEU more at equal steps; RMSNorm and RoPE did not help.
  config.model.update(d_model=192, num_heads=4, d_ff=512,
                      activation='swiglu', norm_position='pre',
                      embedding_dropout=0.0, residual_dropout=0.0)
  config.data.tokenizer.update(vocab_size=4000)
  # One program for every batch (no compile per bucket width), rows filled
  # with several short sentences instead of padding; small batches, many
  # updates (16 rows of 64 tokens beat 32 and 64 at equal time).
  config.data.update(max_source_length=64, max_target_length=64,
                     batching='pack', batch_size=16)
  # Warm up, then decay to 0 exactly when the budget ends: the step count
  # is fixed from the measured step time at the end of warm-up.
  config.train.update(num_steps=100_000, max_minutes=15.0,
                      schedule='warmup_cosine', schedule_over_budget=True,
                      learning_rate=2e-3, warmup_steps=100,
                      grad_clip_norm=1.0, log_every=50)
  # Evaluation costs training time; only the final one counts. The mean of
  # the last checkpoints (eval.average_last=N) scored below the last one.
  config.eval.update(every=0, bleu_examples=200)
  config.checkpoint.update(every=200, keep=3)
