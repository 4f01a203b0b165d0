"""Fine-tuning a pretrained encoder (a BERT, RoBERTa or XLM-R import with a
regression head, or any jaxformer regression export) on your scored TSV
files, e.g. sentence similarity (STS-B):

  jaxformer train --config configs/finetune_regress.py --workdir runs/sts \\
      --config.init.pretrained=models/bert-sts \\
      --config.data.tsv.train=train.tsv --config.data.tsv.dev=dev.tsv

Lines are 'text<TAB>value', or 'text_a<TAB>text_b<TAB>value' for sentence
pairs (each file one kind), the value model.regression_dim space-separated
numbers. As configs/finetune_classify.py otherwise: every evaluation
reports the dev split's Pearson and Spearman correlations (exact, from
every example's prediction; with several dimensions, their mean), and the
best checkpoint by Spearman is kept (or best_metric='pearson').
"""
from jaxformer.config.settings import encoder_finetune_config


def get_config():
  return encoder_finetune_config('regression', 'spearman')
