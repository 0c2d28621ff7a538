from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.engine.block_manager import BlockManager, BlockTable


def test_prefix_cache_reuses_full_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(13))
    a = BlockTable()
    bm.allocate(a, len(tokens))
    bm.register_full_blocks(a, tokens, num_valid=13)
    assert len(a.hashes) == 3
    blocks, hashes = bm.match_prefix(tokens)
    assert blocks == a.blocks[:3]
    # a prompt of exactly 3 full blocks leaves its last block to compute
    blocks, _ = bm.match_prefix(tokens[:12])
    assert blocks == a.blocks[:2]
    bm.free(a)
    assert bm.num_used_blocks == 0
    # freed hashed blocks stay matchable until evicted
    b = BlockTable()
    blocks, hashes = bm.match_prefix(tokens)
    bm.take_cached(b, blocks, hashes)
    assert bm.num_used_blocks == 3
    bm.free(b)
    bm.check_invariants()


def test_divergent_suffix_does_not_match():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = BlockTable()
    toks = list(range(12))
    bm.allocate(a, 12)
    bm.register_full_blocks(a, toks, 12)
    other = toks[:4] + [99] + toks[5:]
    blocks, _ = bm.match_prefix(other)
    assert blocks == a.blocks[:1]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 5)), min_size=1, max_size=60
    )
)
def test_free_plus_used_is_total_under_random_ops(ops):
    bm = BlockManager(num_blocks=24, block_size=4)
    tables: list[tuple[BlockTable, list[int]]] = []
    for kind, n, seed in ops:
        if kind <= 1:  # new request with a prompt sharing prefixes across seeds
            toks = [(seed * 7 + i // 5) % 11 for i in range(n)]
            t = BlockTable()
            blocks, hashes = bm.match_prefix(toks)
            if (
                bm.blocks_needed(n) - len(blocks) + sum(bm.blocks[b].ref_count == 0 for b in blocks)
                > bm.num_free_blocks
            ):
                continue
            bm.take_cached(t, blocks, hashes)
            bm.allocate(t, n)
            bm.register_full_blocks(t, toks, n)
            tables.append((t, toks))
        elif kind == 2 and tables:
            t, toks = tables.pop(seed % len(tables))
            bm.free(t)
        elif tables:
            t, toks = tables[seed % len(tables)]
            keep = max(0, len(toks) - n)
            bm.truncate(t, keep)
            del toks[keep:]
        bm.check_invariants()
        # every table's blocks are live and no block is owned more often than its ref count
        owners: dict[int, int] = {}
        for t, _ in tables:
            for b in t.blocks:
                owners[b] = owners.get(b, 0) + 1
        for b, c in owners.items():
            assert bm.blocks[b].ref_count == c
    for t, _ in tables:
        bm.free(t)
    assert bm.num_used_blocks == 0
    bm.check_invariants()
