import torch

from conftest import make_model
from specdec.models.cpu_linear import OneDNNLinear, pack_linears
from specdec.models.hf import HFRunner


def test_onednn_linear_matches_nn_linear_for_any_leading_shape():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    packed = OneDNNLinear(linear)
    for shape in [(1, 24), (1, 5, 24), (3, 7, 24)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed.weight.shape == linear.weight.shape


def test_packed_model_gives_the_same_logits_and_kv_behaviour():
    reference = HFRunner(make_model(seed=2))
    model = make_model(seed=2)
    assert pack_linears(model) == 2 * 7 + 1  # q,k,v,o,gate,up,down per layer + lm_head
    packed = HFRunner(model)
    assert packed.vocab_size == reference.vocab_size
    ids = torch.randint(0, 64, (1, 11))
    positions = torch.arange(11)[None]
    expected = reference.forward(ids, positions).logits
    first = packed.forward(ids[:, :6], positions[:, :6]).logits
    packed.forward(torch.zeros(1, 3, dtype=torch.int64), torch.arange(6, 9)[None])
    packed.truncate(torch.tensor([6]))
    second = packed.forward(ids[:, 6:], positions[:, 6:]).logits
    torch.testing.assert_close(torch.cat([first, second], dim=1), expected, atol=1e-4, rtol=1e-4)
