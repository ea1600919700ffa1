"""Zero the GPU code a CUDA library carries for GPUs other than the ones named, so that it compresses to a fraction.

onnxruntime-gpu's CUDA provider library (``libonnxruntime_providers_cuda.so``, 271 MB in 1.31.1) holds each kernel
compiled for several GPU architectures (sm_75, 80, 86, 89, 90 and 120): 208 MiB of its ``.nv_fatbin`` section. A
GPU runs only the machine code (cubin) of its own major architecture at or below its own minor one (sm_80 code
runs on sm_86, none of it on sm_90), or PTX of an architecture at or below its own, compiled when loaded. The
CUDA driver reads a fat binary's entry headers and loads the one entry it picks. This script keeps every entry
that some named architecture could run and fills the payload of every other entry with zeros, in place: the
file keeps its size and layout (every offset and header unchanged), and zeros cost nothing once compressed.
Kept to sm_90 (H100, H200), the whole onnxruntime-gpu package packs with xz into 57 MiB instead of 193.

Usage: ``python benchmarks/fatbin_prune.py LIBRARY --keep 90 [--keep 80 ...]`` (rewrites LIBRARY; ``--dry-run``
only prints what it would zero). It refuses a file whose fat binaries it cannot walk from end to end, leaving it
as it was.
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections import Counter
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
SECTION = b".nv_fatbin"
PTX, CUBIN = 1, 2
_FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
_ENTRY_HEADER = struct.Struct("<HHIQ")  # kind, version, header size, payload size (then: ..., the arch at byte 28)
_ARCH_OFFSET = 28


class FatbinError(ValueError):
    """The file is no 64-bit little-endian ELF with a fat-binary section this script can walk."""


def fatbin_section(data: bytes | bytearray) -> tuple[int, int]:
    """The file offset and size of the ELF's ``.nv_fatbin`` section."""
    if data[:6] != b"\x7fELF\x02\x01":
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(index: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + index * shentsize)
        return name, offset, size

    _, names_offset, _ = section(shstrndx)
    for index in range(shnum):
        name, offset, size = section(index)
        start = names_offset + name
        if data[start:data.index(b"\0", start)] == SECTION:
            return offset, size
    raise FatbinError("no .nv_fatbin section: no GPU code to prune")


def entries(data: bytes | bytearray, offset: int, size: int) -> list[tuple[int, int, int, int]]:
    """Every fat-binary entry of the section: ``(payload offset, payload size, kind, arch)``.

    Raises ``FatbinError`` unless the fat binaries tile the section exactly (zero padding between them
    allowed) and each one's entries tile it.
    """
    found = []
    position, end = offset, offset + size
    while position < end:
        if end - position < _FATBIN_HEADER.size or struct.unpack_from("<I", data, position)[0] != FATBIN_MAGIC:
            if any(data[position:min(position + 8, end)]):
                raise FatbinError(f"unknown bytes at offset {position:#x} of the fat-binary section")
            position += 8  # alignment padding between two fat binaries
            continue
        _, _, header_size, entries_size = _FATBIN_HEADER.unpack_from(data, position)
        entry, stop = position + header_size, position + header_size + entries_size
        if stop > end:
            raise FatbinError(f"the fat binary at {position:#x} runs past the section")
        while entry < stop:
            kind, _, entry_header, payload = _ENTRY_HEADER.unpack_from(data, entry)
            arch, = struct.unpack_from("<I", data, entry + _ARCH_OFFSET)
            if kind not in (PTX, CUBIN) or entry + entry_header + payload > stop:
                raise FatbinError(f"an entry at {entry:#x} is neither PTX nor a cubin, or runs past its fat binary")
            found.append((entry + entry_header, payload, kind, arch))
            entry += entry_header + payload
        if entry != stop:
            raise FatbinError(f"the entries of the fat binary at {position:#x} do not end where it ends")
        position = stop
    return found


def runs_on(kind: int, arch: int, gpu: int) -> bool:
    """Whether an entry of ``kind`` built for ``arch`` (``90``: sm_90) can run on a GPU of architecture ``gpu``."""
    if kind == PTX:
        return arch <= gpu
    return arch // 10 == gpu // 10 and arch <= gpu


def prune(data: bytearray, keep: list[int]) -> Counter:
    """Zero, in ``data``, every entry no architecture of ``keep`` can run. Returns the bytes zeroed per
    ``(kind, arch)``."""
    zeroed: Counter = Counter()
    for payload_offset, payload, kind, arch in entries(data, *fatbin_section(data)):
        if not any(runs_on(kind, arch, gpu) for gpu in keep):
            data[payload_offset:payload_offset + payload] = bytes(payload)
            zeroed["PTX" if kind == PTX else "cubin", arch] += payload
    return zeroed


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("library", type=Path)
    parser.add_argument("--keep", type=int, action="append", required=True,
                        help="a GPU architecture to keep code for, as CUDA numbers it (90: sm_90, H100 and H200)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    data = bytearray(args.library.read_bytes())
    try:
        zeroed = prune(data, args.keep)
    except FatbinError as exc:
        print(f"fatbin_prune: {args.library}: {exc}; left as it was", file=sys.stderr)
        return 1
    for (kind, arch), size in sorted(zeroed.items()):
        print(f"{args.library.name}: {kind} sm_{arch}: {size / 2**20:.1f} MiB zeroed")
    if not args.dry_run:
        temporary = args.library.with_name(args.library.name + ".pruning")
        temporary.write_bytes(data)
        temporary.chmod(args.library.stat().st_mode)
        temporary.replace(args.library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
