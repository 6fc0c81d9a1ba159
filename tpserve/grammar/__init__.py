"""Structured output on the scheduler side: grammars compiled by llguidance, one matcher per
request, the per-step token bitmask (no torch here; the sampler applies the mask)."""
from tpserve.grammar.compiler import GrammarCompiler
from tpserve.grammar.text import grammar_text
from tpserve.grammar.matcher import RequestGrammar, fill_bitmask

__all__ = ["GrammarCompiler", "RequestGrammar", "fill_bitmask", "grammar_text"]
