"""LoRA fine-tuning of an imported Llama-family model on chat data
(docs/finetune-llama.md): the base frozen (held in model.lora.base_dtype),
rank-16 adapters on every projection of attention and the FFN training
alone, with their Adam moments; one conversation a row, rendered with the
model's own chat template, the loss on the assistant's tokens.

  jaxformer import --from Llama-3.1-8B-Instruct --out models/llama8b
  jaxformer train --config configs/finetune_lora.py:8b --workdir runs/lora \\
      --config.init.pretrained=models/llama8b \\
      --config.data.text.train=chat_train.jsonl \\
      --config.data.text.dev=chat_dev.jsonl
  jaxformer export --format peft --from runs/lora --out adapter  # PEFT, vLLM
  jaxformer export --format hf --from runs/lora --out merged     # merged

Each line of the JSONL files is {"messages": [{"role": "system" | "user" |
"assistant", "content": ...}, ...]} (data.lm_rows=chat, data/lm_rows.py).
Presets (model shapes come from the export; these set what fits):

  1b  Llama-3.2-1B-sized imports on one GPU or chip: 2,048-token rows,
      16 a step, float32 base, remat none.
  8b  Llama-3.1-8B-sized imports on one 80 GB GPU or a v5e-8: 4,096-token
      rows, 8 a step, bfloat16 compute and base, layers rematerialised
      (remat full), FSDP over every device.

`jaxformer compile --config configs/finetune_lora.py:8b --topology v5e-8`
sizes it without the import (`--config.model...` as in
docs/finetune-llama.md, which has the table).
"""
from jaxformer.config.settings import default_config

# Row width, rows a step, base dtype, remat policy.
PRESETS = {
    '1b': (2048, 16, 'float32', 'none'),
    '8b': (4096, 8, 'bfloat16', 'full'),
}
TARGETS = 'q,k,v,o,gate,up,down'


def get_config(arg: str = '8b'):
  if arg not in PRESETS:
    raise ValueError(f'configs/finetune_lora.py:{arg} is not a preset; choose '
                     f'one of {", ".join(PRESETS)}.')
  width, rows, base_dtype, remat = PRESETS[arg]
  config = default_config()
  config.task = 'language_model'
  config.init.pretrained = ''  # Required: --config.init.pretrained=EXPORT.
  config.model.update(embedding_dropout=0.0, residual_dropout=0.0,
                      attention_dropout=0.0, ffn_dropout=0.0,
                      remat_policy=remat, max_len=width,
                      dtype='bfloat16' if base_dtype == 'bfloat16'
                      else 'float32')
  config.model.lora.update(targets=TARGETS, rank=16, alpha=32.0, dropout=0.05,
                           base_dtype=base_dtype)
  config.mesh.update(data=1, fsdp=-1)
  config.data.update(source='text', lm_rows='chat', max_target_length=width,
                     batch_size=rows)
  config.data.text.update(train='data/chat_train.jsonl',
                          dev='data/chat_dev.jsonl', test='')
  config.train.update(num_steps=1000, schedule='warmup_cosine',
                      learning_rate=2e-4, warmup_steps=30,
                      grad_clip_norm=1.0, label_smoothing=0.0,
                      weight_decay=0.0, b2=0.999, eps=1e-8, log_every=20)
  config.eval.update(every=200, bleu_examples=0, final_split='')
  config.checkpoint.update(every=200, keep=3, best_metric='perplexity',
                           best_mode='min')
  return config
