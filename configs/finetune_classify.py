"""Fine-tuning a pretrained encoder (a BERT, RoBERTa or XLM-R import, or any
jaxformer classification export) on your labelled TSV files:

  jaxformer import --from bert-base-cased-sst2 --out models/bert
  jaxformer train --config configs/finetune_classify.py --workdir runs/cls \\
      --config.init.pretrained=models/bert \\
      --config.data.tsv.train=train.tsv --config.data.tsv.dev=dev.tsv

Lines are 'text<TAB>label', or 'text_a<TAB>text_b<TAB>label' for sentence
pairs (each file one kind; the pair's texts get token types 0 and 1 when
the model has them). The labels are the pretrained head's, in its order: a
label it lacks is an error naming it and the known ones; a model without
labels (a fresh head) takes the train split's sorted labels. The model and
tokenizer are the export's; the data, the dropout and the schedule are set
here (`settings.encoder_finetune_config`). Every evaluation reports the dev
split's accuracy and macro F1 (exact, from every example's prediction); the
best checkpoint by accuracy is kept (--config.checkpoint.best_metric=macro_f1
for unbalanced classes). Resume and the time budget work as for any run.
"""
from jaxformer.config.settings import encoder_finetune_config


def get_config():
  return encoder_finetune_config('classification', 'accuracy')
