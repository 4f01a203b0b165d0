"""A Google Cloud Storage emulator on 127.0.0.1 for the tests (in memory).

`python3 tests/gcs_emulator.py BUCKET` serves gcp-storage-emulator (from
PyPI) on a free port with BUCKET created, and prints `port=N` once it
accepts requests. Clients reach it through the standard variables only
(`environment(port)`).

Two additions for the tests and benchmarks, outside the GCS API's paths:
`GET /_emulator/stats` answers {"requests": N, "bytes_received": B}, what
it served since it started (the stats requests not counted), so a test can
measure how many requests (and upload bytes) a client makes; `POST
/_emulator/reject_writes?containing=TEXT` makes every later upload, copy
or delete whose URL (decoded) contains TEXT fail with 403 Forbidden, as a
bucket that lost its write permission does (`stats` and `reject_writes`
below).

Two fixes to the emulator: an upload, delete or patch with
`ifGenerationMatch` is refused (412) unless the object's generation is the
one named (0: no object), as GCS does (jaxformer/storage/locks.py's lock
objects rely on it); and a download answers with the object's generation
in `x-goog-generation` (and `x-goog-metageneration`), as GCS does. TensorStore
reads the generation of every object it downloads from that header and
rejects a response without it ("Malformed StorageGeneration"), which Orbax's
OCDBT checkpoints hit as soon as a manifest is read back.
"""
import http
import json
import os
import signal
import sys
import threading
import urllib.parse
import urllib.request

_CONTROL = '/_emulator/'


def environment(port: int) -> dict[str, str]:
  """The variables that point gcsfs, Google's clients and TensorStore at
  the emulator; nothing else is needed (jaxformer.storage.paths sends epath's
  gs:// through gcsfs)."""
  url = f'http://127.0.0.1:{port}'
  return {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url}


def stats(port: int) -> dict[str, int]:
  """{'requests': N, 'bytes_received': B} the emulator at `port` served."""
  url = f'http://127.0.0.1:{port}{_CONTROL}stats'
  with urllib.request.urlopen(url, timeout=30) as response:
    return json.loads(response.read())


def reject_writes(port: int, containing: str = '') -> None:
  """From now on, the emulator at `port` refuses every write (403) whose
  URL contains `containing` (e.g. an object's folder)."""
  query = urllib.parse.urlencode(dict(containing=containing))
  request = urllib.request.Request(
      f'http://127.0.0.1:{port}{_CONTROL}reject_writes?{query}', method='POST')
  urllib.request.urlopen(request, timeout=30).close()


class _Served:
  """What the emulator served, and whether it still accepts writes."""
  lock = threading.Lock()
  requests = 0
  bytes_received = 0
  rejected = None  # text in the URLs of the writes to reject


def _answer(handler, status: int, body: bytes) -> None:
  handler.send_response(status)
  handler.send_header('Content-Type', 'application/json')
  handler.send_header('Content-Length', str(len(body)))
  handler.end_headers()
  handler.wfile.write(body)


def _counted(method: str, serve_request):
  """`serve_request` (a RequestHandler.do_METHOD), counted, and refused
  when writes are rejected; the control paths answered here."""
  def handler(self):
    if self.path.startswith(_CONTROL):
      control = urllib.parse.urlsplit(self.path)
      with _Served.lock:
        if control.path == f'{_CONTROL}reject_writes':
          _Served.rejected = urllib.parse.parse_qs(control.query).get(
              'containing', [''])[0]
        body = json.dumps(dict(requests=_Served.requests,
                               bytes_received=_Served.bytes_received))
      return _answer(self, 200, body.encode())
    with _Served.lock:
      _Served.requests += 1
      _Served.bytes_received += int(self.headers.get('Content-Length') or 0)
      refused = (method != 'GET' and _Served.rejected is not None and
                 _Served.rejected in urllib.parse.unquote(self.path))
    if refused:
      self.rfile.read(int(self.headers.get('Content-Length') or 0))
      return _answer(self, 403, json.dumps({'error': {
          'code': 403, 'message': 'writes are rejected (emulator)'}}).encode())
    serve_request(self)
  return handler


def _with_generation_headers(download):
  def handler(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    if response.status.value in (200, 206):
      obj = storage.get_file_obj(request.params['bucket_name'],
                                 request.params['object_id'])
      response['x-goog-generation'] = str(obj['generation'])
      response['x-goog-metageneration'] = str(obj['metageneration'])
  return handler


_PRECONDITIONS = threading.Lock()  # A check and its write, at once.


def _object_named(request) -> str | None:
  """The object an upload, delete or patch request is about."""
  if 'name' in request.query:
    return request.query['name'][0]
  if 'object_id' in request.params:
    return request.params['object_id']
  data = request.data if isinstance(request.data, dict) else {}
  return (data.get('meta') or {}).get('name')


def _with_generation_precondition(serve_request):
  """`serve_request` (an upload, delete or patch), refused with 412 when
  its `ifGenerationMatch` is not the object's generation (0: absent), as
  GCS does, atomically with the request."""
  def handler(request, response, storage, *args, **kwargs):
    wanted = request.query.get('ifGenerationMatch')
    if not wanted:
      return serve_request(request, response, storage, *args, **kwargs)
    from gcp_storage_emulator.exceptions import NotFound
    with _PRECONDITIONS:
      try:
        generation = str(storage.get_file_obj(
            request.params['bucket_name'],
            _object_named(request))['generation'])
      except NotFound:
        generation = '0'
      if generation != wanted[0]:
        response.status = http.HTTPStatus.PRECONDITION_FAILED
        return None
      return serve_request(request, response, storage, *args, **kwargs)
  return handler


def serve(bucket: str) -> None:
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects
  original = objects.download
  objects.download = _with_generation_headers(original)  # Also for ?alt=media.
  conditional = {objects.insert, objects.delete, objects.patch}
  for _, methods in server.HANDLERS:
    for method, handler in methods.items():
      if handler is original:
        methods[method] = objects.download
      elif handler in conditional:
        methods[method] = _with_generation_precondition(handler)
  for method in ('GET', 'POST', 'PUT', 'PATCH', 'DELETE'):
    name = f'do_{method}'
    setattr(server.RequestHandler, name,
            _counted(method, getattr(server.RequestHandler, name)))
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
