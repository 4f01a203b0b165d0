"""A Google Cloud Storage emulator on 127.0.0.1 for the tests (in memory).

`python3 tests/gcs_emulator.py BUCKET` serves gcp-storage-emulator (from
PyPI) on a free port with BUCKET created, and prints `port=N` once it
accepts requests. Clients reach it through the standard variables only
(`environment(port)`).

One fix to the emulator: a download answers with the object's generation
in `x-goog-generation` (and `x-goog-metageneration`), as GCS does. TensorStore
reads the generation of every object it downloads from that header and
rejects a response without it ("Malformed StorageGeneration"), which Orbax's
OCDBT checkpoints hit as soon as a manifest is read back.
"""
import os
import signal
import sys
import threading


def environment(port: int) -> dict[str, str]:
  """The variables that point gcsfs, Google's clients, TensorStore and
  etils.epath at the emulator; nothing else is needed."""
  url = f'http://127.0.0.1:{port}'
  return {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
          'EPATH_USE_TF': 'false'}


def _with_generation_headers(download):
  def handler(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    if response.status.value in (200, 206):
      obj = storage.get_file_obj(request.params['bucket_name'],
                                 request.params['object_id'])
      response['x-goog-generation'] = str(obj['generation'])
      response['x-goog-metageneration'] = str(obj['metageneration'])
  return handler


def serve(bucket: str) -> None:
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects
  original = objects.download
  objects.download = _with_generation_headers(original)  # Also for ?alt=media.
  for _, methods in server.HANDLERS:
    for method, handler in methods.items():
      if handler is original:
        methods[method] = objects.download
  emulator = server.Server('127.0.0.1', 0, in_memory=True,
                           default_bucket=bucket)
  emulator.start()
  print(f'port={emulator._api._httpd.server_address[1]}', flush=True)
  stopped = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stopped.set())
  stopped.wait()
  emulator.stop()


if __name__ == '__main__':
  sys.stdout.reconfigure(line_buffering=True)
  os.environ.pop('STORAGE_EMULATOR_HOST', None)
  serve(sys.argv[1])
