"""The tokenizer of a Hugging Face Llama-family folder (llama, qwen2,
mistral) as a jaxformer tokenizer (data/hf_tokenizer.py), for `jaxformer
import`; the folder's weights are read by safetensor_files.py.

The tokenizer is the one `transformers.AutoTokenizer` builds from the
folder (tokenizer.json, or tokenizer.model converted as Hugging Face
converts it; tokenizer_config.json and special_tokens_map.json for
BOS/EOS/pad, added_tokens and add_bos_token/add_eos_token), so that it
tokenises as Hugging Face does by construction; only the `tokenizers`
library is needed to use it afterwards. The ids that end generation come
from generation_config.json (eos_token_id, one or a list) as `generate`
reads them.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from jaxformer.data import hf_tokenizer
from jaxformer.data import sources
from jaxformer.data import vocab_tokenizer
from jaxformer.interop import config_bounds
from jaxformer.storage.errors import DataError, InteropError

# The files AutoTokenizer builds a tokenizer from: tokenizers' JSON, and
# the slow forms (SentencePiece: Llama, XLM-R; WordPiece: BERT;
# byte-level BPE: RoBERTa).
TOKENIZER_SOURCES = ('tokenizer.json', 'tokenizer.model',
                     'sentencepiece.bpe.model', 'vocab.txt', 'vocab.json')
# Small files of the folder kept with the tokenizer, for exports.
KEPT_FILES = ('tokenizer_config.json', 'special_tokens_map.json',
              'chat_template.jinja', 'chat_template.json')


class FolderError(InteropError):
  """The folder cannot be imported; the message names the file or key."""


def read_json(folder: str, name: str, required: bool = True) -> dict:
  """The JSON object of `folder/name` ({} if absent and not required)."""
  path = os.path.join(folder, name)
  if not os.path.isfile(path):
    if required:
      raise FolderError(f'{folder} has no {name}; is it a Hugging Face model '
                        'folder?')
    return {}
  try:
    data = vocab_tokenizer.read_json(path)
  except DataError as e:
    raise FolderError(str(e)) from None
  if not isinstance(data, dict):
    raise FolderError(f'{path}: not a JSON object')
  return data


def model_type(folder: str):
  """The model_type of `folder`'s config.json (None if it has none)."""
  if not os.path.isdir(folder):
    raise FolderError(f'--from {folder} is not a folder')
  if not os.path.isfile(os.path.join(folder, 'config.json')):
    raise FolderError(f'{folder} has no config.json; is it a Hugging Face '
                      'model folder? (download one with `huggingface-cli '
                      'download REPO --local-dir DIR`)')
  return read_json(folder, 'config.json').get('model_type')


def checked_config(folder: str, model_types: Sequence[str], refusals,
                   error: type[Exception]) -> tuple[dict, str]:
  """(config.json, its model_type) of a folder of one of `model_types`;
  `error` names a model_type not among them, a link out of the folder or
  a size that does not fit the weights (config_bounds.py), or what
  `refusals(config, model_type)` (a list of reasons) says jaxformer does
  not support."""
  config_bounds.check_links(folder, error)
  hf = read_json(folder, 'config.json')
  kind = hf.get('model_type')
  if kind not in model_types:
    raise error(f'{folder}/config.json: model_type is {kind!r}, not one '
                f'of {tuple(model_types)}')
  config_bounds.check_sizes(folder, hf, error)  # Before anything is built.
  reasons = refusals(hf, kind)
  if reasons:
    raise error(f'{folder}/config.json asks what jaxformer does not '
                'support: ' + '; '.join(reasons))
  return hf, kind


def _ids(value, what: str) -> list[int]:
  """An id or a list of ids (generation_config's eos_token_id) as a list."""
  ids = value if isinstance(value, list) else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
             for i in ids):
    raise FolderError(f'{what} is {value!r}, not an id or a list of ids')
  return ids


