"""A GGUF's metadata is read from the file once and kept in the runtime directory for the other
processes (mcpd/gguf_cache.py): the kept copy gives what the gguf package's reader gives, and a
copy that is not the file's as it is now (changed in place, edited, another model's, a link,
garbage, tensors that lie) is never used: the file is read again."""
import hashlib
import json
import logging
import os

import gguf
import numpy as np
import pytest

from mcpd import gguf_cache, gguf_file
from tiny_gguf import write_gguf

READ_LINE = "reading its metadata"


@pytest.fixture
def run_dir(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    gguf_cache.keep_in(directory)
    gguf_file.forget()
    yield directory
    gguf_cache.keep_in(None)
    gguf_file.forget()


def reads(caplog) -> int:
    return sum(READ_LINE in r.getMessage() for r in caplog.records)


def opened_again(path):
    gguf_file.forget()   # as another process: nothing of the file in memory
    return gguf_file.open_gguf(path)


def kept_copy(run_dir):
    [copy] = run_dir.glob("gguf-*.json")
    return copy


def assert_is_the_files(metadata, path):
    reader = gguf.GGUFReader(path)
    assert metadata.values == {key: field.contents() for key, field in reader.fields.items()}
    assert [t.name for t in metadata.tensors] == [t.name for t in reader.tensors]
    for kept, read in zip(metadata.tensors, reader.tensors):
        data = metadata.data(kept)
        assert kept.tensor_type == read.tensor_type and data.dtype == read.data.dtype
        assert data.shape == read.data.shape and np.array_equal(data, read.data)


def test_the_kept_copy_is_what_the_reader_reads_and_spares_the_read(tmp_path, run_dir, caplog):
    caplog.set_level(logging.INFO, "mcpd.gguf")
    path = write_gguf(tmp_path, "llama_wide", "Q4_K_M")   # Q4_K, Q6_K and F32 tensors
    gguf_file.open_gguf(path)
    assert reads(caplog) == 1 and kept_copy(run_dir).stat().st_mode & 0o777 == 0o600
    assert_is_the_files(opened_again(path), path)
    assert reads(caplog) == 1


def set_context_length(path, length: int) -> None:
    """Edit the file in place: the same size, and its modification time put back."""
    before = os.stat(path)
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["llama.context_length"].parts[-1][0] = length
    reader.data.flush()
    del reader
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size


def test_a_file_changed_in_place_is_read_again(tmp_path, run_dir, caplog):
    caplog.set_level(logging.INFO, "mcpd.gguf")
    path = write_gguf(tmp_path, "llama", "Q8_0")
    assert gguf_file.open_gguf(path).value("llama.context_length") == 128
    set_context_length(path, 100)
    assert opened_again(path).value("llama.context_length") == 100
    assert reads(caplog) == 2
    assert opened_again(path).value("llama.context_length") == 100   # and kept anew
    assert reads(caplog) == 2


def rewritten(copy, edit) -> None:
    """The kept copy with its body edited by `edit`, its digests made to match again."""
    head_line, _, body = copy.read_bytes().partition(b"\n")
    head, body = json.loads(head_line), json.loads(body)
    edit(body)
    body = json.dumps(body).encode()
    head["body_sha256"] = hashlib.sha256(body).hexdigest()
    copy.write_bytes(json.dumps(head).encode() + b"\n" + body)


def edited_tokens(copy, _other):
    text = copy.read_bytes()
    copy.write_bytes(text.replace(b'"<s>"', b'"<S>"', 1))


def another_models(copy, other):
    copy.write_bytes(other.read_bytes())


def a_link(copy, other):
    copy.unlink()
    copy.symlink_to(other)


def garbage(copy, _other):
    copy.write_bytes(b"{" * 100_000)


def nested_deep(copy, _other):
    head_line, _, body = copy.read_bytes().partition(b"\n")
    body = b"[" * 100_000 + b"]" * 100_000
    head = json.loads(head_line)
    head["body_sha256"] = hashlib.sha256(body).hexdigest()
    copy.write_bytes(json.dumps(head).encode() + b"\n" + body)


def tensor_past_the_end(copy, _other):
    rewritten(copy, lambda body: body["tensors"][0].__setitem__(3, 1 << 40))


def unknown_tensor_type(copy, _other):
    rewritten(copy, lambda body: body["tensors"][0].__setitem__(1, 99))


def values_not_a_map(copy, _other):
    rewritten(copy, lambda body: body.__setitem__("values", []))


@pytest.mark.parametrize("tamper", [edited_tokens, another_models, a_link, garbage, nested_deep, tensor_past_the_end,
                                    unknown_tensor_type, values_not_a_map])
def test_a_kept_copy_that_is_not_the_files_is_never_used(tmp_path, run_dir, caplog, tamper):
    caplog.set_level(logging.INFO, "mcpd.gguf")
    other = write_gguf(tmp_path / "other", "qwen2", "F32")
    gguf_file.open_gguf(other)
    others_copy = kept_copy(run_dir)
    path = write_gguf(tmp_path, "llama", "Q8_0")
    gguf_file.open_gguf(path)
    [copy] = set(run_dir.glob("gguf-*.json")) - {others_copy}
    tamper(copy, others_copy)
    assert_is_the_files(opened_again(path), path)
    assert reads(caplog) == 3
    assert any("is not used" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
