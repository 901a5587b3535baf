"""Block hashes: deterministic, chained through the parent, salted by extra keys."""

from __future__ import annotations

from vllm_cluster.engine.block_hash import BLOCK_HASH_BYTES, hash_block, hash_block_tokens
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampling_params import SamplingParams


def test_same_tokens_and_parent_give_the_same_hash() -> None:
    parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(parent, [1, 2, 3, 4]) == hash_block(parent, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, [1, 2, 3, 4])


def test_hash_is_16_bytes() -> None:
    h = hash_block(None, [1, 2, 3, 4])
    assert isinstance(h, bytes)
    assert BLOCK_HASH_BYTES == 16
    assert len(h) == 16


def test_different_tokens_give_different_hashes() -> None:
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [4, 3, 2, 1])


def test_extra_keys_salt_the_hash() -> None:
    plain = hash_block(None, [1, 2, 3, 4])
    tenant_a = hash_block(None, [1, 2, 3, 4], ("tenant-a",))
    tenant_b = hash_block(None, [1, 2, 3, 4], ("tenant-b",))
    assert len({plain, tenant_a, tenant_b}) == 3
    assert tenant_a == hash_block(None, [1, 2, 3, 4], ("tenant-a",))
    # Keys are length-prefixed: moving a boundary between keys changes the hash.
    assert hash_block(None, [1], ("ab", "c")) != hash_block(None, [1], ("a", "bc"))


def test_chained_hash_depends_on_the_parent() -> None:
    parent_a = hash_block(None, [1, 2, 3, 4])
    parent_b = hash_block(None, [5, 6, 7, 8])
    assert hash_block(parent_a, [0, 0, 0, 0]) != hash_block(parent_b, [0, 0, 0, 0])
    # No parent is not the same as some parent.
    assert hash_block(None, [0, 0, 0, 0]) != hash_block(parent_a, [0, 0, 0, 0])


def test_partial_tail_block_is_not_hashed() -> None:
    tokens = list(range(10))
    hashes = hash_block_tokens(tokens, block_size=4)
    assert len(hashes) == 2
    assert hash_block_tokens(tokens[:3], block_size=4) == []
    assert len(hash_block_tokens(tokens[:8], block_size=4)) == 2


def test_block_hashes_chain_block_by_block() -> None:
    tokens = list(range(12))
    hashes = hash_block_tokens(tokens, block_size=4)
    h0 = hash_block(None, [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    h2 = hash_block(h1, [8, 9, 10, 11])
    assert hashes == [h0, h1, h2]


def test_equal_later_blocks_differ_when_an_earlier_block_differs() -> None:
    a = hash_block_tokens([1, 1, 1, 1, 7, 7, 7, 7], block_size=4)
    b = hash_block_tokens([2, 2, 2, 2, 7, 7, 7, 7], block_size=4)
    assert a[0] != b[0]
    assert a[1] != b[1]


def test_start_block_continues_from_a_parent() -> None:
    tokens = list(range(16))
    full = hash_block_tokens(tokens, block_size=4, extra_keys=("s",))
    tail = hash_block_tokens(tokens, block_size=4, extra_keys=("s",), parent=full[1], start_block=2)
    assert tail == full[2:]


def test_request_hashes_grow_incrementally_with_output_tokens() -> None:
    params = SamplingParams(max_tokens=8)
    request = Request(RequestId("r"), list(range(6)), params, None, 8, extra_keys=("t",))
    request.update_block_hashes(4)
    assert request.block_hashes == hash_block_tokens(list(range(6)), 4, ("t",))
    assert len(request.block_hashes) == 1
    request.append_output_token(6, None)
    request.update_block_hashes(4)
    assert len(request.block_hashes) == 1
    request.append_output_token(7, None)
    request.update_block_hashes(4)
    assert request.block_hashes == hash_block_tokens(list(range(8)), 4, ("t",))
    assert len(request.block_hashes) == 2
