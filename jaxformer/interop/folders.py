"""Writing a model folder whole: into a temporary sibling, renamed into place
once complete, so that a failed export leaves nothing that looks finished."""
import base64
import json
import os
import shutil
import tempfile
from typing import Callable

from jaxformer.checkpoints import exports
from jaxformer.storage import paths


def check_new(out: str) -> str:
  """`out` as an absolute local path that does not exist yet (else a
  ValueError naming the fix)."""
  if paths.is_remote(out):
    raise ValueError(f'--out {out}: exports to other formats are written to '
                     'a local folder; copy it to the bucket afterwards.')
  out = os.path.abspath(out)
  if os.path.exists(out):
    raise ValueError(f'--out {out} already exists; choose another --out, or '
                     'remove it first.')
  return out


def write_folder(out: str, fill: Callable[[str], None]) -> str:
  """Calls `fill(directory)` on a new empty local directory and renames it
  to `out`, which must not exist; on any error removes it. Returns `out`
  as an absolute path."""
  out = check_new(out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  partial = tempfile.mkdtemp(prefix=f'.{os.path.basename(out)}.partial-',
                             dir=os.path.dirname(out))
  try:
    fill(partial)
    paths.readable_as_umask_allows(partial)  # mkdtemp's is 0700.
    os.replace(partial, out)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  return out


def write_export(out: str, params, extra: dict,
                 keep_provenance: bool = False) -> None:
  """A jaxformer export of `params` and `extra` (exports.export_params)
  written to a sibling of `out` and renamed to `out` once complete; on
  any error nothing is left at either."""
  partial = f'{out}.partial-{os.getpid()}'
  try:
    exports.export_params(partial, params, extra, keep_provenance)
    os.rename(partial, out)
  finally:
    shutil.rmtree(partial, ignore_errors=True)


def write_import(out: str, params, run, tokenizers, source: str,
                 keep_provenance: bool = False) -> None:
  """The jaxformer export of an imported model (`write_export`): its
  parameters, the run config `run` (a ConfigDict), the tokenizers' bytes
  and the folder it came from, at step 0."""
  extra = {'config': json.loads(run.to_json_best_effort()),
           'tokenizers': [base64.b64encode(t.serialized_model_proto()).decode()
                          for t in tokenizers],
           'steps': [0], 'source': source}
  write_export(out, params, extra, keep_provenance)
