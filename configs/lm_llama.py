"""A Llama-style decoder-only language model trained from scratch: rotary
positions, RMSNorm before each block and after the last, SwiGLU FFNs,
grouped-query attention, no biases, no dropout; AdamW (betas 0.9, 0.95;
weight decay 0.1 on every parameter; gradients clipped at norm 1) with a
warm-up and cosine decay to 0. The text after the colon picks the size:

  jaxformer train --config configs/lm_llama.py:tiny --workdir runs/tiny
  jaxformer train --config configs/lm_llama.py:1b --workdir gs://BUCKET/1b \\
      --config.data.text.train=gs://BUCKET/train.txt \\
      --config.data.text.dev=gs://BUCKET/dev.txt
  jaxformer generate --workdir runs/tiny --prompt "yesterday she bought"

Presets (parameters counted by tests/test_lm_llama.py):

  tiny  d_model 64, 2 layers, 4 heads / 2 kv, d_ff 128, tied; the built-in
        English sentences, 30 steps: ~20 s of CPU (90k params).
  125m  768, 12 layers, 12 / 4 kv, d_ff 3072, 32,000 pieces, tied; 2048
        tokens x 256 rows (0.5M tokens a step), 20k steps (128M params).
  1b    Llama-3.2-1B's shape: 2048, 16 layers, 32 / 8 kv, d_ff 8192,
        128,256 pieces, tied, rope_theta 500,000 with llama3 scaling (factor
        32, original 8192); 4096 x 256 rows (1M tokens), 50k steps (1.24B).
  8b    Llama-3.1-8B's shape: 4096, 32 layers, 32 / 8 kv, d_ff 14336,
        128,256 pieces, untied head, llama3 scaling factor 8; 4096 x 512
        rows (2M tokens), 100k steps (8.03B).

125m and up compute in bfloat16 with scanned, rematerialised layers
(model.remat_policy=dots: the matmuls' outputs are kept for the backward
pass, the rest recomputed) and shard parameters, gradients and Adam moments
over every chip (mesh.fsdp=-1, FSDP); the batch is split over the same
chips. A batch holds documents packed into rows (one document a line,
each the start token + text + EOS, every token a target:
data.lm_rows=packed). tiny reads the built-in sentences; the others read
data.text.train / dev (local or gs://; by default data/train.txt and
data/dev.txt until set).

The tokenizer is the run's own, as in configs/lm_quick.py: a SentencePiece
BPE model of data.tokenizer.vocab_size pieces (the preset's vocabulary)
trained by process 0 on a seeded sample of data.tokenizer.sample_size train
lines and kept in the workdir (<workdir>/tokenizer/joint.model). A
128,256-piece BPE needs a large sample (the 1b and 8b presets take
1,000,000 lines) and takes a while to train. Any tokenizer file a jaxformer
run keeps there may stand in: --config.data.tokenizer.model_path=FILE with
--config.data.tokenizer.vocab_size=N --config.model.vocab_size=N, its size
(`jaxformer compile` reads the latter). A run of configs/finetune_lm.py
from an imported Llama 3 (`jaxformer import`) keeps Llama 3's byte-level BPE
(128,256 ids) there; the model then pads and ends documents with its ids,
and --config.model.decoder_start_id=128000 starts each document with its
<|begin_of_text|> instead of id 0 (tests/interop/test_lm_llama_tokenizer.py
trains tiny so on a small Llama 3-style tokenizer).

Sized with `jaxformer compile --config configs/lm_llama.py:1b --topology
v5p-64 --programs train` (and `:8b --topology v5p-256`, `:125m --topology
v5p-8`; libtpu's compile-only client on a CPU), per chip of 95 GiB:
  125m, v5p-8 (4 chips, one host), fsdp=4, 64 rows of 2048 a chip: 0.38 GiB
    arguments + 37.68 GiB temporaries = 38.08 GiB, fits (without remat
    104.95 GiB: does not); all-reduce 125 runs (0.33 GiB), all-gather 170
    (0.12 GiB). Model FLOPs 131 TFLOP per chip a step: 0.28 s at peak.
  1b, v5p-64 (32 chips, 8 hosts), fsdp=32, 8 rows of 4096 a chip, remat
    dots: 0.49 GiB arguments + 32.29 GiB temporaries = 32.81 GiB, fits
    (remat full: 11.79 GiB; none: 96.22 GiB, does not); per step all-reduce
    52 runs (0.98 GiB), all-gather 3 + 224 in windowed einsums,
    reduce-scatter 112 windowed, 21,840 collective-permutes (11.04 GiB);
    output layer 11 chunks. Model FLOPs 296 TFLOP per chip a step: 0.64 s
    at the chip's peak.
  8b, v5p-256 (128 chips, 32 hosts), fsdp=128, 4 rows a chip, remat dots:
    0.70 GiB arguments + 51.95 GiB temporaries = 52.72 GiB, fits (remat
    full: 13.93 GiB); per step 487 all-reduces (44.9 GiB; 15 in the
    scanned layers' loop bodies, run 32 times) and 2 all-to-alls, no
    all-gather or reduce-scatter: XLA laid out this FSDP step unlike the
    1b's. Model FLOPs 843 TFLOP per chip:
    1.84 s at peak.
XLA's cost model counts one layer of a scan (41.7 and 96.9 ms, "MFU" 1546%
and 1896%), so it gives no step time here; docs/pods.md has the table.
"""
from jaxformer.config.settings import default_config, small_task_config

