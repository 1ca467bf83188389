"""What this CPU computes natively, read at run time (machines differ: AVX2 only, AVX-512 with VNNI and BF16,
AMX): the precision plan and the int8 quantiser ask here, and never assume."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

_FLAGS = ("avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni", "avx_vnni", "avx512f", "avx2")


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU flags that decide precision (from /proc/cpuinfo; empty where it is absent) plus torch's
    ``cpu_capability:<name>`` (the widest vector ISA its kernels dispatch to)."""
    flags: set[str] = set()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split()) & set(_FLAGS)
                break
    except OSError:
        pass
    return frozenset(flags | {f"cpu_capability:{torch.backends.cpu.get_cpu_capability()}"})


def native_int8_dot(features: frozenset[str]) -> bool:
    """Whether the CPU multiplies int8 without 16-bit saturation (VNNI or AMX); without it (plain AVX2),
    onnxruntime's u8 x s8 kernels can saturate unless weights keep to 7 bits."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & features)


def native_bf16(features: frozenset[str]) -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & features)


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what the platform says)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
