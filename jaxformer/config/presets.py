"""Preset recipes that config files start from (`configs/*.py`): each is
`default_config()` with a task's settings."""
import ml_collections

from jaxformer.config.run_defaults import default_config


def small_task_config(task: str, dataset: str, best_metric: str,
                      best_mode: str, runlocal: bool
                      ) -> ml_collections.ConfigDict:
  """The shared base of the quick classification, regression and language
  model configs: a 2-layer d_model 64 model on a built-in dataset, trained on
  CPU in minutes (`runlocal`: seconds, for tests). The caller picks the
  layers' side (encoder or decoder) and the lengths."""
  config = default_config()
  config.task = task
  config.model.update(
      d_model=64, num_heads=4, d_ff=256, max_len=64, embedding_dropout=0.0,
      residual_dropout=0.0)
  config.data.builtin.update(dataset=dataset, num_train=20_000, num_dev=500,
                             num_test=500)
  config.data.tokenizer.vocab_size = 256
  config.train.update(num_steps=1500, schedule='warmup_cosine',
                      learning_rate=2e-3, warmup_steps=100,
                      grad_clip_norm=1.0, label_smoothing=0.0, log_every=50)
  config.eval.update(every=500, bleu_examples=0, final_split='')
  config.checkpoint.update(every=500, keep=2, best_metric=best_metric,
                           best_mode=best_mode)
  if runlocal:
    config.model.update(d_model=32, num_heads=2, d_ff=64)
    config.data.builtin.update(num_train=1000, num_dev=64, num_test=64)
    config.data.tokenizer.vocab_size = 200
    config.train.update(num_steps=30, warmup_steps=5, log_every=10,
                        learning_rate=3e-3)
    config.eval.update(every=0)
    config.checkpoint.update(every=30, async_save=False)
  return config


def encoder_finetune_config(task: str, best_metric: str
                            ) -> ml_collections.ConfigDict:
  """The shared base of configs/finetune_classify.py and finetune_regress.py:
  a pretrained encoder (init.pretrained) fine-tuned on 'tsv' files as BERT
  is: dropout 0.1, AdamW at a small peak learning rate after a short
  warm-up, cosine decay; the best checkpoint by the dev `best_metric`."""
  config = default_config()
  config.task = task
  config.init.pretrained = ''  # Required: --config.init.pretrained=EXPORT.
  config.model.update(embedding_dropout=0.1, residual_dropout=0.1,
                      attention_dropout=0.1, ffn_dropout=0.0)
  config.data.source = 'tsv'
  config.data.tsv.update(train='data/train.tsv', dev='data/dev.tsv', test='')
  config.data.update(max_source_length=128, batch_size=32)
  config.train.update(num_steps=2000, schedule='warmup_cosine',
                      learning_rate=2e-5, warmup_steps=200, grad_clip_norm=1.0,
                      label_smoothing=0.0, weight_decay=0.01, log_every=50)
  config.eval.update(every=200, bleu_examples=0, final_split='')
  config.checkpoint.update(every=200, keep=2, best_metric=best_metric,
                           best_mode='max')
  return config
