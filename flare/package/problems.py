"""The one form of a message that lists problems (missing or misshapen tensors, files that fail
their checksums, blocks that cannot be served): the first `MAX_LISTED`, then how many more, so
that a hostile source's millions of problems stay one screenful; a single problem stays on the
message's one line."""

from __future__ import annotations

from collections.abc import Sequence

MAX_LISTED = 20


def capped(problems: Sequence[str]) -> list[str]:
    """The first `MAX_LISTED` problems, then "and N more" where there are more."""
    if len(problems) <= MAX_LISTED:
        return list(problems)
    return [*problems[:MAX_LISTED], f"and {len(problems) - MAX_LISTED} more"]


def listed(problems: Sequence[str]) -> str:
    """What follows the sentence that introduces `problems`: ": the problem" for one, otherwise
    ":" and one a line ("  - ..."), capped."""
    if len(problems) == 1:
        return f": {problems[0]}"
    return ":\n" + "\n".join(f"  - {problem}" for problem in capped(problems))
