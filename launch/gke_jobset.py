#!/usr/bin/env python3
"""Trains on a GKE cluster: writes a JobSet for a TPU slice (or GPU nodes)
and applies it with `kubectl apply -f -`.

  launch/gke_jobset.py --name q --accelerator-type v5litepod-16 \\
      --image us-docker.pkg.dev/PROJECT/REPO/jaxformer@sha256:DIGEST -- \\
      jaxformer train --config configs/quickstart.py --workdir gs://BUCKET/runs/q

One pod per host, each one JAX process: a TPU slice's pods are scheduled
onto one node pool of the slice's accelerator and topology
(nodeSelector), each requesting its host's chips (google.com/tpu); GKE
gives them TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, from which JAX finds the
others. GPU pods (--gpu-type) get JAX_COORDINATOR_ADDRESS (pod 0 through the
JobSet's headless service) and JAX_NUM_PROCESSES; their process id is the
Indexed Job's JOB_COMPLETION_INDEX (jaxformer.parallel.mesh). A failed or
preempted pod restarts the whole JobSet (up to --max-restarts times), which
resumes from the last checkpoint, so the workdir must be one every pod sees
(gs://). The image must have jaxformer installed (pip install -c
launch/constraints.txt '.[tpu]' for TPUs), and is named by its digest,
which, unlike a tag, cannot come to mean another image between two
restarts. --dry-run prints the manifest instead.
"""
import argparse
import json
import re
import subprocess
import sys

from tpu_vm import workdir_of  # launch/, beside this script

# GKE's node labels per TPU generation: (gke-tpu-accelerator, chips per host
# of a multi-host slice, whether the accelerator type counts TensorCores).
TPU_FAMILIES = {
    'v4': ('tpu-v4-podslice', 4, True),
    'v5e': ('tpu-v5-lite-podslice', 4, False),
    'v5p': ('tpu-v5p-slice', 4, True),
    'v6e': ('tpu-v6e-slice', 4, False),
}
# Chips -> slice shape (GKE's gke-tpu-topology), as in jaxformer/aot/compile_run.py.
GRIDS_3D = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4',
            256: '4x8x8'}
GRIDS_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8',
            128: '8x16', 256: '16x16'}
CONTAINER = 'jaxformer'
DIGEST = re.compile(r'[^@\s]+@sha256:[0-9a-f]{64}')
GPU_PORT = 1234  # The coordinator's port on GPU pod 0.


def tpu_slice(accelerator_type: str) -> dict:
  """GKE's description of a TPU slice: accelerator label, topology, hosts
  and chips per host. Accepts Cloud names (v5litepod-16) and jaxformer's
  (v5e-16)."""
  family, _, size = accelerator_type.replace('v5litepod', 'v5e').partition('-')
  if family not in TPU_FAMILIES or not size.isdigit():
    raise ValueError(f'unknown accelerator type {accelerator_type!r}; give '
                     f'one of {", ".join(TPU_FAMILIES)} and a size, e.g. '
                     'v4-16, v5litepod-16, v5p-64, v6e-16')
  label, per_host, counts_cores = TPU_FAMILIES[family]
  chips = int(size) // 2 if counts_cores else int(size)
  grids = GRIDS_3D if counts_cores else GRIDS_2D
  if chips not in grids:
    raise ValueError(f'{accelerator_type}: no {family} slice of {chips} chips '
                     f'on GKE here; sizes: '
                     + ', '.join(f'{family}-{c * 2 if counts_cores else c}'
                                 for c in grids))
  # v5e and v6e slices of up to 8 chips are a single host.
  chips_per_host = chips if chips <= 8 and not counts_cores else min(
      chips, per_host)
  return dict(accelerator=label, topology=grids[chips],
              hosts=chips // chips_per_host, chips_per_host=chips_per_host)


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--name', required=True,
                      help='JobSet name (lower case letters, digits, -)')
  parser.add_argument('--image', required=True,
                      help='container image with jaxformer installed, by '
                           'digest: NAME@sha256:<64 hex digits>')
  parser.add_argument('--accelerator-type',
                      help='TPU slice, e.g. v4-16, v5litepod-16, v5p-64')
  parser.add_argument('--gpu-type', help='GPU nodes instead, e.g. '
                      'nvidia-h100-80gb (GKE cloud.google.com/gke-accelerator)')
  parser.add_argument('--nodes', type=int, default=1, help='GPU nodes')
  parser.add_argument('--gpus-per-node', type=int, default=8)
  parser.add_argument('--namespace')
  parser.add_argument('--spot', action='store_true',
                      help='schedule onto Spot nodes')
  parser.add_argument('--max-restarts', type=int, default=20,
                      help='restarts of the whole JobSet after a failure or '
                           'preemption (each resumes from the checkpoint)')
  parser.add_argument('--output', choices=('yaml', 'json'), default='yaml')
  parser.add_argument('--dry-run', action='store_true',
                      help='print the manifest, apply nothing')
  parser.add_argument('command', nargs=argparse.REMAINDER,
                      help='after --: the command every pod runs')
  args = parser.parse_args(argv)
  args.command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not args.command:
    parser.error('give the command to run after --, e.g. -- jaxformer train '
                 '--config configs/quickstart.py --workdir gs://bucket/run')
  check_image(parser, args.image)
  if bool(args.accelerator_type) == bool(args.gpu_type):
    parser.error('give either --accelerator-type (a TPU slice) or --gpu-type')
  if args.accelerator_type:
    try:
      args.slice = tpu_slice(args.accelerator_type)
    except ValueError as e:
      parser.error(str(e))
  workdir = workdir_of(args.command)
  if not (workdir or '').startswith('gs://'):
    print(f'gke_jobset.py: warning: --workdir {workdir} is not in a bucket; '
          'each pod would keep its own checkpoints, lost at a restart. Use '
          'gs://...', file=sys.stderr)
  return args