# d_model, layers, heads, kv heads, d_ff, vocabulary, tied head.
SHAPES = {
    'tiny': (64, 2, 4, 2, 128, 256, True),
    '125m': (768, 12, 12, 4, 3072, 32_000, True),
    '1b': (2048, 16, 32, 8, 8192, 128_256, True),
    '8b': (4096, 32, 32, 8, 14_336, 128_256, False),
}
# Sequence length, rows a step, steps, peak learning rate, warm-up steps.
TRAINING = {
    'tiny': (64, 16, 30, 3e-3, 5),
    '125m': (2048, 256, 20_000, 6e-4, 1000),
    '1b': (4096, 256, 50_000, 4e-4, 2000),
    '8b': (4096, 512, 100_000, 3e-4, 2000),
}
# RoPE base and llama3 scaling factor (0: no scaling).
ROPE = {'tiny': (10_000.0, 0), '125m': (10_000.0, 0),
        '1b': (500_000.0, 32.0), '8b': (500_000.0, 8.0)}
PRESETS = tuple(SHAPES)


def get_config(arg: str = 'tiny'):
  if arg not in SHAPES:
    raise ValueError(f'configs/lm_llama.py:{arg} is not a preset; choose one '
                     f'of {", ".join(PRESETS)} (configs/lm_llama.py:1b).')
  if arg == 'tiny':
    config = small_task_config('language_model', 'sentences', 'perplexity',
                               'min', runlocal=True)
  else:
    config = _text_config()
  _set_model(config, arg)
  length, rows, steps, peak, warmup = TRAINING[arg]
  config.model.max_len = max(length, config.model.max_len)
  config.data.update(max_target_length=length, batch_size=rows)
  config.train.update(num_steps=steps, schedule='warmup_cosine',
                      learning_rate=peak, warmup_steps=warmup, b1=0.9,
                      b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0,
                      label_smoothing=0.0)
  return config


def _text_config():
  """Plain text on an accelerator slice: FSDP over every chip."""
  config = default_config()
  config.task = 'language_model'
  config.mesh.update(data=1, fsdp=-1)
  config.data.update(source='text', lm_rows='packed')
  config.data.text.update(train='data/train.txt', dev='data/dev.txt', test='')
  config.data.tokenizer.update(sample_size=200_000)
  config.train.log_every = 100
  config.eval.update(every=1000, num_batches=50, bleu_examples=0,
                     final_split='')
  config.checkpoint.update(every=1000, keep=3, best_metric='perplexity',
                           best_mode='min')
  return config


def _set_model(config, preset: str) -> None:
  d_model, layers, heads, kv_heads, d_ff, vocab, tied = SHAPES[preset]
  theta, factor = ROPE[preset]
  config.model.update(
      d_model=d_model, num_encoder_layers=0, num_decoder_layers=layers,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=0, d_ff=d_ff,
      share_embeddings='all' if tied else 'none', norm_position='pre',
      norm_type='rms', rms_norm_epsilon=1e-5, activation='swiglu',
      position_embedding='rope', rope_theta=theta, scale_embedding=False,
      use_bias=False, logits_bias=False, output_bias=False,
      embedding_dropout=0.0, residual_dropout=0.0, attention_dropout=0.0,
      ffn_dropout=0.0)
  if factor:
    config.model.update(rope_scaling='llama3', rope_scaling_factor=factor,
                        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_max_len=8192)
  config.model.vocab_size = vocab  # The tokenizer's size replaces it.
  config.data.tokenizer.vocab_size = vocab
  if preset != 'tiny':
    # Fits 95 GiB a chip (see above).
    config.model.update(dtype='bfloat16', scan_layers=True,
                        remat_policy='dots')
  if preset in ('1b', '8b'):
    config.data.tokenizer.sample_size = 1_000_000
