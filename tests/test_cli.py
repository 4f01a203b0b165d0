"""The commands a user runs after training, on the run of the runlocal quick
start that the modules share (conftest `quickstart_workdir`): translate,
evaluate, attention, curves, and their bad-input errors."""
import io
import json
import pathlib
import sys

import pytest
from PIL import Image

from jaxformer.cli import main as cli
from jaxformer.cli import model_commands
from trained_runs import NO_PEAK, copy, train


@pytest.fixture(scope='module')
def workdir(quickstart_workdir):
  return quickstart_workdir


@pytest.mark.slow
def test_train_reports_test_scores_and_how_to_translate(workdir):
  scores = json.load(open(f'{workdir}/test_scores.json'))
  assert set(scores) == {'bleu', 'chrf', 'exact_match'}


@pytest.mark.slow
def test_translate_keeps_order_and_empty_lines(workdir, monkeypatch, capfd):
  lines = ['he sold three old cups .', '', 'we bought nine red apples .']
  monkeypatch.setattr(sys, 'stdin', io.StringIO('\n'.join(lines) + '\n'))
  assert cli.main(['translate', '--workdir', workdir, '--beam', '2',
                   '--batch-size', '2']) == 0
  out = capfd.readouterr().out.split('\n')
  assert len(out) == 4 and out[1] == '' and out[3] == ''


@pytest.mark.slow
def test_translate_truncates_or_rejects_overlong_lines(workdir, tmp_path,
                                                       capfd):
  source = tmp_path / 'long.txt'
  source.write_text(' '.join(['seven hundred'] * 40) + '\n')
  assert cli.main(['translate', '--workdir', workdir, '--input',
                   str(source), '--beam', '1']) == 0
  assert 'truncated' in capfd.readouterr().err
  assert cli.main(['translate', '--workdir', workdir, '--input', str(source),
                   '--on-too-long', 'error']) == 1
  assert 'more than the model maximum' in capfd.readouterr().err


@pytest.mark.slow
def test_evaluate_prints_bleu_as_json_and_writes_hypotheses(workdir, capfd,
                                                           tmp_path):
  hypotheses = tmp_path / 'dev.txt'
  assert cli.main(['evaluate', '--workdir', workdir, '--split', 'dev',
                   '--beam', '1', '--hypotheses', str(hypotheses)]) == 0
  report = json.loads(capfd.readouterr().out)
  assert report['split'] == 'dev' and 0 <= report['bleu'] <= 100
  assert report['hypotheses'] == str(hypotheses)
  assert len(hypotheses.read_text().splitlines()) == 40
  assert cli.main(['evaluate', '--workdir', workdir, '--split', 'dev',
                   '--beam', '1']) == 0  # Writes nothing unless asked.
  assert 'hypotheses' not in json.loads(capfd.readouterr().out)


@pytest.mark.slow
def test_attention_and_curves_write_pictures(workdir, tmp_path):
  picture = tmp_path / 'attention.png'
  assert cli.main(['attention', '--workdir', workdir, '--src',
                   'she bought forty-two red apples .', '--head', '1',
                   '--out', str(picture)]) == 0
  width, height = Image.open(picture).size
  assert width >= 400 and height >= 300
  curves = tmp_path / 'curves.png'
  assert cli.main(['curves', '--workdir', workdir, '--out', str(curves)]) == 0
  assert Image.open(curves).size[0] > 0


@pytest.mark.slow
def test_commands_on_a_trained_model_take_overrides_that_keep_the_model(
    workdir, tmp_path, capfd):
  import argparse
  args = argparse.Namespace(workdir=workdir, checkpoint=None)
  model = model_commands.load_trained(args, ['--config.decode.beam_size=3',
                                             'decode.alpha=0.2'])
  assert (model.config.decode.beam_size, model.config.decode.alpha) == (3, 0.2)
  assert model.step == 60 and model.task.translates
  source = tmp_path / 'one.txt'
  source.write_text('he sold three old cups .\n')
  command = ['translate', '--workdir', workdir, '--input', str(source)]
  assert cli.main(command + ['--config.model.d_model=8']) == 1
  assert 'keeps the settings it was trained with' in capfd.readouterr().err
  assert cli.main(command + ['--config.decode.beam_sise=2']) == 1
  assert "Did you mean ['beam_size'" in capfd.readouterr().err
  assert cli.main(['curves', '--workdir', workdir, '--out', 'x.png',
                   '--config.decode.beam_size=2']) == 2


