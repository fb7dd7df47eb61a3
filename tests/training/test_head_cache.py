"""The teacher cache: a sequence the target has read is served from disk bit for bit, keyed by
reader, feature layers and tokens; damaged or mismatched files are read again and replaced."""

import pytest
import torch

from verispec.errors import InvalidParameterError
from verispec.training.cache import TeacherCache, reader_identity, teacher_key
from verispec.training.teacher import Teacher


def fake_read(calls):
    def read(ids):
        calls.append(list(ids))
        g = torch.Generator().manual_seed(sum(ids))
        n = len(ids)
        return Teacher(
            torch.tensor(ids),
            torch.randn(n, 6, generator=g),
            torch.randn(n, 2, generator=g),
            torch.randint(0, 9, (n,), generator=g),
        )

    return read


def same(a, b):
    return all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in ("token_ids", "features", "final_hidden", "target_argmax")
    )


def test_a_read_sequence_comes_back_from_disk_bit_for_bit(tmp_path):
    calls = []
    cache = TeacherCache(tmp_path / "c", "gguf|t")
    read = cache.reading(fake_read(calls), (1, 2))
    first = read([3, 4, 5])
    again = TeacherCache(tmp_path / "c", "gguf|t").reading(fake_read(calls), (1, 2))([3, 4, 5])
    assert calls == [[3, 4, 5]] and same(first, again)  # the second run did not call the target
    assert (cache.hits, cache.misses) == (0, 1) and cache.size_bytes() > 0
    assert not list((tmp_path / "c").glob("*.partial"))
    # another reader, other layers or other tokens: another key, read afresh
    keys = {
        teacher_key("gguf|t", (1, 2), [3, 4, 5]),
        teacher_key("torch|t", (1, 2), [3, 4, 5]),
        teacher_key("gguf|t", (1, 3), [3, 4, 5]),
        teacher_key("gguf|t", (1, 2), [3, 4, 6]),
    }
    assert len(keys) == 4
    other = TeacherCache(tmp_path / "c", "torch|t")
    other.reading(fake_read(calls), (1, 2))([3, 4, 5])
    assert other.misses == 1 and len(calls) == 2


def test_a_damaged_or_mismatched_file_is_read_again_and_replaced(tmp_path):
    calls = []
    cache = TeacherCache(tmp_path, "r")
    read = cache.reading(fake_read(calls), (0,))
    expected = read([1, 2, 3])
    path = cache.path((0,), [1, 2, 3])
    path.write_bytes(path.read_bytes()[:40])  # truncated
    assert same(read([1, 2, 3]), expected) and cache.damaged == 1 and len(calls) == 2
    assert same(cache.load((0,), [1, 2, 3]), expected)  # replaced by a good file
    # a file holding another sequence's tokens under this key
    cache.store((0,), fake_read([])([7, 8]))
    cache.path((0,), [7, 8]).replace(path)
    assert cache.load((0,), [1, 2, 3]) is None and cache.damaged == 2


def test_a_teacher_cut_at_the_context_is_not_stored(tmp_path):
    cache = TeacherCache(tmp_path, "r")
    read = cache.reading(lambda ids: fake_read([])(ids[:2]), (0,))
    assert read([1, 2, 3]).token_ids.tolist() == [1, 2]
    assert not cache.path((0,), [1, 2, 3]).exists() and cache.size_bytes() == 0


def test_reader_identity_follows_the_file_and_a_bad_folder_is_refused(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"abc")
    before = reader_identity("gguf", "m", model)
    model.write_bytes(b"abcd")  # re-downloaded or re-quantized: another size
    assert reader_identity("gguf", "m", model) != before and reader_identity("torch", "m") == "torch|m"
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidParameterError, match="teacher cache"):
        TeacherCache(tmp_path / "file" / "sub", "r")
