"""`jaxformer evaluate --comet DIR`: a COMET checkpoint folder, as
Unbabel's `comet` package saves and downloads it, read for scoring in JAX
(comet_scores.py computes).

The folder: `hparams.yaml` (class_identifier, pretrained_model, pool,
layer, layer_norm, hidden_sizes, activations, final_activation) and
`checkpoints/model.ckpt` (a PyTorch Lightning checkpoint, or its bare
state dict). Three models are read:
  regression_metric (wmt22-comet-da): source, translation and reference;
  referenceless_regression_metric (QE): source and translation;
  unified_metric (CometKiwi, wmt22-cometkiwi-da: input_segments mt, src;
    with mt, src, ref and a reference given, the mean of its scores of
    mt:src, mt:ref and mt:src:ref), one sequence of the sentences joined,
    its first token's mixed states read by the estimator (sent_layer).
Each is an XLM-R encoder (`encoder.model.*`: read by bert.py's one table
of the BERT family), a layer-wise attention over its embeddings and every
layer's output (`layerwise_attention.scalar_parameters.{i}`, `.gamma`) and
a feed-forward estimator (`estimator.ff.{3k}.{weight,bias}`: Linear,
activation, dropout, ..., Linear, final activation).

The encoder's config.json and tokenizer are not in a COMET folder: they
come from `pretrained_model`, which must name a local folder (absolute, or
relative to DIR), or DIR holds one of that name (offline: no hub).
"""
import dataclasses
import os
from typing import NamedTuple

import numpy as np

from jaxformer.interop import bert, hf_folders
from jaxformer.model.config import ModelConfig
from jaxformer.storage import paths
from jaxformer.storage.errors import InteropError

# class_identifier -> the sentences it reads besides the translation
# (None: hparams.yaml's input_segments say).
MODELS = {'regression_metric': ('src', 'ref'),
          'referenceless_regression_metric': ('src',),
          'unified_metric': None}
# class_identifier -> the sentence embeddings the estimator reads.
FEATURES = {'regression_metric': 6, 'referenceless_regression_metric': 4,
            'unified_metric': 1}
# comet's activations (names of torch.nn classes as str.title() spells
# them) that jaxformer computes.
ACTIVATIONS = ('tanh', 'sigmoid', 'softplus', 'softsign')
POOLS = ('avg', 'cls', 'max')
TRANSFORMATIONS = ('softmax', 'sparsemax')
ENCODER_PREFIX = 'encoder.model.'


class CometError(InteropError):
  """The folder is not a COMET checkpoint jaxformer scores with; the
  message names the file or key."""


class Comet(NamedTuple):
  """A COMET model: its class_identifier, the sentences it reads besides
  the translation ('src', 'ref'), the encoder's config and parameters
  (`PooledEncoder`'s, no pooler), the layer mix (weights [layers + 1]
  before their `transformation`, gamma; or `layer`: one layer's states),
  the pooling, and the estimator's layers [(kernel [in, out], bias [out])]
  with their activations."""
  kind: str
  segments: tuple[str, ...]
  encoder_config: ModelConfig
  encoder_params: dict
  tokenizer: object
  mix_weights: np.ndarray | None
  transformation: str
  gamma: float
  layer: int | None
  layer_norm: bool
  pool: str
  estimator: list[tuple[np.ndarray, np.ndarray]]
  activation: str
  final_activation: str | None



