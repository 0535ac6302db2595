"""The CPU class every figure names (butter/cpu.py), read from /proc/cpuinfo texts."""

from __future__ import annotations

from pathlib import Path

import pytest

from butter.cpu import parse_cpuinfo, this_cpu

# The first processor's lines of three real machines' /proc/cpuinfo (trimmed flags).
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes avx f16c avx2 bmi2
"""
XEON_VNNI = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: sse2 fma f16c avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni amx_int8 amx_tile
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp i8mm
"""


@pytest.mark.parametrize(("text", "isa", "flags", "model"), [
    (EPYC_AVX2, "AVX2", ("avx2", "fma", "f16c"), "AMD EPYC"),
    (XEON_VNNI, "AVX512-VNNI",
     ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "amx_int8"),
     "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"),
    (GRAVITON, "NEON", ("asimd", "asimddp", "i8mm"), None),
])
def test_the_class_is_read_from_the_flags(text: str, isa: str, flags: tuple[str, ...],
                                          model: str | None) -> None:
    cpu = parse_cpuinfo(text, cores=2)
    assert (cpu.isa, cpu.flags, cpu.cores) == (isa, flags, 2)
    if model is not None:
        assert cpu.model == model
        assert cpu.label == f"{model}, 2 cores, {isa} ({' '.join(flags)})"


def test_avx512_without_vnni_is_the_avx2_class() -> None:
    text = EPYC_AVX2.replace("avx2", "avx2 avx512f avx512bw")
    assert parse_cpuinfo(text, cores=4).isa == "AVX2"


def test_this_machine_is_read_from_its_own_cpuinfo() -> None:
    cpu = this_cpu()
    text = Path("/proc/cpuinfo").read_text()
    assert cpu == parse_cpuinfo(text, cores=cpu.cores) and cpu.cores >= 1
    assert ("avx2" in text.split()) == ("avx2" in cpu.flags)
    assert cpu.as_dict()["isa"] == cpu.isa
