# Source on the GPU machine (no package registry there): installs the wheels carried in
# .whl/ (redis, grpcio + protobuf at the versions the generated code needs, grpc health /
# reflection, nixl-cu13, llguidance for structured output, the HTTP front's fastapi /
# uvicorn / pydantic) into /tmp/site and puts the carried redis-server on PATH.
#   source scripts/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PWD/.whl/bin:$PATH"
# SmolLM2-135M's tokenizer and shapes with zero weights (scripts/zero_model.py), for
# measurements that need the real vocabulary: /tmp/smollm2-135m-zero
[ -f .whl/smollm2-135m-zero.tar.gz ] && tar xzf .whl/smollm2-135m-zero.tar.gz -C /tmp
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