def read_hparams(folder: str, given_as: str = '--comet') -> dict:
  """hparams.yaml of `folder`, checked for what jaxformer computes;
  `given_as` names where the folder was given (a flag, a config key)."""
  import yaml
  path = paths.join(folder, 'hparams.yaml')
  if not paths.is_dir(folder):
    raise CometError(f'{given_as} {folder}: no such folder')
  if not paths.exists(path):
    raise CometError(f'{given_as} {folder}: no hparams.yaml; a COMET '
                     'checkpoint folder holds hparams.yaml and '
                     'checkpoints/model.ckpt')
  try:
    hparams = yaml.safe_load(paths.read_text(path))
  except yaml.YAMLError as e:
    raise CometError(f'{path} is not YAML ({str(e).splitlines()[0]})') from None
  if not isinstance(hparams, dict):
    raise CometError(f'{path} is not a mapping of hyper-parameters')
  kind = hparams.get('class_identifier', 'regression_metric')
  if kind not in MODELS:
    raise CometError(f'{path}: class_identifier {kind!r} (jaxformer scores '
                     f'with {", ".join(MODELS)})')
  for key, allowed in (('pool', POOLS), ('activations', ACTIVATIONS)):
    value = str(hparams.get(key, allowed[0])).lower()
    if value not in allowed:
      raise CometError(f'{path}: {key} {value!r} (supported: '
                       f'{", ".join(allowed)})')
  final = hparams.get('final_activation')
  if final is not None and str(final).lower() not in ACTIVATIONS:
    raise CometError(f'{path}: final_activation {final!r} (supported: '
                     f'{", ".join(ACTIVATIONS)})')
  if hparams.get('word_level_training'):
    raise CometError(f'{path}: word_level_training (jaxformer scores '
                     'sentences; word-level tags are not read)')
  if transformation(hparams) not in TRANSFORMATIONS:
    raise CometError(f'{path}: layer_transformation '
                     f'{hparams["layer_transformation"]!r} (supported: '
                     f'{", ".join(TRANSFORMATIONS)})')
  return hparams


def transformation(hparams: dict) -> str:
  """The layer mix's weights: 'softmax' or 'sparsemax' (comet's own
  default for each class; its 'sparsemax_patch' is computed as softmax,
  as comet >= 2.2.4 does)."""
  unified = hparams.get('class_identifier') == 'unified_metric'
  name = str(hparams.get('layer_transformation',
                         'sparsemax' if unified else 'softmax'))
  return 'softmax' if name == 'sparsemax_patch' else name


def encoder_folder(folder: str, hparams: dict) -> str:
  """The local folder of the encoder's config.json and tokenizer."""
  name = str(hparams.get('pretrained_model', ''))
  candidates = [name if os.path.isabs(name) else paths.join(folder, name),
                paths.join(folder, os.path.basename(name.rstrip('/')))]
  for candidate in candidates:
    if name and paths.exists(paths.join(candidate, 'config.json')):
      return candidate
  raise CometError(
      f'{folder}/hparams.yaml: pretrained_model {name!r} is not a local '
      'folder with config.json; put the encoder\'s config.json and tokenizer '
      f'files in {folder}/{os.path.basename(name.rstrip("/")) or "ENCODER"} '
      '(jaxformer reads no hub)')


def read_state(folder: str, given_as: str = '--comet') -> dict:
  """{name: float32 array} of checkpoints/model.ckpt."""
  path = paths.join(folder, 'checkpoints', 'model.ckpt')
  if not paths.exists(path):
    raise CometError(f'{given_as} {folder}: no checkpoints/model.ckpt; a '
                     'COMET checkpoint folder holds hparams.yaml and '
                     'checkpoints/model.ckpt')
  import io
  import torch
  try:
    state = torch.load(io.BytesIO(paths.read_bytes(path)), map_location='cpu',
                       weights_only=True)
  except Exception as e:  # noqa: BLE001 - torch raises many kinds.
    raise CometError(f'{path} cannot be read ({str(e).splitlines()[0]}); '
                     'download it again') from None
  state = state.get('state_dict', state) if isinstance(state, dict) else None
  if not isinstance(state, dict):
    raise CometError(f'{path} holds no state_dict')
  return {k: v.float().numpy() for k, v in state.items()
          if isinstance(v, torch.Tensor)}


def _take(state: dict, name: str, shape: tuple) -> np.ndarray:
  if name not in state:
    raise CometError(f'checkpoints/model.ckpt has no {name}; is this a '
                     'COMET model of hparams.yaml?')
  if tuple(state[name].shape) != shape:
    raise CometError(f'{name} has shape {tuple(state[name].shape)}, the '
                     f'encoder\'s config.json says {shape}')
  return state.pop(name)


