"""One proposer interface: the engines call every hook directly (proposers/base.py declares each
with a no-op default), so a proposer that writes only propose() runs in both engines, and every
proposer specdec ships is one."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import specdec
import specdec.proposers
from conftest import make_model, make_native, run_all
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.proposers.base import DraftProposal, Proposer
from specdec.proposers.batched import BatchProposer, RowwiseProposer
from specdec.sampling import SamplingParams

PROMPTS = ["the quick brown fox", "hello hello hello hello", "abc abc abc, abc abc"]


class RepeatLast(Proposer):
    """Writes propose() and nothing else: guesses that the last token repeats."""

    def propose(self, ctx, max_k):
        return DraftProposal.of_row([int(ctx.token_ids[0, -1])] * max_k, None, ctx.token_ids.device)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3, random_bias=True)


def test_a_proposer_with_only_propose_runs_alone_and_batched_and_equals_plain(model, tokenizer):
    params = SamplingParams(temperature=0)
    plain = SpecEngine(make_native(model), None, tokenizer)
    spec = SpecEngine(make_native(model), RepeatLast(), tokenizer, k=3)
    batched = BatchEngine(make_native(model, batch_size=2), RowwiseProposer(RepeatLast, slots=2), tokenizer, k="auto")
    requests = {i: batched.make_request(prompt, params, max_new_tokens=24) for i, prompt in enumerate(PROMPTS)}
    together = run_all(batched, requests)
    drafted = 0
    for i, prompt in enumerate(PROMPTS):
        reference = plain.generate(prompt, params, max_new_tokens=24)
        alone = spec.generate(prompt, params, max_new_tokens=24)
        drafted += alone.stats.drafted_tokens
        assert alone.token_ids == reference.token_ids
        assert together[i] == (reference.token_ids, reference.finish_reason)
    assert drafted > 0


def _modules(package) -> list:
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def test_every_shipped_proposer_is_one_of_the_two_interfaces():
    shipped = [cls for module in _modules(specdec.proposers) for _, cls in inspect.getmembers(module, inspect.isclass)
               if cls.__module__ == module.__name__ and cls.__name__.endswith("Proposer")
               and cls not in (Proposer, BatchProposer)]
    assert len(shipped) >= 8  # one implementation per method: the draft model and ngram+draft are batch-native
    for cls in shipped:
        assert issubclass(cls, (Proposer, BatchProposer)), cls
        assert cls.propose is not Proposer.propose and cls.propose is not BatchProposer.propose, cls


def test_no_module_probes_a_proposer_for_hooks():
    """getattr/hasattr on a proposer would mean a hook the interface does not declare."""
    root = Path(specdec.__file__).parent
    probes = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and "proposer" in ast.unparse(node.args[0]).lower()):
                probes.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, probes


def test_the_hooks_defaults_do_nothing():
    proposer = RepeatLast()
    assert proposer.unread_tokens(100) == 0 and proposer.tree_budget is None
    assert not proposer.reads_target_hidden and proposer.target_layers == () and proposer.extra_verify_tokens == 0
    for hook, args in [("on_verified", (torch.tensor([1]),)), ("reset", ()), ("read_lookahead", (torch.zeros(1, 4),)),
                       ("end_request", ([1], [2])), ("forget_earlier_requests", ())]:
        assert getattr(proposer, hook)(*args) is None


def test_the_batch_hooks_defaults_do_nothing():
    class Nothing(BatchProposer):
        def propose(self, contexts, max_ks):
            return DraftProposal.empty(len(contexts))

    proposer = Nothing()
    assert proposer.unread_tokens(0, 100) == 0 and proposer.tree_budget is None
    for hook, args in [("on_verified", (torch.tensor([1]),)), ("start_row", (0,)),
                       ("read_lookahead", (0, torch.zeros(1, 4))), ("end_row", (0, [1], [2])), ("move_row", (1, 0)),
                       ("forget_earlier_requests", ())]:
        assert getattr(proposer, hook)(*args) is None
