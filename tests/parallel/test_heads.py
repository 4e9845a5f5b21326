"""The one head-split policy of Ulysses and AutoSP (autosp_lm.parallel.heads)."""
import pytest

from autosp_lm.parallel.heads import kv_replication, splittable, working_sizes


@pytest.mark.parametrize("h,hkv,p,r", [
    (4, 4, 2, 1),    # MHA: heads split
    (4, 2, 2, 1),    # GQA, kv heads split
    (4, 2, 4, 2),    # each kv head on two ranks
    (32, 8, 16, 2),
    (32, 8, 4, 1),
    (4, 1, 2, 2),    # MQA
    (12, 4, 6, 3),   # neither P | Hkv nor Hkv | P: replicate 3x (12 kv heads, 2 per rank)
    (32, 8, 32, 4),
])
def test_replication(h, hkv, p, r):
    got = kv_replication(h, hkv, p)
    assert got == r
    # the invariants: every rank the same number of (query, kv) heads and kv heads it uses
    assert h % p == 0 and (hkv * got) % p == 0 and h % (hkv * got) == 0


def test_refusals_name_the_numbers_and_what_works():
    with pytest.raises(ValueError, match=r"4 query heads and 2 key/value heads cannot be split "
                                         r"over sequence-parallel size 3.*sizes that work: 2, 4"):
        kv_replication(4, 2, 3)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4"):
        kv_replication(6, 4, 2)
    assert working_sizes(6, 6) == [2, 3, 6] and not splittable(6, 6, 4)


def test_head_chunks():
    """UPipe's head chunks (--ulysses --attention-head-chunks): each rank's query heads in
    equal chunks that each use whole kv heads of the rank or one kv head's share."""
    from autosp_lm.parallel.heads import chunk_counts, head_chunks
    assert chunk_counts(32, 8, 8) == [1, 2, 4]  # Llama-3.1-8B on 8 ranks: 4 heads, 1 kv head
    assert head_chunks(32, 8, 8, 0) == 4  # 0: one query head of each rank a chunk (UPipe's)
    assert chunk_counts(8, 4, 2) == [1, 2, 4]  # 4 query heads on 2 kv heads: split or shared
    assert chunk_counts(12, 4, 1) == [1, 2, 4, 12]  # 6 chunks of 2 would straddle kv heads
    assert chunk_counts(4, 2, 4) == [1]  # one query head a rank (kv replicated)
    assert chunk_counts(4, 2, 3) == []
    with pytest.raises(ValueError, match=r"--attention-head-chunks 6 does not split each "
                                         r"rank's 12 query heads \(12 heads over 1 ranks\) and "
                                         r"the 4 key/value head\(s\).*use one of 1, 2, 4, 12"):
        head_chunks(12, 4, 1, 6)
    with pytest.raises(ValueError, match="cannot be split over sequence-parallel size 3"):
        head_chunks(4, 2, 3, 2)
