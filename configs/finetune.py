"""Fine-tuning a pretrained model (an OPUS-MT import or any jaxformer
export) on your own TSV files (`source<TAB>target` per line):

  jaxformer import --from opus-mt-en-de --out models/opus-en-de
  jaxformer train --config configs/finetune.py --workdir runs/ft \
      --config.init.pretrained=models/opus-en-de \
      --config.data.tsv.train=train.tsv --config.data.tsv.dev=dev.tsv \
      --config.data.tsv.test=test.tsv

The model (its shapes, vocabulary, special ids, decoder start) and the
tokenizers are the export's; this file sets the data, the dropout and the
schedule: a short warm-up to a small peak learning rate, then cosine decay
to 0 (a pretrained model forgets what it knew at from-scratch rates).
Resume, the time budget (train.max_minutes), checkpoint averaging
(eval.average_last) and evaluation work as for any run.
"""
from jaxformer.config.settings import default_config


def get_config():
  config = default_config()
  config.init.pretrained = ''  # Required: --config.init.pretrained=EXPORT.
  config.model.update(embedding_dropout=0.1, residual_dropout=0.1,
                      attention_dropout=0.0, ffn_dropout=0.0)
  config.data.source = 'tsv'
  config.data.tsv.update(train='data/train.tsv', dev='data/dev.tsv',
                         test='data/test.tsv')
  config.data.update(max_source_length=128, max_target_length=128,
                     batching='bucket', tokens_per_batch=4096)
  config.train.update(num_steps=5000, schedule='warmup_cosine',
                      learning_rate=5e-5, warmup_steps=200,
                      grad_clip_norm=1.0, label_smoothing=0.1,
                      weight_decay=0.0, log_every=50)
  config.eval.update(every=500, bleu_examples=500)
  config.decode.update(beam_size=4, alpha=0.6)
  config.checkpoint.update(every=500, keep=3)
  return config
