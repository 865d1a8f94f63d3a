"""Weights and KV caches on 2 MB pages: the same values, the same outputs, in a huge-page mapping."""

import re
from unittest import mock

import pytest
import torch
from torch import nn

from conftest import make_model, make_native
from specdec.analysis.roofline import weight_bytes
from specdec.models import huge_pages
from specdec.models.kv_cache import StaticKVCache

needs_huge_pages = pytest.mark.skipif(huge_pages.huge_pages_unavailable() is not None,
                                      reason=f"{huge_pages.huge_pages_unavailable()}")


def _mapping_fields(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping that holds `address`."""
    text = open("/proc/self/smaps").read()
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        low, high = (int(part, 16) for part in entry.split()[0].split("-"))
        if low <= address < high:
            return dict(line.split(":", 1) for line in entry.splitlines()[1:] if ":" in line)
    raise AssertionError(f"no mapping holds {address:#x}")


def _on_huge_pages(tensor: torch.Tensor) -> bool:
    """The tensor lies in a mapping that madvise(MADV_HUGEPAGE) made eligible for 2 MB pages."""
    fields = _mapping_fields(tensor.data_ptr())
    return fields.get("THPeligible", "0").strip() == "1" and fields.get("VmFlags", "").split().count("hg") == 1


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(512, 1024)  # 2 MB of fp32 weights
        self.embedding = nn.Embedding(2048, 256)  # 2 MB
        self.head = nn.Linear(256, 2048, bias=False)
        self.head.weight = self.embedding.weight
        self.register_buffer("table", torch.arange(600_000, dtype=torch.int32).reshape(600, 1000).T)  # strided view
        self.small = nn.Linear(8, 8)


@needs_huge_pages
def test_moved_tensors_keep_values_layout_and_sharing():
    model = Tied()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    strides = {name: tensor.stride() for name, tensor in model.state_dict().items()}
    small_address = model.small.weight.data_ptr()
    moved = huge_pages.move_to_huge_pages([model])
    assert moved.numel() == 1024 * 512 * 4 + 2048 * 256 * 4 + 600_000 * 4  # not the biases: under 1 MB
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]) and tensor.stride() == strides[name], name
    assert model.head.weight is model.embedding.weight  # still one parameter
    assert isinstance(model.big.weight, nn.Parameter) and model.big.weight.requires_grad
    assert model.small.weight.data_ptr() == small_address  # below min_bytes: where it was
    for tensor in (model.big.weight, model.embedding.weight, model.table):
        assert _on_huge_pages(tensor)
        # The returned mapping holds every moved storage: reading it reads what they hold.
        storage = tensor.untyped_storage()
        assert moved.data_ptr() <= storage.data_ptr() <= moved.data_ptr() + moved.numel() - storage.nbytes()
    assert not _on_huge_pages(model.small.weight)
    x = torch.randn(3, 512)
    torch.testing.assert_close(model.big(x), x @ before["big.weight"].T + before["big.bias"], rtol=0, atol=0)


@needs_huge_pages
def test_kept_storages_stay():
    model = Tied()
    address = model.embedding.weight.data_ptr()
    huge_pages.move_to_huge_pages([model], keep=(model.embedding.weight,))
    assert model.embedding.weight.data_ptr() == address and model.head.weight is model.embedding.weight
    assert _on_huge_pages(model.big.weight)


def test_nothing_moves_where_huge_pages_are_unavailable():
    model = Tied()
    address = model.big.weight.data_ptr()
    with mock.patch.object(huge_pages, "huge_pages_unavailable", lambda: "off"):
        assert huge_pages.move_to_huge_pages([model]).numel() == 0
        assert huge_pages.zeros((1024, 1024), torch.float32).data_ptr() != 0
    assert model.big.weight.data_ptr() == address


@needs_huge_pages
def test_zeros_on_huge_pages():
    cache = huge_pages.zeros((2, 3, 700, 128), torch.bfloat16)
    assert cache.shape == (2, 3, 700, 128) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any() and _on_huge_pages(cache)
    cache[1, 2, 699, 127] = 3.0
    assert float(cache.float().sum()) == 3.0
    assert not _on_huge_pages(huge_pages.zeros((16, 16), torch.float32))  # small: torch.zeros


@needs_huge_pages
def test_native_decoder_and_cache_on_huge_pages_give_the_same_logits():
    model = make_model(seed=21, hidden=512, layers=1)  # gate_up in int8: 2048 x 512, 1 MB
    with mock.patch.object(huge_pages, "huge_pages_unavailable", lambda: "off"):
        plain = make_native(model, quantize="int8")
    placed = make_native(model, quantize="int8")
    assert not _on_huge_pages(plain.decoder.blocks[0].mlp.gate_up.weight_int8)
    assert _on_huge_pages(placed.decoder.blocks[0].mlp.gate_up.weight_int8)
    # The decoder keeps the mapping for the weight floor, and weight_bytes does not count it twice.
    assert plain.decoder.weight_pages == () and len(placed.decoder.weight_pages) == 1
    assert weight_bytes(placed.decoder) == weight_bytes(plain.decoder)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = plain.forward(ids, torch.arange(12)[None]).logits
    assert torch.equal(placed.forward(ids, torch.arange(12)[None]).logits, expected)


@needs_huge_pages
def test_cpu_kv_cache_on_huge_pages_grows_and_keeps_its_contents():
    cache = StaticKVCache(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=128, max_capacity=8192,
                          dtype=torch.bfloat16, device=torch.device("cpu"), initial_capacity=1024)
    assert _on_huge_pages(cache.keys) and _on_huge_pages(cache.values)
    cache.keys[0, 0, 1, 1000] = 2.0
    cache.reserve(3000)
    assert cache.capacity >= 3000 and _on_huge_pages(cache.keys)
    assert float(cache.keys[0, 0, 1, 1000, 0]) == 2.0 and float(cache.keys.float().sum()) == 2.0 * 128
