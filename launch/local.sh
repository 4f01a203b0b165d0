#!/usr/bin/env bash
# Runs one command as N processes of a multi-process JAX job on this machine:
# each process sees D fake CPU devices and joins a coordinator that listens
# on 127.0.0.1 only.
# The same code path as a pod slice or a SLURM job, without the hardware.
#
#   launch/local.sh --processes 2 --devices 2 -- \
#     jaxformer train --config configs/quickstart.py:runlocal --workdir runs/local
#
# Process 0 prints as usual; lines of process i > 0 start with "[pi] ".
# Exits with the first non-zero status of the processes (0 if all succeed).
# Ctrl-C / SIGTERM is passed on to every process.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/local.sh [--processes N] [--devices D] [--port P] [--dry-run] -- COMMAND...
  --processes N  processes to start (default 2)
  --devices D    fake CPU devices per process (default 2)
  --port P       coordinator port on 127.0.0.1 (default: a free one)
  --dry-run      print the command of each process and exit
EOF
}

processes=2
devices=2
port=''
dry_run=0
while (( $# )); do
  case "$1" in
    --processes) processes=$2; shift 2 ;;
    --devices) devices=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "local.sh: unknown option $1 (the command goes after --)" >&2
       usage >&2; exit 2 ;;
  esac
done
if (( $# == 0 )); then
  echo 'local.sh: no command; put it after --, e.g. -- jaxformer train ...' >&2
  exit 2
fi
if ! [[ $processes =~ ^[1-9][0-9]*$ && $devices =~ ^[1-9][0-9]*$ &&
        $port =~ ^([1-9][0-9]*)?$ ]]; then
  echo "local.sh: --processes, --devices and --port must be positive" \
       "integers, got $processes, $devices and '$port'" >&2
  exit 2
fi
if [[ -z $port ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

# Keep the caller's XLA flags except a device count of its own.
read -ra words <<<"${XLA_FLAGS:-}"
kept=()
for flag in ${words[@]+"${words[@]}"}; do
  [[ $flag == --xla_force_host_platform_device_count=* ]] || kept+=("$flag")
done
kept+=("--xla_force_host_platform_device_count=$devices")
xla_flags="${kept[*]}"

process_command() {  # Sets `command`: process $1 running the rest.
  local id=$1
  shift
  command=(env "JAX_COORDINATOR_ADDRESS=127.0.0.1:$port"
           "JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:$port"
           "JAX_NUM_PROCESSES=$processes" "JAX_PROCESS_ID=$id"
           JAX_PLATFORMS=cpu "XLA_FLAGS=$xla_flags" "$@")
}

if (( dry_run )); then
  for (( i = 0; i < processes; i++ )); do
    process_command "$i" "$@"
    printf '%q ' "${command[@]}"
    echo
  done
  exit 0
fi

pids=()
forward() { kill -s "$1" "${pids[@]}" 2>/dev/null || true; }
trap 'forward INT' INT
trap 'forward TERM' TERM
for (( i = 0; i < processes; i++ )); do
  process_command "$i" "$@"
  if (( i == 0 )); then
    "${command[@]}" &
  else
    "${command[@]}" > >(sed -u "s/^/[p$i] /") 2>&1 &
  fi
  pids+=($!)
done

status=0
for pid in "${pids[@]}"; do
  # `wait` returns early when a trapped signal arrives; wait again.
  while true; do
    set +e
    wait "$pid"
    code=$?
    set -e
    kill -0 "$pid" 2>/dev/null || break
  done
  if (( code != 0 && status == 0 )); then
    status=$code
  fi
done
exit "$status"
