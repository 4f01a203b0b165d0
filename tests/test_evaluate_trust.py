"""`jaxformer evaluate` trusts a training workdir's own data files (the
user trained it here; the report names the files read), never an export's
(`export`, `import`, `average` may come from anyone: cli/workdir_data.py,
docs/security.md)."""
import json

import pytest

from jaxformer.cli import main as cli
from jaxformer.data import builtin


@pytest.mark.slow
def test_evaluate_reads_a_workdirs_own_tsv_but_not_an_exports(tmp_path,
                                                              capfd):
  for split, count, seed in (('train', 400, 1), ('dev', 16, 2),
                             ('test', 16, 3)):
    (tmp_path / f'{split}.tsv').write_text(''.join(
        f'{s}\t{t}\n' for s, t in builtin.generate(count, seed, split)))
  workdir = tmp_path / 'mine'
  assert cli.main([
      'train', '--config', 'configs/quickstart.py:runlocal', '--workdir',
      str(workdir), '--config.data.source=tsv',
      *(f'--config.data.tsv.{s}={tmp_path}/{s}.tsv'
        for s in ('train', 'dev', 'test')),
      '--config.train.num_steps=2', '--config.eval.every=0',
      '--config.eval.final_split=', '--config.eval.bleu_examples=0',
      '--config.checkpoint.every=2', '--config.train.peak_flops=1e9']) == 0
  capfd.readouterr()
  assert cli.main(['evaluate', '--workdir', str(workdir), '--split', 'test',
                   '--beam', '1']) == 0
  report = json.loads(capfd.readouterr().out)
  assert report['data'] == {'data.tsv.test': f'{tmp_path}/test.tsv'}
  exported = tmp_path / 'exported'
  assert cli.main(['export', '--workdir', str(workdir), '--out',
                   str(exported)]) == 0
  capfd.readouterr()
  assert cli.main(['evaluate', '--workdir', str(exported), '--split',
                   'test', '--beam', '1']) == 1
  assert 'data.tsv.test is not set' in capfd.readouterr().err
  # The user names the file: read, and not reported as the model's.
  assert cli.main(['evaluate', '--workdir', str(exported), '--split', 'test',
                   '--beam', '1',
                   f'--config.data.tsv.test={tmp_path}/test.tsv']) == 0
  assert 'data' not in json.loads(capfd.readouterr().out)
