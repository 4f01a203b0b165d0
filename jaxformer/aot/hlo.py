"""Reading compiled HLO text: the size of shapes and the collectives a
program runs (counts and bytes per device)."""
import math
import re


COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
               'collective-permute')
_DTYPE_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 's16': 2,
                'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4,
                's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16}
_ARRAY = re.compile(r'\b([a-z]+[0-9]+[a-z0-9]*|pred)\[([0-9,]*)\]')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape ('bf16[8,128]{1,0}', a tuple of them, ...)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype.startswith('f8'):
      size = 1
    else:
      size = _DTYPE_BYTES.get(dtype, 0)
    total += size * math.prod(int(d) for d in dims.split(',') if d)
  return total


def _split_shape(rest: str) -> tuple[str, str]:
  """'SHAPE opcode(...)...' -> (SHAPE, 'opcode(...)...'); tuple shapes are
  parenthesised and may hold spaces."""
  if rest.startswith('('):
    depth = 0
    for i, char in enumerate(rest):
      depth += {'(': 1, ')': -1}.get(char, 0)
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, tail = rest.partition(' ')
  return shape, tail


def _operands(call: str) -> list[str]:
  """Operand names of 'opcode(%a, %b), attrs...'."""
  inner, depth = [], 0
  for char in call[call.index('(') + 1:]:
    if char == '(':
      depth += 1
    elif char == ')':
      if depth == 0:
        break
      depth -= 1
    inner.append(char)
  return re.findall(r'%([\w.\-]+)', ''.join(inner))


def collective_stats(hlo_text: str) -> dict[str, dict[str, float]]:
  """Per collective: 'count', how many times it runs per call of the
  program (an instruction in a loop body once per iteration: see
  `runs_per_computation`), 'bytes', the operand bytes (per device) those
  runs move, and 'instructions', how many there are in the compiled
  module's text; an asynchronous pair (`all-gather-start` / `-done`)
  counts once.

  'windowed' counts the runs of all-gathers and reduce-scatters that XLA's
  TPU backend fused with their matmul into a windowed einsum: a loop of
  collective-permutes around a ring, each step overlapped with a partial
  matmul. FSDP's gradient reduce-scatters mostly take this form, so they
  show up as collective-permutes, not as reduce-scatter instructions.
  """
  computations, _ = _module(hlo_text)
  runs, _ = runs_per_computation(hlo_text)
  stats = {op: {'count': 0, 'bytes': 0.0, 'windowed': 0, 'instructions': 0}
           for op in COLLECTIVES}
  shapes = {name: shape for body in computations.values()
            for name, shape, _ in body}
  for computation, body in computations.items():
    times = runs[computation]
    for _, _, call in body:
      opcode = call.split('(', 1)[0]
      base = opcode.removesuffix('-start')
      if base in COLLECTIVES and '(' in call:
        stats[base]['instructions'] += 1
        stats[base]['count'] += times
        stats[base]['bytes'] += times * sum(
            shape_bytes(shapes.get(o, '')) for o in _operands(call))
      elif opcode == 'while':
        loop = re.search(r'body=%?([\w.\-]+)', call)
        kind = re.search(r'windowed_dot_general_body_(ag|rs)',
                         loop.group(1) if loop else '')
        if kind:
          op = 'all-gather' if kind.group(1) == 'ag' else 'reduce-scatter'
          stats[op]['windowed'] += times
  return stats


def cross_slice_stats(hlo_text: str) -> dict[str, dict[str, float]]:
  """The collectives a program runs across slices, per step: by libtpu's
  transfer type ('all-reduce', ...), 'count' (runs, as in
  `collective_stats`), 'bytes' (per device) sent and 'data_bytes', the
  values among them (`sent_data`).

  Compiled for several slices, a module holds one slice's devices: its
  replica groups stay within the slice, and what crosses the data-centre
  network is lowered to host-transfer sends (and their recvs) to the
  Megascale runtime, tagged `_xla_megascale_transfer_type`; each send
  counts once.
  """
  computations, instructions = _module(hlo_text)
  runs, _ = runs_per_computation(hlo_text)
  stats: dict[str, dict[str, float]] = {}
  for computation, body in computations.items():
    for _, _, call in body:
      kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', call)
      if not call.startswith('send(') or not kind:
        continue
      entry = stats.setdefault(kind.group(1).lower().replace('_', '-'),
                               {'count': 0, 'bytes': 0.0, 'data_bytes': 0.0})
      operand = _operands(call)[0]
      entry['count'] += runs[computation]
      entry['bytes'] += runs[computation] * shape_bytes(
          instructions.get(operand, ('',))[0])
      entry['data_bytes'] += runs[computation] * sent_data(operand,
                                                           instructions)
  return stats


def sent_data(name: str, instructions) -> float:
  """Bytes of the values in buffer `name` that a Megascale send carries.
  A TPU buffer is laid out in tiles (8 x 128 for float32: its minor
  dimension padded to a multiple of 128, the next to a multiple of 8), and
  libtpu sends a buffer whole, its padding zeroed by a `ZeroCrop` custom
  call: the values are that call's operand, found through bitcasts and the
  outputs of the (combined) all-reduces within the slice. The buffer's own
  bytes where there is no `ZeroCrop` (nothing padded)."""
  own = shape_bytes(instructions.get(name, ('',))[0])
  for _ in range(8):
    if name not in instructions:
      break
    shape, call, _ = instructions[name]
    opcode = call.split('(', 1)[0]
    operands = _operands(call)
    if opcode == 'custom-call' and 'custom_call_target="ZeroCrop"' in call:
      return shape_bytes(instructions.get(operands[0], ('',))[0])
    if opcode == 'get-tuple-element':
      source = instructions.get(operands[0], ('', '', ''))[1]
      index = int(re.search(r'index=(\d+)', call).group(1))
      if not source.startswith('all-reduce('):
        break
      name = _operands(source)[index]
    elif opcode in ('bitcast', 'copy'):
      name = operands[0]
    else:
      break
  return own


