"""Structured output: each request's grammar (a JSON schema, a regex, an EBNF grammar) compiled by
xgrammar off the engine's step (compiler.py), requests held until theirs is ready (pending.py),
a matcher per request advanced with each accepted token (matcher.py), and each step's token
bitmask applied to the logits on the device before sampling (bitmask.py)."""

from breakgraph.engine.grammar.bitmask import GrammarMask, apply_token_bitmask
from breakgraph.engine.grammar.compiler import GrammarCompiler, GrammarUnavailable
from breakgraph.engine.grammar.matcher import RequestGrammar
from breakgraph.engine.grammar.pending import PendingGrammars

__all__ = [
    "GrammarCompiler",
    "GrammarMask",
    "GrammarUnavailable",
    "PendingGrammars",
    "RequestGrammar",
    "apply_token_bitmask",
]