def _estimator(state: dict, in_dim: int, hparams: dict
               ) -> list[tuple[np.ndarray, np.ndarray]]:
  sizes = [int(s) for s in hparams.get('hidden_sizes', [3072, 1024])] + [1]
  layers_, width = [], in_dim
  for i, size in enumerate(sizes):
    name = f'estimator.ff.{3 * i}'
    kernel = _take(state, f'{name}.weight', (size, width))
    layers_.append((kernel.T.copy(), _take(state, f'{name}.bias', (size,))))
    width = size
  return layers_


def load(folder: str, given_as: str = '--comet') -> Comet:
  """The COMET model of `folder`, every tensor checked; one CometError
  names what is missing or wrong (the folder as `given_as`, a flag or a
  config key, gave it)."""
  folder = paths.absolute(folder)
  hparams = read_hparams(folder, given_as)
  kind = hparams.get('class_identifier', 'regression_metric')
  source = encoder_folder(folder, hparams)
  try:
    hf, model_type = bert.read_config(source)
    tokenizer = hf_folders.load_tokenizer(source, hf.get('vocab_size'))
  except (bert.BertImportError, hf_folders.FolderError) as e:
    raise CometError(str(e)) from None
  state = read_state(folder, given_as)
  body = {k[len(ENCODER_PREFIX):]: v for k, v in state.items()
          if k.startswith(ENCODER_PREFIX)}
  if not body:
    raise CometError(f'{folder}/checkpoints/model.ckpt has no '
                     f'{ENCODER_PREFIX}* tensors; is it a COMET checkpoint?')
  head = bert.Head('regression', 1, (), False)
  config = bert.model_config(hf, model_type, tokenizer, head)
  try:
    params = bert.params_from_weights(body, config, model_type, head, source)
  except bert.BertImportError as e:
    raise CometError(f'{folder}/checkpoints/model.ckpt: {e}') from None
  config = dataclasses.replace(config, pooler=False)
  rest = {k: v for k, v in state.items() if not k.startswith(ENCODER_PREFIX)}
  unified = kind == 'unified_metric'
  layer = hparams.get('sent_layer' if unified else 'layer', 'mix')
  weights, gamma = None, 1.0
  if layer == 'mix':
    count = config.num_encoder_layers + 1
    weights = np.concatenate([_take(
        rest, f'layerwise_attention.scalar_parameters.{i}', (1,))
                              for i in range(count)])
    gamma = float(_take(rest, 'layerwise_attention.gamma', (1,))[0])
    layer = None
  elif not (isinstance(layer, int) and
            0 <= layer <= config.num_encoder_layers):
    raise CometError(f'{folder}/hparams.yaml: layer {layer!r} (mix, or '
                     f'0..{config.num_encoder_layers})')
  features = FEATURES[kind]
  estimator = _estimator(rest, features * config.d_model, hparams)
  final = hparams.get('final_activation')
  return Comet(kind, _segments(kind, hparams, folder), config,
               params['body'], tokenizer, weights, transformation(hparams),
               gamma, layer,
               bool(hparams.get('layer_norm', True)) and layer is None,
               'cls' if unified else str(hparams.get('pool', 'avg')).lower(),
               estimator, str(hparams.get('activations', 'Tanh')).lower(),
               None if final is None else str(final).lower())


def _segments(kind: str, hparams: dict, folder: str) -> tuple[str, ...]:
  if MODELS[kind] is not None:
    return MODELS[kind]
  segments = list(hparams.get('input_segments', ['mt', 'src', 'ref']))
  if segments[:1] != ['mt'] or not set(segments[1:]) <= {'src', 'ref'} or (
      len(segments) < 2):
    raise CometError(f'{folder}/hparams.yaml: input_segments {segments} '
                     '(mt first, then src and/or ref)')
  return tuple(segments[1:])