def custom_calls(hlo_text: str) -> dict[str, int]:
  """Count of each custom-call target in a compiled HLO module's text: the
  kernels XLA did not write itself, e.g. `tpu_custom_call` for a Pallas
  (Mosaic) kernel such as splash attention, or cuDNN's fused attention."""
  counts: dict[str, int] = {}
  for target in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
    counts[target] = counts.get(target, 0) + 1
  return counts


# ------------------------------------------------------------------ loops

_HEADER = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$')


def _module(hlo_text: str):
  """(computations: name -> [(instruction, shape, call)] in text order,
  instructions: name -> (shape, call, computation))."""
  computations, instructions, current = {}, {}, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(' '):
      current = header.group(1)
      computations[current] = []
      continue
    match = _INSTRUCTION.match(line) if current else None
    if match:
      name, rest = match.groups()
      shape, call = _split_shape(rest)
      computations[current].append((name, shape, call))
      instructions[name] = (shape, call, current)
  return computations, instructions


def _constant(name: str, instructions) -> int | None:
  """The integer value of a scalar constant, through copies and bitcasts."""
  while name in instructions:
    _, call, _ = instructions[name]
    opcode = call.split('(', 1)[0]
    if opcode == 'constant':
      value = re.match(r'constant\((-?\d+)\)', call)
      return int(value.group(1)) if value else None
    if opcode not in ('copy', 'bitcast', 'convert'):
      return None
    name = _operands(call)[0]
  return None


def trip_count(call: str, instructions) -> int | None:
  """Iterations of the while loop of instruction text `call`: XLA's
  `known_trip_count` where its backend_config has one (CPU, GPU), else read
  from the loop as jax writes it: a counter in the loop's tuple from a
  constant, compared with a constant in the condition (libtpu's compiled
  text has no annotation). None if neither applies."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', call)
  if known:
    return int(known.group(1))
  condition = re.search(r'condition=%?([\w.\-]+)', call)
  roots = [c for n, (_, c, comp) in instructions.items()
           if condition and comp == condition.group(1)
           and c.startswith('compare(')]
  if len(roots) != 1:
    return None
  compare = roots[0]
  direction = re.search(r'direction=(\w+)', compare).group(1)
  left, right = _operands(compare)[:2]
  if _constant(left, instructions) is not None:  # N > i: i < N.
    left, right = right, left
    direction = {'GT': 'LT', 'GE': 'LE'}.get(direction, direction)
  limit = _constant(right, instructions)
  counter = instructions.get(left, ('', '', ''))[1]
  index = re.search(r'get-tuple-element\(.*index=(\d+)', counter)
  if limit is None or not index or direction not in ('LT', 'LE'):
    return None
  init = instructions.get(_operands(call)[0], ('', '', ''))[1]
  if not init.startswith('tuple('):
    return None
  start = _constant(_operands(init)[int(index.group(1))], instructions)
  if start is None:
    return None
  return max(0, limit - start + (direction == 'LE'))


def runs_per_computation(hlo_text: str) -> tuple[dict[str, int], int]:
  """How many times each computation of a compiled module runs per call of
  its entry: a while loop's body runs its trip count times per run of the
  loop, nested loops multiply. Returns (runs, loops whose trip count is
  unknown, counted as running once)."""
  computations, instructions = _module(hlo_text)
  runs = {name: 0 for name in computations}
  unknown = 0
  order = list(computations)[::-1]  # XLA prints callees before callers.
  if order:
    runs[order[0]] = 1
  for computation in order:
    for _, _, call in computations[computation]:
      opcode = call.split('(', 1)[0]
      times = 1
      if opcode == 'while':
        times = trip_count(call, instructions)
        if times is None:
          unknown += 1
          times = 1
      body = re.search(r'body=%?([\w.\-]+)', call)
      for callee in set(re.findall(r'%([\w.\-]+)', call)):
        if callee in runs and callee != computation:
          factor = times if body and callee == body.group(1) else 1
          runs[callee] += runs[computation] * factor
  return runs, unknown


def output_layer(hlo_text: str) -> dict:
  """The output layer of `train.chunked_loss.output_token_metrics` in a compiled
  module (found by its op_name scopes): 'loops', the trip counts of its
  loops over chunks ([] when XLA removed a loop of one chunk), and
  'rows_per_device', the rows of its logits matmuls on one device (the
  output's size over the vocabulary's shard)."""
  computations, instructions = _module(hlo_text)
  loops, rows = [], set()
  for name, (shape, call, _) in instructions.items():
    op_name = re.search(r'op_name="([^"]*)"', call)
    if not op_name or '/output_layer/' not in op_name.group(1):
      continue
    opcode = call.split('(', 1)[0]
    if opcode == 'while':
      loops.append(trip_count(call, instructions))
    logits = re.search(r'/logits_v(\d+)/', op_name.group(1))
    if opcode in ('dot', 'convolution') and logits:
      array = _ARRAY.search(shape)
      dims = [int(d) for d in array.group(2).split(',') if d] if array else []
      vocab = int(logits.group(1))
      shards = [d for d in dims if -(-vocab // -(-vocab // d)) == d]
      if shards:
        rows.add(math.prod(dims) // max(shards))
  return {'loops': loops, 'rows_per_device': sorted(rows)}