def check_image(parser, image: str) -> None:
  """A digest passes; a tag draws a warning; anything else after '@' is
  an error."""
  if DIGEST.fullmatch(image):
    return
  if '@' in image:
    parser.error(f'--image {image!r}: a digest is NAME@sha256: and 64 '
                 'lower-case hex digits')
  print(f'gke_jobset.py: warning: --image {image} is a tag, which may point '
        'to another image by the next restart; pass NAME@sha256:DIGEST '
        "(gcloud artifacts docker images describe IMAGE "
        "--format='value(image_summary.digest)').", file=sys.stderr)


def pod_spec(args) -> tuple[int, dict]:
  """(pods, the pod template's spec): one pod per TPU host or GPU node."""
  container = {'name': CONTAINER, 'image': args.image,
               'command': list(args.command)}
  if args.accelerator_type:
    pods, chips = args.slice['hosts'], args.slice['chips_per_host']
    selector = {
        'cloud.google.com/gke-tpu-accelerator': args.slice['accelerator'],
        'cloud.google.com/gke-tpu-topology': args.slice['topology']}
    container['resources'] = {'requests': {'google.com/tpu': chips},
                              'limits': {'google.com/tpu': chips}}
  else:
    pods = args.nodes
    selector = {'cloud.google.com/gke-accelerator': args.gpu_type}
    container['resources'] = {'limits': {'nvidia.com/gpu': args.gpus_per_node}}
    # Pod 0's name through the JobSet's headless service (its subdomain).
    container['env'] = [
        {'name': 'JAX_COORDINATOR_ADDRESS',
         'value': f'{args.name}-workers-0-0.{args.name}:{GPU_PORT}'},
        {'name': 'JAX_NUM_PROCESSES', 'value': str(pods)}]
    container['ports'] = [{'containerPort': GPU_PORT}]
  if args.spot:
    selector['cloud.google.com/gke-spot'] = 'true'
  return pods, {'restartPolicy': 'Never', 'nodeSelector': selector,
                'containers': [container]}


def manifest(args) -> dict:
  """The JobSet: one replicated Job of indexed pods, all restarted
  together when one fails."""
  pods, spec = pod_spec(args)
  metadata = {'name': args.name}
  if args.namespace:
    metadata['namespace'] = args.namespace
  if args.accelerator_type:  # The whole slice in one node pool.
    metadata['annotations'] = {
        'alpha.jobset.sigs.k8s.io/exclusive-topology':
            'cloud.google.com/gke-nodepool'}
  return {
      'apiVersion': 'jobset.x-k8s.io/v1alpha2', 'kind': 'JobSet',
      'metadata': metadata,
      'spec': {
          'failurePolicy': {'maxRestarts': args.max_restarts},
          'replicatedJobs': [{
              'name': 'workers', 'replicas': 1,
              'template': {'spec': {
                  'parallelism': pods, 'completions': pods,
                  'completionMode': 'Indexed', 'backoffLimit': 0,
                  'template': {'spec': spec}}}}]}}


def render(document: dict, output: str) -> str:
  if output == 'json':
    return json.dumps(document, indent=2) + '\n'
  try:
    import yaml
  except ImportError:
    raise SystemExit('gke_jobset.py: printing YAML needs PyYAML (pip install '
                     'pyyaml); or pass --output json, which kubectl takes '
                     'as well.') from None
  return yaml.safe_dump(document, sort_keys=False)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  text = render(manifest(args), args.output)
  if args.dry_run:
    sys.stdout.write(text)
    return 0
  print('+ kubectl apply -f -', flush=True)
  code = subprocess.run(['kubectl', 'apply', '-f', '-'], input=text,
                        text=True).returncode
  if code:
    print(f'gke_jobset.py: kubectl apply failed with status {code}; see its '
          'output above.', file=sys.stderr)
  return code


if __name__ == '__main__':
  sys.exit(main())
