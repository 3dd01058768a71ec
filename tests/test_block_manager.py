"""The block manager as a plain state machine on the host: allocation, reference counts, the
prefix cache's hash chain, token confirmation and least-recently-used eviction."""

import pytest

from speculative.engine.block_manager import BlockManager, OutOfBlocks


def test_allocate_and_release_every_block():
    m = BlockManager(4, 16)
    blocks = [m.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and m.num_free == 0 and m.usage == 1.0
    with pytest.raises(OutOfBlocks):
        m.allocate()
    m.release(blocks[:2])
    assert m.num_free == 2 and m.usage == 0.5
    m.release(blocks[2:])
    assert m.num_free == 4 and m.ref_counts == [0] * 4
    with pytest.raises(AssertionError, match="released twice"):
        m.release(blocks[:1])


def test_blocks_for_rounds_up():
    m = BlockManager(4, 16)
    assert [m.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_least_recently_freed_is_taken_first():
    m = BlockManager(3, 16)
    a, b, c = (m.allocate() for _ in range(3))
    m.release([b])
    m.release([a])
    m.release([c])
    assert [m.allocate() for _ in range(3)] == [b, a, c]


def test_prefix_match_shares_full_blocks_and_counts_hits():
    m = BlockManager(8, 4)
    tokens = list(range(10))  # two full blocks and a partial one
    blocks = [m.allocate() for _ in range(3)]
    hashes: list[int] = []
    m.cache(blocks, hashes, tokens)
    assert len(hashes) == 2  # the partial block is not cached
    m.release(blocks)

    same, same_hashes = m.match(tokens + [99], max_tokens=10)
    assert same == blocks[:2] and same_hashes == hashes
    assert [m.ref_counts[b] for b in blocks] == [1, 1, 0]

    # a second request holds them too; they stay referenced until both let go
    again, _ = m.match(tokens, max_tokens=10)
    assert again == blocks[:2] and m.ref_counts[blocks[0]] == 2
    m.release(same)
    m.release(again)
    assert m.num_free == 8


def test_match_stops_at_the_first_differing_block_and_at_max_tokens():
    m = BlockManager(8, 4)
    tokens = list(range(12))
    blocks = [m.allocate() for _ in range(3)]
    m.cache(blocks, [], tokens)
    m.release(blocks)
    other = tokens[:4] + [50] + tokens[5:]
    assert m.match(other, 12)[0] == blocks[:1]
    # a block that matches only after a different one is another chain
    assert m.match([50] + tokens[1:], 12)[0] == []
    # at most max_tokens: whole blocks only
    assert m.match(tokens, 11)[0] == blocks[:2]


def test_a_hash_collision_is_refused_by_the_tokens():
    m = BlockManager(4, 2)
    block = m.allocate()
    m.cache([block], [], [1, 2])
    m.release([block])
    m.tokens_of[block] = (1, 3)  # as if another block's tokens hashed the same
    assert m.match([1, 2, 5], 3) == ([], [])
    assert m.ref_counts[block] == 0


def test_eviction_drops_the_cached_content():
    m = BlockManager(2, 2)
    a, b = m.allocate(), m.allocate()
    m.cache([a, b], [], [1, 2, 3, 4])
    m.release([a, b])  # b (the tail) freed first, so it is evicted first
    taken = m.allocate()
    assert taken == b
    assert m.match([1, 2, 3, 4, 5], 5)[0] == [a]  # the prefix survived its tail
    assert b not in m.hash_of and len(m.block_of) == 1


def test_duplicate_blocks_keep_the_first_cached_copy():
    m = BlockManager(4, 2)
    first, second = m.allocate(), m.allocate()
    m.cache([first], [], [7, 8])
    hashes: list[int] = []
    m.cache([second], hashes, [7, 8])
    assert len(hashes) == 1 and m.hash_of == {first: hashes[0]}
    m.release([first, second])
    assert m.match([7, 8, 9], 3)[0] == [first]


def test_prefix_caching_off_matches_nothing():
    m = BlockManager(4, 2, enable_prefix_caching=False)
    block = m.allocate()
    m.cache([block], [], [1, 2])
    m.release([block])
    assert m.match([1, 2, 3], 3) == ([], []) and not m.hash_of
