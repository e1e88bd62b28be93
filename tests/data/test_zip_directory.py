"""cat.data.zip_directory against Python's zipfile on archives zipfile writes: every method, ZIP64 sizes and
offsets, names in UTF-8 and in cp437, data before the archive; and local headers that lie are refused."""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import pytest

from cat.data.zip_directory import read_directory, read_member

_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)


def _archive(path, monkeypatch, zip64: bool = False, prefix: bytes = b"") -> dict[str, bytes]:
    """An archive of members in every method (with ``zip64``: every size and offset in its ZIP64 field, as an
    archive past 4 GiB has them), after ``prefix``; the members' contents by name."""
    rng = np.random.default_rng(0)
    contents = {}
    for i in range(12):
        name = ["plain/a.jpg", "ü/naïve.png", "sub/dir/x.bin"][i % 3].replace(".", f"{i}.")
        contents[name] = rng.integers(0, 4, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
    if zip64:
        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 0)
    buffer = io.BytesIO()
    buffer.write(prefix)
    with zipfile.ZipFile(buffer, "a" if prefix else "w") as z:
        for i, (name, data) in enumerate(contents.items()):
            z.writestr(zipfile.ZipInfo(name), data, compress_type=_METHODS[i % 4])
        z.writestr(zipfile.ZipInfo("cp437-ä.txt".encode().decode("cp437")), b"x")  # stored as cp437, no UTF-8 flag
    path.write_bytes(buffer.getvalue())
    return contents


@pytest.mark.parametrize("zip64", [False, True], ids=["zip32", "zip64"])
@pytest.mark.parametrize("prefix", [b"", b"#!/bin/sh\nexit 0\n" * 40], ids=["bare", "prefixed"])
def test_the_directory_and_every_member_as_zipfile_reads_them(tmp_path, monkeypatch, zip64, prefix):
    path = tmp_path / "a.zip"
    _archive(path, monkeypatch, zip64, prefix)
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        infos = z.infolist()
        entries = read_directory(f)
        assert entries.names == [info.filename.encode("utf-8") for info in infos]
        if zip64:  # the fields really were ZIP64's
            assert any(info.extra.startswith(b"\x01\x00") for info in infos)
        for i, info in enumerate(infos):
            facts = {field: int(values[i]) for field, values in entries.arrays.items()}
            assert (facts["sizes"], facts["compressed_sizes"], facts["crcs"], facts["methods"]) == (
                info.file_size,
                info.compress_size,
                info.CRC,
                info.compress_type,
            )
            assert facts["header_offsets"] == info.header_offset  # from the file's start, the prefix counted
            fields = ("header_offsets", "compressed_sizes", "sizes", "crcs", "methods", "flags")
            data = read_member(f.fileno(), entries.names[i], *(facts[k] for k in fields))
            assert data == z.read(info)


def test_a_local_header_that_names_another_member_or_is_none_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "a.zip"
    _archive(path, monkeypatch)
    with open(path, "rb") as f:
        entries = read_directory(f)
        facts = [int(entries.arrays[k][1]) for k in ("header_offsets", "compressed_sizes", "sizes", "crcs")]
        facts += [int(entries.arrays[k][1]) for k in ("methods", "flags")]
        with pytest.raises(zipfile.BadZipFile, match="names another member"):
            read_member(f.fileno(), entries.names[0], *facts)
        with pytest.raises(zipfile.BadZipFile, match="no local header at byte 7"):
            read_member(f.fileno(), entries.names[1], 7, *facts[1:])
        wrong_crc = facts[:3] + [facts[3] ^ 1] + facts[4:]
        with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
            read_member(f.fileno(), entries.names[1], *wrong_crc)


def test_a_cut_or_foreign_file_is_no_directory(tmp_path, monkeypatch):
    path = tmp_path / "a.zip"
    _archive(path, monkeypatch)
    data = path.read_bytes()
    for cut in (data[: len(data) // 2], b"not a zip at all" * 10, b""):
        path.write_bytes(cut)
        with open(path, "rb") as f, pytest.raises(zipfile.BadZipFile):
            read_directory(f)
    end = data.rfind(b"PK\x05\x06")
    lying = data[: end + 10] + b"\xff\xff" + data[end + 12 :]
    path.write_bytes(lying)  # the end record claims 65,535 entries
    with open(path, "rb") as f, pytest.raises(zipfile.BadZipFile):
        read_directory(f)
    assert os.path.getsize(path) == len(data)
