"""The kinds of error jaxformer raises for input it cannot use, each named
for what failed. A command reports any of them in one line (its message
names the thing and the fix) and exits non-zero (`cli/main.py`).

Each kind is also the built-in error it used to be (a `ValueError`, an
`OSError`, a `RuntimeError`), so callers that catch those still do.
Here, at the bottom layer, so that every layer can raise its own kind.
"""


class JaxformerError(Exception):
  """Input jaxformer cannot use; the message says what and how to fix it."""


class ConfigError(JaxformerError, ValueError):
  """A config file, override or saved config that cannot be used as
  given."""


class DataError(JaxformerError, ValueError):
  """The configured data cannot be read."""


class CheckpointError(JaxformerError, RuntimeError):
  """A checkpoint cannot be written or restored (the step, and the storage
  error behind it)."""


class InteropError(JaxformerError, ValueError):
  """Another framework's model (a folder to import, a model to export) that
  jaxformer cannot convert."""


class StorageError(JaxformerError, OSError):
  """A file or directory cannot be read or written where it is (local or
  gs://); one line saying which and why."""
