"""A GatewayEnv for tests that run the gateway's request path in process."""
from __future__ import annotations

from gateway.admission import Admission
from gateway.decode_calls import DecodeCalls
from gateway.pipeline import GatewayEnv
from gateway.router import Router
from gateway.tokenize import PromptTokenizer
from protos.pdserve.v1 import worker_pb2_grpc
from pdcore.block_hash import BlockHasher
from services.grpc_server import ChannelPool
from services.metrics import GatewayMetrics
from services.validation import RequestLimits


def gateway_env(router: Router, tokenizer=None, *, vocab_size: int = 1000,
                max_migrations: int = 3, admission: Admission | None = None,
                decode_stream: str = "many") -> GatewayEnv:
    return GatewayEnv(
        router=router, tokenizer=PromptTokenizer(tokenizer, threads=1),
        admission=admission or Admission(num_keys=0), hasher=BlockHasher("s", router.model, 16),
        metrics=GatewayMetrics(), limits=RequestLimits(), model=router.model,
        vocab_size=vocab_size, max_migrations=max_migrations,
        decode=DecodeCalls(ChannelPool(worker_pb2_grpc.DecodeWorkerStub), decode_stream))
