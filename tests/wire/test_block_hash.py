from pdserve.wire.block_hash import page_hash, prefix_page_hashes


def test_hashes_cover_full_pages_only_and_chain():
    hashes = prefix_page_hashes(list(range(10)), page_size=4)
    assert len(hashes) == 2
    assert hashes[0] == page_hash(0, [0, 1, 2, 3])
    assert hashes[1] == page_hash(hashes[0], [4, 5, 6, 7])


def test_same_page_under_different_prefix_hashes_differently():
    a = prefix_page_hashes([1, 2, 3, 4, 9, 9, 9, 9], page_size=4)
    b = prefix_page_hashes([5, 6, 7, 8, 9, 9, 9, 9], page_size=4)
    assert a[1] != b[1]
    assert prefix_page_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4) == a  # stable


def test_hashes_are_stable_across_releases():
    """Workers' prefix caches and routers of other versions must agree on every page's hash."""
    assert page_hash(0, [1, 2, 3, 4]) == 2821693476514209883
    assert prefix_page_hashes([7] * 8, 4)[1] == page_hash(page_hash(0, [7] * 4), [7] * 4)
