"""Read and rename the dynamic section of a 64-bit little-endian ELF shared library.

Just enough for :mod:`mlx_trio.engine._blas`: the ``DT_NEEDED`` names of a library and a copy of it
under a shorter ``DT_SONAME`` (the new name is written over the old one in the string table, so
nothing moves). Works from the program headers, which every loadable library has.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_SONAME = 0, 1, 5, 14


@dataclass(frozen=True)
class Dynamic:
    """Where a library's dynamic strings are, and which of them name what."""

    strtab: int  # file offset of the dynamic string table
    needed: tuple[int, ...]  # string offsets of the DT_NEEDED names
    soname: int | None  # string offset of DT_SONAME


def _check_header(data: bytes) -> None:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")


def _segments(data: bytes) -> list[tuple[int, int, int, int]]:
    """(type, file offset, virtual address, file size) of each program header."""
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    segments = []
    for index in range(phnum):
        p_type, _, offset, vaddr, _, filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + index * phentsize
        )
        segments.append((p_type, offset, vaddr, filesz))
    return segments


def _file_offset(segments: list[tuple[int, int, int, int]], address: int) -> int:
    for p_type, offset, vaddr, filesz in segments:
        if p_type == _PT_LOAD and vaddr <= address < vaddr + filesz:
            return offset + address - vaddr
    raise ValueError(f"address {address:#x} is in no loaded segment")


def dynamic(data: bytes) -> Dynamic:
    """The dynamic section's string table, DT_NEEDED and DT_SONAME entries."""
    _check_header(data)
    segments = _segments(data)
    section = next((s for s in segments if s[0] == _PT_DYNAMIC), None)
    if section is None:
        raise ValueError("no dynamic section")
    _, offset, _, size = section
    strtab_address, needed, soname = None, [], None
    for position in range(offset, offset + size, 16):
        tag, value = struct.unpack_from("<qQ", data, position)
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED:
            needed.append(value)
        elif tag == _DT_STRTAB:
            strtab_address = value
        elif tag == _DT_SONAME:
            soname = value
    if strtab_address is None:
        raise ValueError("no dynamic string table")
    return Dynamic(_file_offset(segments, strtab_address), tuple(needed), soname)


def _string(data: bytes, position: int) -> str:
    return data[position : data.index(b"\0", position)].decode()


def needed(data: bytes) -> list[str]:
    """The library's DT_NEEDED names, in order."""
    table = dynamic(data)
    return [_string(data, table.strtab + name) for name in table.needed]


def soname(data: bytes) -> str | None:
    """The library's DT_SONAME, if it has one."""
    table = dynamic(data)
    return None if table.soname is None else _string(data, table.strtab + table.soname)


def with_soname(data: bytes, name: str) -> bytes:
    """A copy of the library whose DT_SONAME reads ``name`` (no longer than the old one)."""
    table = dynamic(data)
    if table.soname is None:
        raise ValueError("the library has no DT_SONAME")
    position = table.strtab + table.soname
    old = _string(data, position)
    new = name.encode()
    if len(new) > len(old.encode()):
        raise ValueError(f"{name!r} is longer than the SONAME {old!r}")
    patched = bytearray(data)
    patched[position : position + len(new) + 1] = new + b"\0"
    if needed(patched) != needed(data):  # another name shared the old one's bytes
        raise ValueError("renaming the SONAME would change a DT_NEEDED name")
    return bytes(patched)
