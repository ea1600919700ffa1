"""What CPU a benchmark ran on: vendor, model, microarchitecture and the instruction-set extensions
that decide its matrix-product speed (AVX2, AVX-512, its BF16/FP16/VNNI parts, AMX).

Ratios against PyTorch differ from one CPU kind to another (MLAS and oneDNN use different kernels
per extension), so every result names its CPU and results are kept per ``kind``.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# the extensions that pick float32 / bfloat16 / float16 / int8 GEMM kernels, in /proc/cpuinfo's spelling
ISA = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
       "amx_int8"]
# (vendor, family, first model, last model) -> microarchitecture; AMD's from its family/model numbers, Intel's
# from the server parts' model numbers (family 6)
_MICROARCHITECTURES = [
    ("AuthenticAMD", 0x17, 0x00, 0x2F, "zen1"), ("AuthenticAMD", 0x17, 0x30, 0xFF, "zen2"),
    ("AuthenticAMD", 0x19, 0x00, 0x0F, "zen3"), ("AuthenticAMD", 0x19, 0x10, 0x1F, "zen4"),
    ("AuthenticAMD", 0x19, 0x20, 0x5F, "zen3"), ("AuthenticAMD", 0x19, 0x60, 0xAF, "zen4"),
    ("AuthenticAMD", 0x1A, 0x00, 0xFF, "zen5"),
    ("GenuineIntel", 6, 0x55, 0x55, "skylake-cascade-lake"), ("GenuineIntel", 6, 0x6A, 0x6C, "ice-lake"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "sapphire-rapids"), ("GenuineIntel", 6, 0xCF, 0xCF, "emerald-rapids"),
    ("GenuineIntel", 6, 0xAD, 0xAE, "granite-rapids"),
]
_VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}


def _cpuinfo(text: str | None = None) -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none: not Linux)."""
    if text is None:
        path = Path("/proc/cpuinfo")
        text = path.read_text() if path.exists() else ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def describe(cpuinfo: str | None = None) -> dict:
    """This machine's CPU: ``vendor``, ``model`` (its name), ``family`` / ``model_number``,
    ``microarchitecture`` (or None when unknown), ``cores`` (those this process may use), ``isa`` (the
    extensions of ``ISA`` it has) and ``kind``, a file-name slug for results of this CPU kind
    (``amd-zen4``, ``intel-sapphire-rapids``; vendor, family and model where the microarchitecture is
    unknown)."""
    fields = _cpuinfo(cpuinfo)
    vendor = fields.get("vendor_id", "")
    family = int(fields.get("cpu family", "0") or 0)
    number = int(fields.get("model", "0") or 0)
    flags = set(fields.get("flags", "").split())
    name = re.sub(r"\s+", " ", fields.get("model name", "")) or platform.processor() or platform.machine()
    micro = next((arch for v, f, low, high, arch in _MICROARCHITECTURES if v == vendor and f == family
                  and low <= number <= high), None)
    short = _VENDORS.get(vendor, re.sub(r"[^a-z0-9]+", "-", vendor.lower()) or platform.machine())
    kind = f"{short}-{micro}" if micro else f"{short}-family{family}-model{number}" if vendor else short
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"vendor": vendor, "model": name, "family": family, "model_number": number, "microarchitecture": micro,
            "cores": cores, "isa": [x for x in ISA if x in flags], "kind": kind}


def sentence(cpu: dict) -> str:
    """``AMD EPYC (AuthenticAMD, zen4: family 25 model 17), 2 cores; avx2, ... ; without avx512_fp16, amx``."""
    has_amx = any(x.startswith("amx_") for x in cpu["isa"])
    missing = [x for x in ISA if x not in cpu["isa"] and (has_amx or not x.startswith("amx_"))]
    if not has_amx:
        missing.append("AMX")
    arch = f"{cpu['microarchitecture']}: " if cpu["microarchitecture"] else ""
    return (f"{cpu['model']} ({cpu['vendor'] or 'vendor unknown'}, {arch}family {cpu['family']} model "
            f"{cpu['model_number']}), {cpu['cores']} cores; {', '.join(cpu['isa']) or 'no listed extension'}"
            + (f"; without {', '.join(missing)}" if missing else ""))


__all__ = ["ISA", "describe", "sentence"]