def test_a_workdir_without_checkpoints_is_a_clear_error(tmp_path, capfd):
  assert cli.main(['translate', '--workdir', str(tmp_path)]) == 1
  assert 'No checkpoints' in capfd.readouterr().err


@pytest.mark.parametrize('flags, message', [
    (['translate', '--batch-size', '0'], 'argument --batch-size: 0 is out of '
     'range; it must be >= 1'),
    (['translate', '--beam', '-1'], 'argument --beam: -1 is out of range'),
    (['translate', '--alpha', 'high'], "argument --alpha: 'high' is not a "
     'number'),
    (['predict', '--batch-size', '0'], 'argument --batch-size: 0'),
    (['generate', '--top-p', '0'], 'argument --top-p: 0 is out of range; it '
     'must be in (0, 1]'),
    (['generate', '--num', '0'], 'argument --num: 0'),
    (['evaluate', '--checkpoint', '-3'], 'argument --checkpoint: -3'),
    (['average', '--last', '0', '--out', 'x'], 'argument --last: 0'),
])
def test_a_flag_out_of_range_is_a_clear_error(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main([flags[0], '--workdir', 'unused'] + flags[1:])
  assert exit_.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize('command', ['translate', 'predict'])
def test_input_that_is_not_utf8_names_the_line_or_is_replaced(
    workdir, tmp_path, capfd, command):
  source = tmp_path / 'latin1.txt'
  source.write_bytes('he sold three old cups .\nwe bought caf\xe9 .\n'
                     .encode('latin-1'))
  assert cli.main([command, '--workdir', workdir, '--input',
                   str(source)]) == 1
  err = capfd.readouterr().err
  assert f'{source}:2: invalid UTF-8' in err and '--invalid-utf8=replace' in err
  if command == 'translate':
    assert cli.main([command, '--workdir', workdir, '--input', str(source),
                     '--invalid-utf8', 'replace', '--beam', '1']) == 0
    assert len(capfd.readouterr().out.splitlines()) == 2


@pytest.mark.slow
def test_binary_stdin_names_the_line(workdir, monkeypatch, capfd):
  binary = io.TextIOWrapper(io.BytesIO(b'one .\n\x00\x9c\xff\x01\n'))
  monkeypatch.setattr(sys, 'stdin', binary)
  assert cli.main(['translate', '--workdir', workdir, '--beam', '1']) == 1
  assert '<stdin>:2: invalid UTF-8' in capfd.readouterr().err


@pytest.mark.slow
def test_training_a_finished_run_again_says_there_is_nothing_to_train(
    workdir, tmp_path, capfd):
  assert train(copy(pathlib.Path(workdir), tmp_path),
               '--config.train.num_steps=60', '--config.eval.final_split=',
               NO_PEAK) == 0
  assert 'already at train.num_steps=60: nothing to train' in (
      capfd.readouterr().out)


@pytest.mark.slow
def test_a_pack_run_resumes_on_another_mesh_and_accumulation(
    workdir, tmp_path, capfd):
  # 'pack' batches do not depend on the layout: no data-order refusal.
  assert train(copy(pathlib.Path(workdir), tmp_path),
               '--config.train.num_steps=60', '--config.eval.final_split=',
               NO_PEAK, '--config.mesh.data=2', '--config.mesh.fsdp=-1',
               '--config.train.grad_accum_steps=2') == 0
  out, err = capfd.readouterr()
  assert 'nothing to train' in out and 'order' not in err
