"""Fine-tuning a pretrained language model (a Llama-family import or any
jaxformer language_model export), sharded over all devices (FSDP):

  jaxformer import --from Qwen2.5-0.5B --out models/qwen
  # (b) prompt<TAB>response lines, the loss on the responses only:
  jaxformer train --config configs/finetune_lm.py --workdir runs/ft \\
      --config.init.pretrained=models/qwen \\
      --config.data.tsv.train=train.tsv --config.data.tsv.dev=dev.tsv
  # (a) plain text, one document per line, packed into rows:
  jaxformer train --config configs/finetune_lm.py:text --workdir runs/ft \\
      --config.init.pretrained=models/qwen \\
      --config.data.text.train=train.txt --config.data.text.dev=dev.txt

The model and the tokenizer are the export's (no tokenizer is trained): a
row of a pair is the model's start token (an imported Llama's BOS; none
for a tokenizer without BOS, as Qwen2's) + prompt + response + EOS as the
tokenizer makes them (data/lm_rows.py); a document is the start token +
text + EOS. This file sets the
data, the dropout and the schedule: a short warm-up to a small peak
learning rate, cosine decay to 0. Resume, the time budget
(train.max_minutes) and checkpoint averaging work as for any run.
"""
from jaxformer.config.settings import default_config

LAYOUTS = {'tsv': 'prompt_response', 'text': 'packed'}


def get_config(arg: str = 'tsv'):
  if arg not in LAYOUTS:
    raise ValueError(f'configs/finetune_lm.py:{arg}: choose one of '
                     f'{sorted(LAYOUTS)}')
  config = default_config()
  config.task = 'language_model'
  config.init.pretrained = ''  # Required: --config.init.pretrained=EXPORT.
  config.model.update(embedding_dropout=0.0, residual_dropout=0.0,
                      attention_dropout=0.0, ffn_dropout=0.0)
  config.mesh.update(data=1, fsdp=-1)
  config.data.update(source=arg, lm_rows=LAYOUTS[arg], max_target_length=512,
                     batch_size=32)
  config.data[arg].update(train=f'data/train.{arg}', dev=f'data/dev.{arg}',
                          test='')
  config.train.update(num_steps=2000, schedule='warmup_cosine',
                      learning_rate=2e-5, warmup_steps=100,
                      grad_clip_norm=1.0, label_smoothing=0.0,
                      weight_decay=0.0, log_every=50)
  config.eval.update(every=500, bleu_examples=0, final_split='')
  config.checkpoint.update(every=500, keep=3, best_metric='perplexity',
                           best_mode='min')
  return config
