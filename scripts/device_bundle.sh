#!/usr/bin/env bash
# Builds .whl/ (gitignored), the folder the GPU machine gets with `carry` (it has no package
# registry): cp312 wheels of what its python3 lacks (the gateway's HTTP front: fastapi,
# uvicorn, pydantic), redis-server with its libraries, py-spy.
# Run here, from the repository root; then on the device: `source scripts/device_env.sh`.
set -eu
mkdir -p .whl/bin .whl/lib
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps -d .whl \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_34_x86_64 \
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
  redis==8.1.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 \
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2 \
  llguidance==1.9.1 py-spy \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 uvicorn==0.55.0 \
  httptools==0.9.0 typing-extensions==4.16.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
# py-spy's wheel is a binary: unpack it to .whl/bin (device_env.sh installs *.whl as packages)
python3 - <<'PY'
import glob, os, zipfile
for w in glob.glob(".whl/py_spy-*.whl"):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if n.endswith("/py-spy"):
                open(".whl/bin/py-spy", "wb").write(z.read(n))
                os.chmod(".whl/bin/py-spy", 0o755)
    os.remove(w)
PY
# redis-server and the libraries a bare image may lack (libc and the toolchain's are there)
src=$(command -v redis-server)
cp "$src" .whl/lib/redis-server.bin
ldd "$src" | awk '/=> \//{print $3}' | grep -Ev 'libc\.so|libm\.so|libstdc|libgcc_s|ld-linux' \
  | xargs -r -I{} cp -L {} .whl/lib/
cat > .whl/bin/redis-server <<'SH'
#!/bin/sh
d=$(dirname "$(readlink -f "$0")")/../lib
LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/redis-server.bin" "$@"
SH
chmod +x .whl/bin/redis-server
# SmolLM2-135M's config and tokenizer with zero weights, packed (~0.9 MB): the GGUF is too
# big to carry, bench/structured_gpu.py needs the real vocabulary
${PYTHON:-.venv/bin/python} scripts/zero_model.py pack .whl/smollm2-135m-zero.tar.gz
du -sh .whl
