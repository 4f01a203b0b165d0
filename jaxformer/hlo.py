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
  """Count and operand bytes (per device) of each collective in a compiled
  HLO module's text; an asynchronous pair (`all-gather-start` / `-done`)
  counts once.

  'windowed' counts the all-gathers and reduce-scatters that XLA's TPU
  backend fused with their matmul into a windowed einsum: a loop of
  collective-permutes around a ring, each step overlapped with a partial
  matmul. FSDP's gradient reduce-scatters mostly take this form, so they
  show up as collective-permutes, not as reduce-scatter instructions.
  """
  shapes, calls = {}, []
  stats = {op: {'count': 0, 'bytes': 0.0, 'windowed': 0}
           for op in COLLECTIVES}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, rest = match.groups()
    shape, call = _split_shape(rest)
    shapes[name] = shape
    opcode = call.split('(', 1)[0]
    base = opcode.removesuffix('-start')
    if base in COLLECTIVES and '(' in call:
      calls.append((base, _operands(call)))
    elif opcode == 'while':
      body = re.search(r'body=%?([\w.\-]+)', call)
      kind = re.search(r'windowed_dot_general_body_(ag|rs)',
                       body.group(1) if body else '')
      if kind:
        op = 'all-gather' if kind.group(1) == 'ag' else 'reduce-scatter'
        stats[op]['windowed'] += 1
  for op, operands in calls:
    stats[op]['count'] += 1
    stats[op]['bytes'] += sum(shape_bytes(shapes.get(o, '')) for o in operands)
  return stats


def custom_calls(hlo_text: str) -> dict[str, int]:
  """Count of each custom-call target in a compiled HLO module's text: the
  kernels XLA did not write itself, e.g. `tpu_custom_call` for a Pallas
  (Mosaic) kernel such as splash attention, or cuDNN's fused attention."""
  counts: dict[str, int] = {}
  for target in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
    counts[target] = counts.get(target, 0) + 1
  return counts
