"""`jaxformer predict` of an imported BERT classifier against Hugging Face's
PyTorch model and CTranslate2's Encoder, side by side in one process on
the same texts, every engine on every core (the machine's speed drifts:
compare within a run only).

  python benchmarks/predict_throughput.py [--texts 1024] [--batch 64] \
      [--layers 4] [--width 256] [--threads N]

A random-weight BertForSequenceClassification (d_ff 4 d, 128 positions,
2 labels) with a WordPiece vocabulary trained here is saved, imported
(`jaxformer import`) and exported (`--format ct2`); each engine then
labels the same texts in batches, after one warm-up batch (jaxformer's
compile). jaxformer pads a batch to its longest text rounded up to a
power of two (a few compiled shapes); PyTorch and CTranslate2 pad to the
batch's longest text. Needs `pip install -e ".[interop]"`.

Printed here (2-core CPU host shared with other jobs, load average ~11;
1024 texts of 8-60 words, batch 64, 4 layers, width 256, 2 threads;
float32 everywhere):

  engine                   texts/s
  jaxformer predict           60.0
  PyTorch (transformers)      36.0
  CTranslate2 Encoder        147.2
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

WORDS = ('the a house cat small red green we bought apples and pears where '
         'is station she reads books every evening he writes letters it '
         'was 2024 café naïve résumé über').split()


def texts(count: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return [' '.join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
          for _ in range(count)]


def write_model(folder: str, layers: int, width: int) -> None:
  """A random BertForSequenceClassification with a trained vocab.txt."""
  import torch
  import transformers
  from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
  from tokenizers import trainers
  os.makedirs(folder)
  tok = Tokenizer(models.WordPiece(unk_token='[UNK]'))
  tok.normalizer = normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.train_from_iterator(texts(2000, 1), trainers.WordPieceTrainer(
      vocab_size=1000, show_progress=False,
      special_tokens=['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']))
  vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
  with open(os.path.join(folder, 'vocab.txt'), 'w', encoding='utf-8') as f:
    f.write(''.join(f'{t}\n' for t, _ in vocab))
  with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'BertTokenizer', 'do_lower_case': True}, f)
  torch.manual_seed(0)
  config = transformers.BertConfig(
      vocab_size=len(vocab), hidden_size=width, num_hidden_layers=layers,
      num_attention_heads=max(width // 64, 1), intermediate_size=4 * width,
      max_position_embeddings=128, num_labels=2)
  transformers.BertForSequenceClassification(config).eval().save_pretrained(
      folder)


def timed(run, batches) -> float:
  """Texts per second of `run` over the batches, after one warm-up."""
  run(batches[0])
  start = time.perf_counter()
  for batch in batches:
    run(batch)
  return sum(map(len, batches)) / (time.perf_counter() - start)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--texts', type=int, default=1024)
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--width', type=int, default=256)
  parser.add_argument('--threads', type=int, default=os.cpu_count(),
                      help="PyTorch's and CTranslate2's threads (XLA takes "
                      'every core; default: every core)')
  args = parser.parse_args(argv)
  import ctranslate2
  import torch
  import transformers
  from jaxformer.checkpoints import trained
  from jaxformer.cli import main as cli
  from jaxformer.inference import predict
  torch.set_num_threads(args.threads)
  root = tempfile.mkdtemp()
  folder, ours, ct2_out = (os.path.join(root, n) for n in ('hf', 'ours', 'ct2'))
  write_model(folder, args.layers, args.width)
  for argv_ in (['import', '--from', folder, '--out', ours],
                ['export', '--format', 'ct2', '--from', ours, '--out', ct2_out]):
    assert cli.main(argv_) == 0
  model = trained.load(ours)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(
      folder).eval()
  hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
  encoder = ctranslate2.Encoder(ct2_out, intra_threads=args.threads)
  lines = texts(args.texts, 2)
  batches = [lines[i:i + args.batch] for i in range(0, len(lines), args.batch)]

  # One compiled predictor for the run, as `jaxformer predict` has.
  predictor = predict._predictor(model.model_config, model.config)

  def jaxformer_batch(batch):
    predict._predictions(predictor, model.params, model.config,
                         model.source_tok, batch)

  def torch_batch(batch):
    with torch.no_grad():
      hf(**hf_tok(batch, padding=True, truncation=True, max_length=128,
                  return_tensors='pt')).logits.argmax(-1)

  def ct2_batch(batch):
    ids = hf_tok(batch, truncation=True, max_length=128)['input_ids']
    encoder.forward_batch(ids)

  print(f'{args.texts} texts, batch {args.batch}, {args.layers} layers, '
        f'width {args.width}, {args.threads} threads', file=sys.stderr)
  print(f'{"engine":<22}{"texts/s":>10}')
  for name, run in (('jaxformer predict', jaxformer_batch),
                    ('PyTorch (transformers)', torch_batch),
                    ('CTranslate2 Encoder', ct2_batch)):
    print(f'{name:<22}{timed(run, batches):>10.1f}', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
