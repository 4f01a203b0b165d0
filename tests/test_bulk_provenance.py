"""A bulk output proves what made it (jaxformer/inference/provenance.py,
chunks.py): a resumed `generate --output` decodes again a chunk whose input
lines were edited, refuses parts of another model or another language,
decodes again a tampered chunk, and the join refuses a chunk that is not
what it records; --input equal to --output is refused.

Runs in this process on test_generate.py's random language model (an
export); a run is stopped after some chunks by SIGTERM to itself, as a
preempted run is."""
import dataclasses
import os
import shutil
import signal

import jax
import pytest

from test_bulk_generate import generate_command, run

from jaxformer.checkpoints import exports
from jaxformer.data import builtin
from jaxformer.inference import bulk, bulk_decoders, chunks, provenance
from jaxformer.inference.chunks import Parts, Plan, chunk_name

LINES = 96  # 16-line chunks (--batch-size 8, --chunk-batches 2): 6 of them.


@pytest.fixture
def prompts(tmp_path):
  sentences = [source for source, _ in builtin.generate(LINES, 13, 'test')]
  path = tmp_path / 'prompts.txt'
  path.write_text(''.join(' '.join(s.split()[:1 + i % 6]) + '\n'
                          for i, s in enumerate(sentences)))
  return path


def stop_after_commits(monkeypatch, count: int) -> None:
  """The runs below send themselves SIGTERM once `count` chunks are
  committed (the command commits what it finished and exits 0)."""
  commit, done = Parts.commit, []

  def committing(self, chunk, batches, finished):
    whole = commit(self, chunk, batches, finished)
    done.append(whole)
    if sum(done) == count:
      os.kill(os.getpid(), signal.SIGTERM)
    return whole
  monkeypatch.setattr(Parts, 'commit', committing)


def stopped_run(capfd, monkeypatch, command, count=3) -> None:
  with monkeypatch.context() as patch:
    stop_after_commits(patch, count)
    status, _, errors = run(capfd, *command)
  assert status == 0 and 'generate: stopped (SIGTERM)' in errors, errors


@pytest.mark.slow
def test_an_edited_input_line_is_decoded_again(lm_export, prompts, tmp_path,
                                               capfd, monkeypatch):
  out = tmp_path / 'out.jsonl'
  stopped_run(capfd, monkeypatch, generate_command(lm_export[0], prompts, out))
  lines = prompts.read_text().split('\n')
  lines[1] = lines[1][::-1]  # Another line of the same length.
  prompts.write_text('\n'.join(lines))
  status, _, errors = run(capfd, *generate_command(lm_export[0], prompts, out))
  assert status == 0, errors
  assert (f'{chunk_name(0)} in {out}.parts is decoded again: its input '
          'lines changed.') in errors
  reference = tmp_path / 'reference.jsonl'
  assert run(capfd, *generate_command(lm_export[0], prompts, reference))[0] == 0
  assert out.read_bytes() == reference.read_bytes()


def other_model(lm_export, path) -> None:
  """An export of the same shapes and tokenizer with other parameters, at
  `path` (where the first one was)."""
  directory, _, _, params = lm_export
  extra, _ = exports.restore_export(directory)
  shutil.rmtree(path)
  exports.export_params(str(path), jax.tree.map(lambda p: p * -1.5, params),
                        extra)


@pytest.mark.slow
def test_a_model_swapped_in_the_same_place_is_refused(
    lm_export, prompts, tmp_path, capfd, monkeypatch):
  model = tmp_path / 'model'
  shutil.copytree(lm_export[0], model)
  out = tmp_path / 'out.jsonl'
  command = generate_command(str(model), prompts, out)
  stopped_run(capfd, monkeypatch, command)
  other_model(lm_export, model)
  kept = sorted(os.listdir(f'{out}.parts'))
  status, _, errors = run(capfd, *command)
  assert status == 1 and not out.exists()
  assert errors.strip().splitlines()[-1].startswith(
      f'jaxformer generate: error: {out}.parts holds the parts of another run (model_params: ')
  assert sorted(os.listdir(f'{out}.parts')) == kept


def load(directory):
  import argparse
  from jaxformer.cli import model_commands
  return model_commands.load_trained(argparse.Namespace(
      workdir=directory, checkpoint=None, command='generate'), [])


def generation(model) -> bulk_decoders.Generation:
  return bulk_decoders.Generation(model, bulk_decoders.GenerateSettings(
      batch_size=8, chunk_batches=2, max_new_tokens=4, max_len=0,
      temperature=1.0, top_k=0, top_p=1.0, seed=3))


class StopAfter(bulk.Stop):
  """Stops once `count` chunks are committed."""

  def __init__(self, parts_directory: str, count: int):
    super().__init__()
    self.directory, self.count = parts_directory, count

  def poll(self, every: float = 1.0) -> bool:
    if os.path.isdir(self.directory) and sum(
        n.endswith('.txt') for n in os.listdir(self.directory)) >= self.count:
      self.request('test')
    return super().poll(every)


