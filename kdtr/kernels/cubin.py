"""Reading a cubin (an ELF64 file) without a GPU: the initial value of a global int array.

The launch geometry a kernel exports (``kdtr_launch``, the flash kernels' config arrays) sits in
the cubin as an initialised ``extern "C" __constant__`` array. On a GPU kdtr reads it from the
loaded module; `kdtr compile` reads it from the file, so that a build's dynamic shared memory can
be held against each arch's limit on a machine with no GPU at all.
"""

from __future__ import annotations

import struct

SHT_SYMTAB, SHT_NOBITS = 2, 8
_SECTION = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, addralign, entsize
_SYMBOL = struct.Struct("<IBBHQQ")  # name, info, other, shndx, value, size


class CubinError(ValueError):
    """Not a little-endian ELF64 cubin, or a symbol it does not hold as asked."""


def _sections(elf: bytes) -> list[tuple]:
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise CubinError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    if shentsize != _SECTION.size or shoff + shnum * shentsize > len(elf):
        raise CubinError("truncated or unexpected section header table")
    return [_SECTION.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]


def _cstr(elf: bytes, start: int) -> str:
    return elf[start:elf.index(b"\0", start)].decode("ascii", "replace")


def global_ints(elf: bytes, symbol: str, n: int) -> tuple[int, ...] | None:
    """The first n int32 of global ``symbol``'s initial value; None when the cubin has no such
    symbol (a kernel file without kdtr_launch). Zero-initialised storage reads as zeros."""
    sections = _sections(elf)
    for sec in (s for s in sections if s[1] == SHT_SYMTAB):
        strtab = sections[sec[6]]
        for off in range(sec[4], sec[4] + sec[5], _SYMBOL.size):
            name, _, _, shndx, value, size = _SYMBOL.unpack_from(elf, off)
            if _cstr(elf, strtab[4] + name) != symbol:
                continue
            if size < 4 * n or not 0 < shndx < len(sections):
                raise CubinError(f"{symbol}: {size} bytes in section {shndx}, asked for {n} ints")
            home = sections[shndx]
            if home[1] == SHT_NOBITS:
                return (0,) * n
            return struct.unpack_from(f"<{n}i", elf, home[4] + value)
    return None
