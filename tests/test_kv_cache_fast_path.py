"""`KVCache.advance`'s one-token fast path (rows with no padding that share their count) against its general
path, which the same cache takes when told it may hold padding: the same slots, positions, masks and logits,
through the window's end and a ring that wraps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gptlab.kv_cache import KVCache
from gptlab.model import GPT


@pytest.mark.parametrize("capacity", [None, 12])  # the window itself, and a ring of 12 that wraps
def test_the_fast_path_equals_the_general_one(random_gpt: Callable[..., GPT], capacity: int | None) -> None:
    model = random_gpt(positions="rope", block_size=8)
    fast, general = (KVCache(model.config, 2, capacity) for _ in range(2))
    ids = torch.randint(model.config.vocab_size, (2, 30))
    with torch.no_grad():
        for cache in (fast, general):
            cache.reset(torch.zeros(2, dtype=torch.long))
        general._padded = True  # as if a row were padded: every step takes the general path
        model(ids[:, :3], cache=fast)
        model(ids[:, :3], cache=general)
        for t in range(3, 30):
            a = model(ids[:, t:t + 1], cache=fast)[0]
            b = model(ids[:, t:t + 1], cache=general)[0]
            assert torch.equal(fast.positions, general.positions) and fast.fed == general.fed
            assert torch.equal(fast.slot_positions, general.slot_positions)
            assert torch.equal(fast.slot_real, general.slot_real)
            if fast.mask is None:  # it sees every held key: the general path's mask hides nothing
                assert general.mask is not None and bool(general.mask.all())
            else:
                assert general.mask is not None and torch.equal(fast.mask, general.mask)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # a mask of all True may take another kernel
