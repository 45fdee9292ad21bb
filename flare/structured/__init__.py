"""Structured output: grammars that constrain what a request may generate.

A request's constraint (a JSON schema, any JSON object, a regular expression, a Lark grammar or
a list of choices) is compiled once per distinct constraint by llguidance into a prototype
matcher (`compiler.py`); each choice of the request steps its own copy (`state.py`). The
scheduler asks the state for drafts (forced tokens, and the valid prefix of the drafter's
proposal) and advances it by the tokens a round accepts; the runner fills the round's token
mask from the states, which the sampling kernels apply before everything else
(kernels/penalties.py). See docs/sampling.md.
"""

from flare.structured.compiler import CacheUse, Grammar, GrammarCompiler, GrammarError
from flare.structured.spec import GrammarSpec
from flare.structured.state import GrammarState, fill_masks

__all__ = ["CacheUse", "Grammar", "GrammarCompiler", "GrammarError", "GrammarSpec", "GrammarState", "fill_masks"]