def generation_ids(folder: str, key: str) -> list[int] | None:
  """The ids `key` (eos_token_id, pad_token_id) of generation_config.json,
  else of config.json, as a list; None if neither has them."""
  for name in ('generation_config.json', 'config.json'):
    value = read_json(folder, name, required=False).get(key)
    if value is not None:
      return _ids(value, f'{os.path.join(folder, name)}: {key}')
  return None


def auto_tokenizer(folder: str, source: str):
  """`AutoTokenizer.from_pretrained(folder)`, offline; a FolderError naming
  `source` (the tokenizer file) when it cannot be read."""
  try:
    from transformers import AutoTokenizer
  except ImportError:
    raise FolderError(f'reading the tokenizer of {folder} needs transformers: '
                      f'{hf_tokenizer.INSTALL}') from None
  try:
    return AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                         trust_remote_code=False)
  except Exception as e:  # noqa: BLE001 - transformers raises many kinds.
    first = (str(e).strip().splitlines() or [''])[0]
    raise FolderError(f'{os.path.join(folder, source)} cannot be read as a '
                      f'Hugging Face tokenizer ({type(e).__name__}: {first}); '
                      'copy the model\'s tokenizer files again') from None


def _kept_files(folder: str) -> dict[str, str]:
  files = {}
  for name in KEPT_FILES:
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      files[name] = sources.read_bytes(path).decode('utf-8', 'replace')
  return files


def _clean_up(hf) -> bool:
  """Whether AutoTokenizer's decode cleans up spaces: where asked, but
  never for a BPE model unless forced (TokenizersBackend._decode)."""
  forced = getattr(
      hf, 'clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_'
      'output', False)
  is_bpe = type(hf.backend_tokenizer.model).__name__ == 'BPE'
  return bool(hf.clean_up_tokenization_spaces) and (forced or not is_bpe)


def load_tokenizer(folder: str, vocab_size: int | None = None, hf=None
                   ) -> hf_tokenizer.HFTokenizer:
  """The tokenizer of `folder` (see module doc), or of `hf`, the
  AutoTokenizer already read from it. Its ids must fit the model's
  `vocab_size` (by default config.json's, where present)."""
  source = next((name for name in TOKENIZER_SOURCES
                 if os.path.isfile(os.path.join(folder, name))), None)
  if source is None:
    raise FolderError(f'{folder} has no tokenizer file (one of '
                      f'{", ".join(TOKENIZER_SOURCES)}); copy the model\'s '
                      'tokenizer files into it')
  path = os.path.join(folder, source)
  if hf is None:
    hf = auto_tokenizer(folder, source)
  # An encoder's (BERT's) EOS is its separator, [SEP].
  end = hf.eos_token_id if hf.eos_token_id is not None else getattr(
      hf, 'sep_token_id', None)
  eos_ids = generation_ids(folder, 'eos_token_id') or (
      [] if end is None else [end])
  if not eos_ids:
    raise FolderError(f'{folder}: no EOS token (neither the tokenizer files '
                      'nor generation_config.json name one)')
  pad_id = hf.pad_token_id
  if pad_id is None:  # What `generate` pads with.
    pad_id = (generation_ids(folder, 'pad_token_id') or eos_ids)[0]
  try:
    tokenizer = hf_tokenizer.HFTokenizer(
        hf.backend_tokenizer.to_str(), eos_ids=eos_ids, eos_id=hf.eos_token_id,
        pad_id=pad_id, bos_id=hf.bos_token_id, unk_id=hf.unk_token_id,
        clean_up=_clean_up(hf),
        split_special_tokens=bool(getattr(hf, 'split_special_tokens', False)),
        files=_kept_files(folder), name=path)
  except DataError as e:
    raise FolderError(str(e)) from None
  if vocab_size is None:
    vocab_size = read_json(folder, 'config.json', required=False).get(
        'vocab_size')
  if vocab_size is not None and tokenizer.vocab_size > vocab_size:
    raise FolderError(f'{path} has {tokenizer.vocab_size} ids but '
                      f'config.json says vocab_size={vocab_size}; the '
                      'tokenizer files do not belong to this model')
  return tokenizer