@pytest.mark.slow
def test_another_target_language_is_refused(lm_export, prompts, tmp_path):
  """The language a many-to-many model is bound to is in the fingerprint:
  parts made for one are not joined with another's."""
  model = load(lm_export[0])
  out = str(tmp_path / 'out.jsonl')
  german, french = (dataclasses.replace(
      model, config=model.config.copy_and_resolve_references())
                     for _ in range(2))
  german.config.data.target_lang, french.config.data.target_lang = 'de', 'fr'
  identity = provenance.model_identity(german)
  assert identity['target_lang'] == 'de'
  status, _ = bulk.decode_corpus(generation(german), [str(prompts)], out,
                                 identity, StopAfter(out + '.parts', 2))
  assert status == 'stopped'
  with pytest.raises(ValueError, match=r"another run \(target_lang: 'de' "
                     r"then, 'fr' now\)"):
    bulk.decode_corpus(generation(french), [str(prompts)], out,
                       provenance.model_identity(french), bulk.Stop())


@pytest.mark.slow
def test_a_tampered_chunk_is_decoded_again(lm_export, prompts, tmp_path,
                                           capfd, monkeypatch):
  out = tmp_path / 'out.jsonl'
  command = generate_command(lm_export[0], prompts, out)
  stopped_run(capfd, monkeypatch, command, count=3)
  parts = tmp_path / 'out.jsonl.parts'
  first, second = parts / chunk_name(0), parts / chunk_name(1)
  first.write_bytes(b'\n'.join(first.read_bytes().split(b'\n')[:-4]) + b'\n')
  second.write_bytes(second.read_bytes() + b'{"stray": 1}\n')
  status, _, errors = run(capfd, *command)
  assert status == 0, errors
  assert (f'{chunk_name(0)} in {parts} is decoded again: its lines are not '
          'those it records (13 lines, 16 recorded).') in errors
  assert f'{chunk_name(1)} in {parts} is decoded again' in errors
  reference = tmp_path / 'reference.jsonl'
  assert run(capfd, *generate_command(lm_export[0], prompts, reference))[0] == 0
  assert out.read_bytes() == reference.read_bytes()


def test_the_join_refuses_a_chunk_that_is_not_what_it_records(tmp_path):
  lines = [f'line {i}' for i in range(20)]
  plan = Plan(20, 4, 2)
  count, digests = provenance.chunk_digests(lines, plan.chunk_lines)
  assert count == 20 and len(digests) == plan.chunks == 3
  out = str(tmp_path / 'out.txt')
  parts = Parts(out, plan, {'seed': 1}, digests)
  for chunk in range(plan.chunks):
    size = len(plan.lines_of(chunk))
    batches = [list(range(i, min(i + 4, size))) for i in range(0, size, 4)]
    assert parts.commit(chunk, batches, {b: [f'out {chunk}.{i}' for i in batch]
                                         for b, batch in enumerate(batches)})
  middle = tmp_path / 'out.txt.parts' / chunk_name(1)
  middle.write_bytes(middle.read_bytes().replace(b'out 1.3\n', b''))
  with pytest.raises(ValueError, match=rf'{chunk_name(1)} cannot be joined '
                     r'into .*out.txt: its lines are not those it records '
                     r'\(7 lines, 8 recorded\); run the same command again'):
    parts.assemble()
  assert not os.path.exists(out) and middle.exists()
  # A chunk of other input lines, or of another run, is refused too.
  assert Parts(out, plan, {'seed': 1}, digests[::-1]).mismatch(0) == (
      'its input lines changed')
  assert Parts(out, plan, {'seed': 2}, digests).mismatch(0) == (
      "another run made it (seed: 1 then, 2 now)")
  assert chunks.read_chunk_file(
      (tmp_path / 'out.txt.parts' / chunk_name(2)).read_bytes())[1] == (
          b'out 2.0\nout 2.1\nout 2.2\nout 2.3\n')


@pytest.mark.slow
def test_input_equal_to_output_is_refused(lm_export, prompts, capfd):
  before = prompts.read_bytes()
  status, _, errors = run(capfd, *generate_command(lm_export[0], prompts,
                                                   prompts))
  assert status == 1
  assert f'--output {prompts} is also an --input file' in errors
  assert prompts.read_bytes() == before
  assert sorted(os.listdir(prompts.parent)) == ['prompts.txt']


@pytest.mark.slow
def test_chunk_files_are_synced_and_outputs_readable_as_the_umask_allows(
    lm_export, prompts, tmp_path, capfd, monkeypatch):
  synced = []
  fsync = os.fsync
  monkeypatch.setattr(os, 'fsync', lambda fd: (synced.append(fd), fsync(fd)))
  out = tmp_path / 'out.jsonl'
  previous = os.umask(0o022)
  try:
    assert run(capfd, *generate_command(lm_export[0], prompts, out))[0] == 0
  finally:
    os.umask(previous)
  assert len(synced) >= 6 + 1  # Each chunk, then the output.
  assert out.stat().st_mode & 0o777 == 0o644
