"""Random-weight COMET checkpoint folders built offline with Unbabel's
`comet` package: a tiny XLM-R (`XLMRobertaConfig`, a SentencePiece
tokenizer trained here) saved as the `pretrained_model` folder, the COMET
model class built on it with small hparams, every weight drawn anew (the
layer mix's scalars and gamma too), and its state saved as
checkpoints/model.ckpt beside hparams.yaml, as `comet` saves a model."""
import os

import bert_folders

XLMR = dict(hidden_size=32, num_attention_heads=4, intermediate_size=48,
            num_hidden_layers=2, max_position_embeddings=40,
            type_vocab_size=1, pad_token_id=1, bos_token_id=0,
            eos_token_id=2)
# class_identifier -> the comet class.
CLASSES = {'regression_metric': 'RegressionMetric',
           'referenceless_regression_metric': 'ReferencelessRegression',
           'unified_metric': 'UnifiedMetric'}


def write_encoder(folder: str) -> None:
  """The tiny XLM-R's config.json and tokenizer (no weights: COMET's
  checkpoint holds them)."""
  import transformers
  bert_folders.write_sentencepiece(folder, as_json=False)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  transformers.XLMRobertaConfig(vocab_size=len(tokenizer) + 3,
                                **XLMR).save_pretrained(folder)


def write_checkpoint(folder: str, kind: str = 'regression_metric',
                     seed: int = 0, **hparams):
  """Writes a COMET folder of `kind` (the encoder in folder/encoder);
  returns the comet model, in eval mode."""
  import torch
  import yaml
  from comet import models
  encoder = os.path.join(folder, 'encoder')
  write_encoder(encoder)
  layer = (dict(sent_layer='mix') if kind == 'unified_metric'
           else dict(layer='mix', pool='avg'))
  hparams = dict(dict(pretrained_model=encoder, load_pretrained_weights=False,
                      hidden_sizes=[24, 16], layer_norm=True,
                      activations='Tanh', final_activation=None, dropout=0.1,
                      **layer), **hparams)
  torch.manual_seed(seed)
  model = getattr(models, CLASSES[kind])(**hparams)
  bert_folders._randomize(model.encoder.model, seed)  # noqa: SLF001
  generator = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      if not name.startswith('encoder.'):  # Spread: sparsemax drops some.
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * (
            1.0 if tensor.ndim < 2 else tensor.shape[1] ** -0.5))
  os.makedirs(os.path.join(folder, 'checkpoints'))
  import pytorch_lightning
  torch.save({'state_dict': model.state_dict(),
              'hyper_parameters': dict(model.hparams),
              'pytorch-lightning_version': pytorch_lightning.__version__},
             os.path.join(folder, 'checkpoints', 'model.ckpt'))
  with open(os.path.join(folder, 'hparams.yaml'), 'w') as f:
    yaml.safe_dump(dict(hparams, class_identifier=kind), f)
  return model.eval()


def _encoder_forward(self, input_ids, attention_mask, **kwargs):
  """comet 2.2.7's XLMREncoder.forward with transformers 5's outputs:
  that version unpacks three values from `return_dict=False` (last
  states, pooler output, hidden states), and transformers 5 leaves out
  the absent pooler's None; the same values, read by name."""
  out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                   output_hidden_states=True, return_dict=True)
  return {'sentemb': out.last_hidden_state[:, 0, :],
          'wordemb': out.last_hidden_state, 'all_layers': out.hidden_states,
          'attention_mask': attention_mask}


def _pair_with_special_tokens(self, ids_a, ids_b=None):
  """transformers 4's XLMRobertaTokenizer.build_inputs_with_special_tokens
  (gone in transformers 5), which comet's unified metric calls: <s> a
  </s>, or <s> a </s></s> b </s>."""
  start, end = [self.cls_token_id], [self.sep_token_id]
  if ids_b is None:
    return start + list(ids_a) + end
  return start + list(ids_a) + end + end + list(ids_b) + end


def comet_scores(folder: str, samples: list[dict], monkeypatch
                 ) -> list[float]:
  """`comet`'s own predict of the saved folder (loaded as comet loads a
  downloaded model), on CPU; where transformers 5 changed what comet
  2.2.7 calls (`_encoder_forward`, `_pair_with_special_tokens`), the same
  values as transformers 4 gave; the rest comet's code."""
  from comet import load_from_checkpoint
  from comet.encoders import xlmr
  monkeypatch.setattr(xlmr.XLMREncoder, 'forward', _encoder_forward)
  model = load_from_checkpoint(
      os.path.join(folder, 'checkpoints', 'model.ckpt'))
  monkeypatch.setattr(type(model.encoder.tokenizer),
                      'build_inputs_with_special_tokens',
                      _pair_with_special_tokens, raising=False)
  return list(model.predict(samples, batch_size=8, gpus=0,
                            progress_bar=False).scores)
