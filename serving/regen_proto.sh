#!/usr/bin/env bash
# Regenerates the gRPC stubs serving/{generation,admin}_pb2{,_grpc}.py(i) from
# serving/proto/jaxpaged/v1/{generation,admin}.proto. Usage: serving/regen_proto.sh [OUT_DIR]
# (default: serving/). The stubs live flat in jaxpaged.serving, so the import line that
# protoc writes for the proto package (jaxpaged.v1) is rewritten to jaxpaged.serving. They are
# then passed through ruff with the project's config, so `make format` leaves them unchanged.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here}"
py="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$py" ] || py=python3
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m grpc_tools.protoc -I "$here/proto" --python_out="$tmp" --pyi_out="$tmp" \
  --grpc_python_out="$tmp" "$here/proto/jaxpaged/v1/generation.proto" \
  "$here/proto/jaxpaged/v1/admin.proto"
cfg="$here/../pyproject.toml"
for f in generation_pb2.py generation_pb2.pyi generation_pb2_grpc.py \
  admin_pb2.py admin_pb2.pyi admin_pb2_grpc.py; do
  # ruff reads stdin as if the file were already in serving/ (same import sorting wherever OUT is)
  as="$here/$f"
  sed -e 's/^from jaxpaged\.v1 import \(generation\|admin\)_pb2/from jaxpaged.serving import \1_pb2/' \
    "$tmp/jaxpaged/v1/$f" \
    | "$py" -m ruff format -q --config "$cfg" --stdin-filename "$as" - \
    | "$py" -m ruff check -q --fix-only --exit-zero --config "$cfg" --stdin-filename "$as" - \
    | "$py" -m ruff format -q --config "$cfg" --stdin-filename "$as" - >"$out/$f"
done
