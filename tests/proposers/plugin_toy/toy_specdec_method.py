"""Methods from outside specdec (tests/proposers/test_plugins.py installs them through entry points):
each drafts the last committed token again. The worked examples of docs/methods.md, "Write your own
proposer": `repeat-last` in the short form (a PluginMethod), `repeat-n` in the entry form with options
of its own (a MethodEntry whose options dataclass declares the flag --repeat-times)."""

from dataclasses import dataclass
from typing import ClassVar

from specdec.option_fields import non_negative_int, flagged
from specdec.proposers.base import DraftProposal, Proposer
from specdec.proposers.entry import MethodEntry
from specdec.proposers.plugins import PluginMethod


class RepeatLastToken(Proposer):
    def __init__(self, times: int = 0) -> None:
        self.times = times  # tokens per step; 0: as many as the engine allows (max_k)

    def propose(self, ctx, max_k):
        last = int(ctx.token_ids[0, -1])
        count = min(self.times or max_k, max_k)
        return DraftProposal.of_row([last] * count, None, ctx.token_ids.device)  # point masses: copies


METHOD = PluginMethod("repeat-last", "drafts the last token again, k times", lambda draft_runner: RepeatLastToken())


@dataclass(frozen=True)
class RepeatOptions:
    GROUP: ClassVar[str] = "repeat"  # its flags are --repeat-FIELD; SpecConfig(options=(RepeatOptions(2),))
    TITLE: ClassVar[str] = "repeating the last token"
    times: int = flagged(0, "tokens drafted per step, at most k (default: 0 = k)", parse=non_negative_int, metavar="N")


ENTRY = MethodEntry("repeat-n", "drafts the last token again, --repeat-times times",
                    lambda build: build.per_row(lambda: RepeatLastToken(build.option(RepeatOptions).times)),
                    options=(RepeatOptions,), replayable=True)
