"""pdserve's model execution engine (torch; triton on GPU). Imports nothing networked.

``from engine import LLM, SamplingParams`` is the offline API. Heavy modules load lazily so
that torch-free processes (the gateway) can import the tokenizer without importing torch.
"""
from engine.request import Constraint, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Constraint"]


def __getattr__(name):
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
