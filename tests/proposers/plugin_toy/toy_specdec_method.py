"""A method from outside specdec (tests/proposers/test_plugins.py installs it through an entry point):
it drafts the last committed token again, max_k times. The worked example of docs/methods.md,
"Write your own proposer"."""

from specdec.proposers.base import DraftProposal, Proposer
from specdec.proposers.plugins import PluginMethod


class RepeatLastToken(Proposer):
    def propose(self, ctx, max_k):
        last = int(ctx.token_ids[0, -1])
        return DraftProposal.of_row([last] * max_k, None, ctx.token_ids.device)  # point masses: copies


METHOD = PluginMethod("repeat-last", "drafts the last token again, k times", lambda draft_runner: RepeatLastToken())
