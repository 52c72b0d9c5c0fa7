"""LLM: the offline, in-process API.

    from engine import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].text, outs[0].token_ids)
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
import itertools

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import RequestOutput, SamplingParams

_CACHE_KEYS = {"block_size", "num_blocks", "kv_cache_memory_bytes", "enable_prefix_caching",
               "hash_seed", "kv_dtype"}
_SCHED_KEYS = {"max_num_seqs", "max_num_batched_tokens", "max_model_len"}


def build_engine_config(model: str, **kwargs) -> EngineConfig:
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_KEYS}
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHED_KEYS}
    return EngineConfig(model=model, cache=CacheConfig(**cache),
                        scheduler=SchedulerConfig(**sched), **kwargs)


class LLM:
    def __init__(self, model: str = "smollm2-135m", **kwargs):
        """kwargs: any EngineConfig, CacheConfig or SchedulerConfig field (flat)."""
        self.engine = LLMEngine(build_engine_config(model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """``prompts``: a string, a list of token ids, or a list of either. One output each,
        in order, with ``token_ids`` (generated ids), ``text`` and ``finish_reason``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, sp in zip(prompts, plist):
            ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, sp)
            results[rid] = RequestOutput(request_id=rid, prompt_token_ids=ids,
                                         logprobs=[] if sp.logprobs else None)
            order.append(rid)
        while self.engine.has_work:
            for out in self.engine.step():
                r = results[out.request_id]
                r.token_ids.extend(out.token_ids)
                r.text += out.text
                r.num_cached_tokens = out.num_cached_tokens
                if out.logprobs is not None and r.logprobs is not None:
                    r.logprobs.extend(out.logprobs)
                if out.finished:
                    r.finished = True
                    r.finish_reason = out.finish_reason
        return [results[r] for r in order]

    def chat(self, messages, params: SamplingParams | None = None) -> list[RequestOutput]:
        """``messages``: one conversation (list of {role, content}) or a list of them."""
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ValueError("this model has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params)
