"""dropless.machine, the one machine module: the CPU model read one way (x86, ARM and other
/proc/cpuinfo dialects), contention, and the record of where a number came from; and the plain
text table the benches, the planner and calibration print."""
from dropless import machine
from dropless.text_table import format_table

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480C
stepping\t: 8
"""
ARM = """processor\t: 0
BogoMIPS\t: 108.00
CPU implementer\t: 0x41

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""
MIPS = "system type\t\t: MT7621\ncpu model\t\t: MIPS 1004Kc V2.15\n"


def test_cpu_model_reads_each_cpuinfo_dialect():
    # 'model\t\t: 143' (the x86 model number) is not 'model name' and is skipped
    assert machine.parse_cpu_model(X86) == "Intel(R) Xeon(R) Platinum 8480C"
    assert machine.parse_cpu_model(ARM) == "Raspberry Pi 4 Model B Rev 1.4"
    assert machine.parse_cpu_model(MIPS) == "MIPS 1004Kc V2.15"
    assert machine.parse_cpu_model("processor\t: 0\nBogoMIPS\t: 108.00\n") is None


def test_cpu_model_falls_back_without_cpuinfo(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text(X86)
    assert machine.cpu_model(str(fake)) == "Intel(R) Xeon(R) Platinum 8480C"
    fallback = machine.cpu_model(str(tmp_path / "missing"))
    assert isinstance(fallback, str) and fallback


def test_machine_info_names_the_cpu_the_cpu_peak_is_keyed_by():
    info = machine.machine_info()
    assert info["cpu"] == machine.cpu_model()
    assert {"git_commit", "jax", "jaxlib", "cores", "platform", "device_kind",
            "device_count"} <= set(info)


def test_busy_fraction_is_a_share():
    busy = machine.busy_fraction(0.05)
    assert busy is None or 0.0 <= busy <= 1.0


def test_format_table_aligns_and_rounds():
    rows = [{"a": 1.23456, "b": "x"}, {"a": 1234.5}]
    assert format_table(rows, ["a", "b"]).splitlines() == ["   a  b", "1.23  x", "1234   "]


# run in a fresh interpreter: what earlier tests left in a pytest worker's process (its heap, its
# memory mappings) can change where malloc finds 64 MiB (a worker that had run ~1,200 tests
# counted 0 faults a fresh call, while the test alone counts hundreds)
FRESH_FAULTS = """
import json
import numpy as np
from dropless import machine
kept = np.ones(1 << 24, np.float32)   # 64 MiB, touched once here
# a fresh 64 MiB buffer a call: over glibc's largest mmap threshold (32 MiB), so each call
# maps new pages and faults them in (>= 32 faults even in 2 MiB pages)
print(json.dumps(machine.time_interleaved({"fresh": lambda: np.ones(1 << 24, np.float32).sum(),
                                           "kept": lambda: kept.sum()}, repeats=3)))
"""


def test_time_interleaved_counts_the_fresh_memory_a_call_touches():
    import json
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", FRESH_FAULTS], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout.splitlines()[-1])
    assert stats["fresh"]["page_faults"] >= 32, stats
    assert stats["kept"]["page_faults"] < 16, stats
    assert stats["fresh"]["min_ms"] <= stats["fresh"]["median_ms"] <= stats["fresh"]["max_ms"]


def test_time_interleaved_rotates_which_candidate_runs_first_each_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    machine.time_interleaved(fns, repeats=4, warmup=1)
    warm, timed = calls[:3], calls[3:]
    assert warm == ["a", "b", "c"]
    assert timed == list("abc" "bca" "cab" "abc")
    # every candidate timed `repeats` times, and none always after the same other one
    assert all(timed.count(n) == 4 for n in "abc")
    before = {n: {timed[i - 1] for i in range(1, len(timed)) if timed[i] == n} for n in "abc"}
    assert all(len(prev) > 1 for prev in before.values()), before
