"""A zip archive's central directory read into arrays, and one member read by its offset.

Python's ``zipfile`` makes a ``ZipInfo`` object per member (about 850 bytes each: a gigabyte for ImageNet's
1.28 M), and every process that opens the archive reads the directory again. Here the directory is read once,
its fixed fields gathered with numpy (the local header's offset, both sizes, the CRC, the method and flags), ZIP64
sizes and offsets taken from their extra fields, and a member is then read with two ``pread`` calls from any
process: its local header (checked to be one, naming the same member) and its bytes, inflated by ``zipfile``'s
own decompressors with their size and CRC checks. Data before the archive (a self-extracting stub) is allowed, as
``zipfile`` allows it.
"""

from __future__ import annotations

import array
import io
import os
import struct
import zipfile
from typing import BinaryIO

import numpy as np

__all__ = ["DirectoryEntries", "read_directory", "read_member", "LOCAL_HEADER_BYTES"]

_END = struct.Struct("<4s4H2LH")  # end of central directory: 22 bytes, then a comment of up to 64 KiB
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCAL = struct.Struct("<4s2B4HL2L2H")  # a member's local header, before its name and extra field
LOCAL_HEADER_BYTES = _LOCAL.size
_ENTRY_BYTES = 46
# A central directory entry's fixed fields; the name, extra field and comment follow.
_ENTRY = np.dtype(
    [
        ("signature", "<u4"),
        ("made_by", "<u2"),
        ("needed", "<u2"),
        ("flags", "<u2"),
        ("method", "<u2"),
        ("time", "<u2"),
        ("date", "<u2"),
        ("crc", "<u4"),
        ("compressed", "<u4"),
        ("size", "<u4"),
        ("name_bytes", "<u2"),
        ("extra_bytes", "<u2"),
        ("comment_bytes", "<u2"),
        ("disk", "<u2"),
        ("internal", "<u2"),
        ("external", "<u4"),
        ("offset", "<u4"),
    ]
)
_UTF8_FLAG = 0x800
_GATHER = 1 << 16
_ZIP64 = 0xFFFFFFFF


class DirectoryEntries:
    """The members of an archive, in directory order: ``names`` (UTF-8 bytes, as ``zipfile`` decodes them) and
    arrays ``header_offsets``, ``compressed_sizes``, ``sizes``, ``crcs``, ``methods``, ``flags``."""

    def __init__(self, names: list[bytes], arrays: dict[str, np.ndarray]) -> None:
        self.names, self.arrays = names, arrays


def member_name(raw: bytes, flags: int) -> bytes:
    """A stored name as UTF-8 bytes: as it is when flagged UTF-8 (or ASCII), else read as cp437, as zipfile does."""
    return raw if flags & _UTF8_FLAG or raw.isascii() else raw.decode("cp437").encode("utf-8")


def _end_record(f: BinaryIO, size: int) -> tuple[int, int, int, int]:
    """``(entries, directory bytes, directory offset, where the directory record starts)`` of the archive."""
    tail_start = max(0, size - _END.size - 0xFFFF)
    tail = os.pread(f.fileno(), size - tail_start, tail_start)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _END.size > len(tail):
        raise zipfile.BadZipFile("no end of central directory record")
    _, _, _, _, entries, directory_bytes, directory_offset, _ = _END.unpack_from(tail, at)
    record = tail_start + at
    locator_at = at - _END64_LOCATOR.size
    if locator_at >= 0 and tail[locator_at : locator_at + 4] == b"PK\x06\x07":  # ZIP64: its own record says
        _, _, end64_offset, _ = _END64_LOCATOR.unpack_from(tail, locator_at)
        record = tail_start + locator_at - _END64.size
        end64 = os.pread(f.fileno(), _END64.size, record)
        if len(end64) != _END64.size or end64[:4] != b"PK\x06\x06":
            raise zipfile.BadZipFile("a ZIP64 locator without its end of central directory record")
        _, _, _, _, _, _, _, entries, directory_bytes, directory_offset = _END64.unpack(end64)
    return entries, directory_bytes, directory_offset, record


