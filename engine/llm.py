"""LLM: the offline, in-process API.

    from engine import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].text, outs[0].token_ids)
"""
from __future__ import annotations

from collections.abc import Mapping

from collections.abc import Sequence as Seq
import itertools

from pdcore.config_tree import build
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import RequestOutput, SamplingParams


def build_engine_config(model: str | None = None, config: str | None = None,
                        **kwargs) -> EngineConfig:
    """The engine settings of ``LLM(model, **kwargs)``: defaults < the config file
    (``config``, or PDSERVE_CONFIG) < PDSERVE_* variables < ``kwargs``, each keyword any
    engine setting by its flat name (docs/configuration.md)."""
    return engine_config(model, config_file=config, **kwargs)


def engine_config(model: str | None = None, env: Mapping[str, str] | None = None,
                  config_file: str | None = None, **kw) -> EngineConfig:
    """The offline engine's settings, built like every entry point's (pdcore.config_tree):
    defaults < config file < ``PDSERVE_*`` < keywords. Unknown keywords raise TypeError
    naming the nearest setting; variables and file tables of the services (a cluster's
    shared environment or file) are left to them."""
    if model is not None:
        kw["model"] = model
    return build(EngineConfig, roots={"engine": EngineConfig}, env=env, keywords=kw,
                 sections=("engine",), config_file=config_file, strict=False)[0]


class LLM:
    def __init__(self, model: str | None = None, *, config: str | None = None, **kwargs):
        """``model``: a model spec (default smollm2-135m); ``kwargs``: any engine setting,
        flat (``max_num_seqs=``, ``block_size=``, ``schedule_policy=``, ``gemv_pdl=``, ...;
        docs/configuration.md lists them); ``config``: a TOML or YAML file of settings.
        Unknown keywords raise TypeError naming the nearest setting."""
        self._start(LLMEngine(build_engine_config(model, config, **kwargs)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """An LLM running exactly ``config`` (read nothing else)."""
        llm = cls.__new__(cls)
        llm._start(LLMEngine(config))
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.engine = engine
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
        results: dict[tuple[str, int], RequestOutput] = {}
        order = []
        for prompt, sp in zip(prompts, plist):
            ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, sp)
            for i in range(sp.n):
                results[rid, i] = RequestOutput(
                    request_id=rid, prompt_token_ids=ids, index=i,
                    logprobs=[] if sp.logprobs else None,
                    top_logprobs=[] if sp.top_logprobs else None)
            order.append((rid, sp.n))
        while self.engine.has_work:
            for out in self.engine.step():
                _merge(results[out.request_id, out.index], out)
        outs = []
        for rid, n in order:
            first = results[rid, 0]
            if n > 1:
                first.samples = [results[rid, i] for i in range(n)]
            outs.append(first)
        return outs

    def close(self) -> None:
        """Release what outlives the Python objects: the tensor-parallel rank processes
        (also stopped when the LLM is garbage-collected or the interpreter exits)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, messages, params: SamplingParams | None = None) -> list[RequestOutput]:
        """``messages``: one conversation (list of {role, content}) or a list of them."""
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ValueError("this model has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params)


def _merge(r: RequestOutput, out: RequestOutput) -> None:
    """Add one step's output to the request's (or sample's) output so far."""
    r.token_ids.extend(out.token_ids)
    r.text += out.text
    r.num_cached_tokens = out.num_cached_tokens
    if out.logprobs is not None and r.logprobs is not None:
        r.logprobs.extend(out.logprobs)
    if out.top_logprobs is not None and r.top_logprobs is not None:
        r.top_logprobs.extend(out.top_logprobs)
    if out.finished:
        r.finished = True
        r.finish_reason = out.finish_reason
