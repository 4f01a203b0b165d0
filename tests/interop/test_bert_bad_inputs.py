"""What `jaxformer import` refuses of a BERT-family folder: each bad input
is one line naming the head, key or file (and what is supported), exit 1,
and nothing at --out; and pytorch_model.bin weights, which it takes."""
import shutil

import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')
pytest.importorskip('safetensors')
pytest.importorskip('tokenizers')

import bert_folders  # noqa: E402
from test_llama_bad_inputs import (config, edit_json,  # noqa: E402
                                   fails_with_one_line, truncate)

NAME = 'bert-cls2-vocab-txt'


@pytest.fixture(scope='module')
def good(tmp_path_factory):
  root = tmp_path_factory.mktemp('good')
  bert_folders.write_folder(str(root / NAME), NAME)
  return root


DAMAGES = {
    'token-classification': (
        config(architectures=['BertForTokenClassification']),
        ('BertForTokenClassification', 'TokenClassification',
         'ForSequenceClassification')),
    'question-answering': (
        config(architectures=['BertForQuestionAnswering']),
        ('BertForQuestionAnswering', 'QuestionAnswering')),
    'multi-label': (config(problem_type='multi_label_classification'),
                    ("'multi_label_classification'",)),
    'activation': (config(hidden_act='silu'), ("hidden_act='silu'", 'gelu')),
    'relative-positions': (config(position_embedding_type='relative_key'),
                           ("position_embedding_type='relative_key'",)),
    'decoder': (config(is_decoder=True), ('is_decoder=true',)),
    'shape': (config(intermediate_size=50),
              ('intermediate.dense.weight has shape', '(50, 32)')),
    'other-pad-id': (config(pad_token_id=3),
                     ('pad_token_id is 3', 'do not belong')),
    'no-vocabulary': (lambda f: (f / 'vocab.txt').unlink(),
                      ('vocab.txt', 'tokenizer.json')),
    'truncated-weights': (lambda f: truncate(f / 'model.safetensors'),
                          ('model.safetensors', 'truncated')),
    'no-weights': (lambda f: (f / 'model.safetensors').unlink(),
                   ('model.safetensors',)),
    'labels-without-head': (lambda f: edit_json(
        f / 'config.json', lambda c: c.update(architectures=['BertModel'])),
        ('unexpected tensors', 'classifier')),
}


@pytest.mark.parametrize('name', DAMAGES)
def test_bad_folders_fail_with_one_line_leaving_nothing(name, good, tmp_path,
                                                        capsys):
  damage, words = DAMAGES[name]
  folder = tmp_path / 'folder'
  shutil.copytree(good / NAME, folder)
  damage(folder)
  fails_with_one_line(['import', '--from', str(folder)], tmp_path, capsys,
                      *words)


def test_num_labels_is_for_base_models(good, tmp_path, capsys):
  fails_with_one_line(['import', '--from', str(good / NAME), '--num-labels',
                       '3'], tmp_path, capsys, '--num-labels 3',
                      'its own classifier head')


def test_pytorch_model_bin_imports_as_the_safetensors_do(good, tmp_path):
  """A folder with pytorch_model.bin in place of model.safetensors (read
  with torch's weights_only loader) gives the same parameters."""
  import jax
  import numpy as np
  import torch
  from safetensors.torch import load_file
  from jaxformer.checkpoints import trained
  from jaxformer.cli import main as cli
  folder = tmp_path / 'bin'
  shutil.copytree(good / NAME, folder)
  torch.save(load_file(str(folder / 'model.safetensors')),
             str(folder / 'pytorch_model.bin'))
  (folder / 'model.safetensors').unlink()
  for source, out in ((good / NAME, 'a'), (folder, 'b')):
    assert cli.main(['import', '--from', str(source), '--out',
                     str(tmp_path / out)]) == 0
  jax.tree.map(np.testing.assert_array_equal,
               trained.load(str(tmp_path / 'a')).params,
               trained.load(str(tmp_path / 'b')).params)