def read_directory(f: BinaryIO) -> DirectoryEntries:
    """Every member of the open archive ``f`` (module doc); a damaged directory is a ``zipfile.BadZipFile``."""
    size = os.fstat(f.fileno()).st_size
    entries, directory_bytes, directory_offset, record = _end_record(f, size)
    prefix = record - directory_bytes - directory_offset  # bytes before the archive proper
    if prefix < 0 or entries * _ENTRY_BYTES > directory_bytes:
        raise zipfile.BadZipFile(f"a central directory of {entries} entries in {directory_bytes} bytes at {record}")
    directory = os.pread(f.fileno(), directory_bytes, directory_offset + prefix)
    if len(directory) != directory_bytes:
        raise zipfile.BadZipFile("the central directory runs past the file's end")
    lengths = struct.Struct("<HHH").unpack_from
    starts, at = array.array("q"), 0
    for _ in range(entries):  # entries are variable-length: walked once, the fixed fields gathered below
        if at + _ENTRY_BYTES > directory_bytes:
            raise zipfile.BadZipFile("the central directory ends inside an entry")
        starts.append(at)
        name_bytes, extra_bytes, comment_bytes = lengths(directory, at + 28)
        at += _ENTRY_BYTES + name_bytes + extra_bytes + comment_bytes
    if at > directory_bytes:
        raise zipfile.BadZipFile("the central directory ends inside an entry")
    where = np.frombuffer(starts, dtype=np.int64)
    raw, span = np.frombuffer(directory, dtype=np.uint8), np.arange(_ENTRY_BYTES)
    fixed = np.empty(len(where), dtype=_ENTRY)
    for lo in range(0, len(where), _GATHER):  # in slices: the gather's index array is 8 bytes per byte gathered
        fixed[lo : lo + _GATHER] = raw[where[lo : lo + _GATHER, None] + span].view(_ENTRY).reshape(-1)
    if np.any(fixed["signature"] != 0x02014B50):
        raise zipfile.BadZipFile("a central directory entry without its signature")
    names = [
        member_name(directory[s + _ENTRY_BYTES : s + _ENTRY_BYTES + n], flags)
        for s, n, flags in zip(starts, fixed["name_bytes"].tolist(), fixed["flags"].tolist(), strict=True)
    ]
    arrays = {
        "header_offsets": fixed["offset"].astype(np.int64),
        "compressed_sizes": fixed["compressed"].astype(np.int64),
        "sizes": fixed["size"].astype(np.int64),
        "crcs": fixed["crc"].copy(),
        "methods": fixed["method"].copy(),
        "flags": fixed["flags"].copy(),
    }
    wide = np.flatnonzero((fixed["size"] == _ZIP64) | (fixed["compressed"] == _ZIP64) | (fixed["offset"] == _ZIP64))
    for i in wide.tolist():  # ZIP64: the 8-byte values, in this order, for each field that reads 0xFFFFFFFF
        extra_at = starts[i] + _ENTRY_BYTES + int(fixed["name_bytes"][i])
        values = _zip64_extra(directory[extra_at : extra_at + int(fixed["extra_bytes"][i])])
        for field in ("sizes", "compressed_sizes", "header_offsets"):
            if arrays[field][i] == _ZIP64:
                if not values:
                    raise zipfile.BadZipFile(f"entry {names[i]!r}: a ZIP64 size or offset without its extra field")
                arrays[field][i] = values.pop(0)
    arrays["header_offsets"] += prefix
    return DirectoryEntries(names, arrays)


def _zip64_extra(extra: bytes) -> list[int]:
    """The 8-byte values of an extra field's ZIP64 record (id 1)."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            body = extra[at + 4 : at + 4 + length]
            return list(struct.unpack_from(f"<{len(body) // 8}Q", body))
        at += 4 + length
    return []


def read_member(
    fd: int, name: bytes, header_offset: int, compressed: int, size: int, crc: int, method: int, flags: int
) -> bytes:
    """One member's bytes, read from its local header at ``header_offset`` of the open archive ``fd``, inflated and
    checked against the directory's ``size`` and ``crc`` (``zipfile``'s decompressors). A local header that is no
    header, or names another member, is a ``zipfile.BadZipFile``."""
    head = os.pread(fd, _LOCAL.size, header_offset)
    if len(head) != _LOCAL.size or head[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local header at byte {header_offset}")
    fields = _LOCAL.unpack(head)
    local_flags, name_bytes, extra_bytes = fields[3], fields[10], fields[11]
    start = header_offset + _LOCAL.size
    if member_name(os.pread(fd, name_bytes, start), local_flags) != name:
        raise zipfile.BadZipFile(f"the local header at byte {header_offset} names another member")
    data = os.pread(fd, compressed, start + name_bytes + extra_bytes)
    if len(data) != compressed:
        raise zipfile.BadZipFile("the member runs past the file's end")
    info = zipfile.ZipInfo(name.decode("utf-8", "replace"))
    info.compress_type, info.compress_size, info.file_size, info.CRC = method, compressed, size, crc
    info.flag_bits = flags
    with zipfile.ZipExtFile(io.BytesIO(data), "r", info) as member:
        return member.read()
