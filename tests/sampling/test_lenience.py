"""The lenient (LOSSY) acceptance rules: what they emit, how often they accept, and that l = 1 is exact."""

import pytest
import torch

from specdec.planning.theory import acceptance_rate, lenient_acceptance_rate
from specdec.sampling import SamplingParams, greedy_verify, lenient_greedy_verify, rejection_sample

VOCAB = 6


def _pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, dim=-1)
    return target, draft


def _first_token_law(target: torch.Tensor, draft: torch.Tensor, lenience: float) -> tuple[torch.Tensor, float]:
    """The lenient rule written out independently of the library: x ~ q is kept w.p.
    min(1, p(x) / (l q(x))); otherwise the token comes from norm((p - q)+)."""
    keep = torch.clamp(target / (lenience * draft), max=1.0)
    residual = torch.clamp(target - draft, min=0.0)
    residual = residual / residual.sum()
    accepted = float((draft * keep).sum())
    return draft * keep + (1 - accepted) * residual, accepted


@pytest.mark.parametrize("lenience", [1.0, 0.5, 0.2])
@pytest.mark.parametrize("seed", [0, 1])
def test_lenient_sampling_emits_the_lenient_law_and_accepts_at_the_theory_rate(seed, lenience):
    target, draft = _pair(seed)
    rows = 200_000
    gen = torch.Generator().manual_seed(100 + seed)
    drafts = torch.multinomial(draft, rows, replacement=True, generator=gen)[:, None]  # [rows, 1]
    out = rejection_sample(drafts, torch.ones(rows, dtype=torch.int64), draft.expand(rows, 1, VOCAB),
                           target.expand(rows, 2, VOCAB), generator=gen, lenience=lenience)
    law, accepted = _first_token_law(target, draft, lenience)
    assert accepted == pytest.approx(float(lenient_acceptance_rate(target, draft, lenience)), abs=1e-6)
    assert float(out.num_accepted.float().mean()) == pytest.approx(accepted, abs=0.005)
    frequencies = torch.bincount(out.output_ids[:, 0], minlength=VOCAB).double() / rows
    assert torch.allclose(frequencies, law.double(), atol=0.005)
    # l = 1 is the exact rule; below it the first token drifts away from the target (that is the trade).
    drift = 0.5 * float((law - target).abs().sum())
    if lenience == 1.0:
        assert drift < 1e-6
    else:
        assert drift > 0.01 and accepted > float(acceptance_rate(target, draft))


def test_lenience_one_is_bit_for_bit_the_exact_rule():
    target, draft = _pair(3)
    gen_args = dict(draft_token_ids=torch.tensor([[1, 4, 2]]), num_draft=torch.tensor([3]),
                    draft_probs=draft.expand(1, 3, VOCAB), target_probs=target.expand(1, 4, VOCAB))
    exact = rejection_sample(**gen_args, generator=torch.Generator().manual_seed(5))
    lenient = rejection_sample(**gen_args, generator=torch.Generator().manual_seed(5), lenience=1.0)
    assert torch.equal(exact.output_ids, lenient.output_ids)


def test_lenient_greedy_accepts_near_misses_and_closes_with_the_argmax():
    """l = 0.5 on p_0 = [.5, .3, .2] (docstring example): draft 1 has .3 >= .25, accepted; then
    p_1 = [.1, .2, .7] and draft 0 has .1 < .35, rejected: the step closes with p_1's argmax, 2."""
    target_probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]]])
    logits = target_probs.log()
    out = lenient_greedy_verify(torch.tensor([[1, 0]]), torch.tensor([2]), logits, 0.5)
    assert out.num_accepted.tolist() == [1] and out.output_ids.tolist() == [[1, 2, -1]]
    strict = lenient_greedy_verify(torch.tensor([[1, 0]]), torch.tensor([2]), logits, 0.9)
    assert strict.num_accepted.tolist() == [0] and strict.output_ids.tolist() == [[0, -1, -1]]


def test_lenient_greedy_at_one_is_greedy_verify():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5, VOCAB, generator=gen)  # [B, k+1, V]
    drafts = torch.where(torch.rand(64, 4, generator=gen) < 0.6, logits[:, :4].argmax(-1),
                         torch.randint(0, VOCAB, (64, 4), generator=gen))
    num_draft = torch.randint(0, 5, (64,), generator=gen)
    drafts = torch.where(torch.arange(4)[None] < num_draft[:, None], drafts, -1)
    exact = greedy_verify(drafts, num_draft, logits.argmax(-1))
    lenient = lenient_greedy_verify(drafts, num_draft, logits, 1.0)
    assert torch.equal(exact.num_accepted, lenient.num_accepted)
    assert torch.equal(exact.output_ids, lenient.output_ids)
    looser = lenient_greedy_verify(drafts, num_draft, logits, 0.2)
    assert (looser.num_accepted >= exact.num_accepted).all() and looser.num_accepted.sum() > exact.num_accepted.sum()
    assert (looser.num_accepted <= num_draft).all()


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, True, "0.5"])
def test_lenience_outside_zero_one_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="lenience"):
        SamplingParams(temperature=0.7, lenience=bad)


def test_exact_is_the_default_and_lenience_below_one_is_flagged():
    assert SamplingParams().exact and not SamplingParams(lenience=0.5).exact
