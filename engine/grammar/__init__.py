"""Structured output: constraints compiled by the grammar engine (llguidance), one matcher per
sequence, token bitmasks for the sampler. See compiler.py."""
from engine.grammar.compiler import GrammarCompiler, GrammarError, Matcher, fill_bitmasks

__all__ = ["GrammarCompiler", "GrammarError", "Matcher", "fill_bitmasks"]
