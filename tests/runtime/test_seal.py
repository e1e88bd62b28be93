"""The seal on run-folder caches (cat/runtime/seal.py): a key of the user's own, made once and kept private; a seal
holds for its content under that key only; a key file someone else could read or made is refused by name."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat

import pytest

from cat.errors import OutputError
from cat.runtime import seal as sealing

_FORK = multiprocessing.get_context("fork")


@pytest.fixture
def key_at(tmp_path, monkeypatch):
    """Seals under a key file in ``tmp_path`` (made on first use), the process's cached key forgotten before and
    after."""
    path = tmp_path / "keys" / "seal.key"
    monkeypatch.setenv("CAT_SEAL_KEY_FILE", str(path))
    sealing._key.cache_clear()
    yield path
    sealing._key.cache_clear()


def test_the_key_is_made_once_private_and_a_seal_holds_only_for_its_content_under_it(key_at):
    content = {"train-000000.tar": {"images": 10, "labels": {"0": 4, "1": 6}}}
    tag = sealing.seal(content)
    assert stat.S_IMODE(key_at.stat().st_mode) == 0o600 and key_at.stat().st_size == 32
    assert sealing.seal_holds(content, tag)
    assert not sealing.seal_holds({**content, "train-000000.tar": {"images": 10, "labels": {"0": 6, "1": 4}}}, tag)
    assert not sealing.seal_holds(content, tag.upper()) and not sealing.seal_holds(content, None)
    sealing._key.cache_clear()  # a later process reads the same key: the seal still holds
    assert sealing.seal_holds(content, tag)
    key_at.unlink()  # another user's key (or one made anew): the old seal no longer holds
    sealing._key.cache_clear()
    assert not sealing.seal_holds(content, tag)


def _seal_of_empty(queue) -> None:
    queue.put(sealing.seal({}))


def test_processes_that_make_the_key_at_once_share_one(key_at):
    queue = _FORK.Queue()
    workers = [_FORK.Process(target=_seal_of_empty, args=(queue,)) for _ in range(6)]
    for worker in workers:
        worker.start()
    tags = {queue.get(timeout=60) for _ in workers}
    for worker in workers:
        worker.join(60)
    assert len(tags) == 1 and [p.name for p in key_at.parent.iterdir()] == ["seal.key"]


@pytest.mark.parametrize("planted", ["readable by others", "a symbolic link", "a FIFO", "too short"])
def test_a_key_file_that_is_not_private_is_refused_by_name(key_at, tmp_path, planted):
    key_at.parent.mkdir()
    if planted == "readable by others":
        key_at.write_bytes(os.urandom(32))
        key_at.chmod(0o644)
    elif planted == "a symbolic link":
        (tmp_path / "elsewhere").write_bytes(os.urandom(32))
        key_at.symlink_to(tmp_path / "elsewhere")
    elif planted == "a FIFO":
        os.mkfifo(key_at, 0o600)
    else:
        key_at.write_bytes(b"short")
        key_at.chmod(0o600)
    if planted == "a symbolic link":  # not read through: the process seals with a key of its own, as without a home
        _seals_with_its_own_key()
        return
    match = {"readable by others": "readable by others", "a FIFO": "not a regular file", "too short": "5 bytes"}
    with pytest.raises(OutputError, match=rf"seal key {key_at} is .*{match[planted]}.*delete it"):
        sealing.seal({})


def test_where_no_key_file_can_be_made_the_process_seals_with_a_key_of_its_own(key_at, monkeypatch):
    """A home that cannot hold the key (here its folder's place is taken by a file): slower (the next process
    rebuilds the caches), never wrong."""
    key_at.parent.write_text("a file where the key's folder would be")
    _seals_with_its_own_key()


def _seals_with_its_own_key() -> None:
    logger = logging.getLogger("cat.data")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        tag = sealing.seal({})
    finally:
        logger.removeHandler(handler)
    assert sealing.seal_holds({}, tag)
    assert any("a key of its own" in record.getMessage() for record in records)
    sealing._key.cache_clear()  # the next process: another key, the seal does not hold
    assert not sealing.seal_holds({}, tag)
