"""Drafters propose tokens that the target model verifies in one forward pass."""

from flare.engine.drafters.base import Draft, Drafter, DraftState
from flare.engine.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "DraftState", "NgramDrafter", "make_drafter"]


def make_drafter(name: str) -> Drafter:
    """The drafter a package's `serving.drafter` names."""
    if name == "ngram":
        return NgramDrafter()
    raise ValueError(f"unknown drafter {name!r}; known drafters: ngram")
