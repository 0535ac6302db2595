"""How many threads a step computes on: the cores this process may use, less what other
programs use of them right now (no model here; the llama.cpp backend applies the size).

llama.cpp's threads, and butter's kernels among them, meet at a barrier after every
operation of a step, hundreds of times per token. A team thread that shares its core with
another busy program holds all the others at the next barrier until the scheduler hands it
a slice, so a team of N threads on N cores beside one busy program can run hundreds of
times slower than N - 1 threads would (docs/design/busy-machine.md, "A busy machine"). The team
must fit the cores that are free, not the cores that exist.

So after each step the backend adds the step's time to a window, and when the window has
lasted long enough it hands `TeamSizer.observe` a `CpuSample` (the kernel's accounting of
every program's time on this process's CPUs, this process's own time, and how long the
team's threads waited for a CPU) with the decode steps' pace (`StepPace`). The sizer
shrinks a crowded team that steps slower than a smaller one would, grows a smaller one
when a core is idle, and now and then tries the full team to see who yields.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs

# A window of steps long enough for the kernel's tick-granular accounting (a tick is 10 ms
# on most kernels; each CPU's count can be one tick off at either end of a window).
WINDOW_SECONDS = 0.25
WINDOW_SECONDS_PER_CPU = 0.02  # (more CPUs, more ticks of error in a window's sum)
# A window counts when steps ran for at least this share of it.
MIN_IN_STEPS_SHARE = 0.5
# The team is crowded when its threads waited for a CPU this long per second of steps (a
# thread sharing its core with one program of the same priority waits half the time).
CROWDED_WAIT = 0.2
# A crowded team shrinks when its steps ran slower than the smaller team's did by this
# much (the noise of one window).
MEASURED_MARGIN = 1.1
# A core counts as free when the others leave at least this much less than all of it.
SLACK_CORES = 0.5
# How long a smaller team runs before it tries the full one again, doubling (up to the
# most) each time the try finds the cores still taken.
RETRY_SECONDS = 2.0
MOST_RETRY_SECONDS = 16.0


@attrs.frozen
class CpuSample:
    """CPU time so far, at monotonic time `at`: `busy`, all programs' on the cores this
    process may use (seconds of one core, from /proc/stat); `ours`, this process's own;
    `waited`, its team threads' time runnable but waiting for a CPU (None where unknown)."""

    at: float
    busy: float
    ours: float
    waited: float | None = None


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


TICKS_PER_SECOND = _ticks_per_second()


def busy_seconds(stat_text: str, cpus: Iterable[int]) -> float | None:
    """Seconds the given CPUs spent on anything but idling, from a /proc/stat text (None
    when it lists none of them). Steal time counts: the hypervisor gave the core away."""
    wanted = {f"cpu{n}" for n in cpus}
    ticks, seen = 0, False
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        fields = [int(field) for field in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        ticks += user + nice + system + irq + softirq + steal
        seen = True
    return ticks / TICKS_PER_SECOND if seen else None


def waited_seconds(tids: Iterable[int], tasks: Path = Path("/proc/self/task")) -> float | None:
    """The threads' summed time on a run queue, waiting for a CPU (the second field of
    /proc/<tid>/schedstat, nanoseconds); None where one of them does not say."""
    total = 0
    for tid in tids:
        try:
            total += int((tasks / str(tid) / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return None
    return total / 1e9


def read_sample(cpus: frozenset[int], team: Iterable[int] = (),
                stat: Path = Path("/proc/stat")) -> CpuSample | None:
    """This moment's sample (`team`: the team's thread ids, where known), or None where
    the kernel does not say (no /proc/stat)."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    busy = busy_seconds(text, cpus)
    if busy is None:
        return None
    tids = list(team)
    return CpuSample(at=time.monotonic(), busy=busy, ours=time.process_time(),
                     waited=waited_seconds(tids) if tids else None)


@attrs.frozen
class Window:
    """One window's reading, and the team size it led to."""

    seconds: float
    others: float  # cores' worth of time other programs ran on ours
    waited: float | None  # the team's threads' wait for a CPU, per second of steps
    pace: float | None  # decode steps against the fastest of their size (StepPace)
    size: int


@attrs.frozen
class TeamStatus:
    """What /v1/server and /metrics show of the team (Backend.team)."""

    now: int  # threads the next step computes on
    most: int  # --threads
    fitted: bool  # the size follows the free cores (False: --no-fit-threads, or one thread)
    others_cores: float | None  # cores' worth other programs took in the latest window
    team_wait: float | None  # the team's wait for a CPU per second of steps, latest window
    step_time_ratio: float | None  # decode steps against the fastest of their size (1: quiet)
    shrinks: int  # times the full team was made smaller
    full_team_tries: int  # windows a smaller team ran full again, to see who yields
    pinned: bool = False  # one team thread per CPU (a team that fills them)
    pinning_off: str | None = None  # why the team is never pinned (None: it may be)


class TeamSizer:
    """The team size for the next steps, from CPU samples taken after steps.

    Three readings of a window decide. The team's own wait for a CPU says whether the team
    was crowded: a thread that shares its core with a program of the same priority waits
    about half the time, one beside a program at nice 19 almost never. A crowded team
    shrinks if its decode steps ran slower than the smaller team's last ran (or, never
    measured, would on a quiet machine): behind a thread that waits for its core, steps
    lose anything from a few percent to hundreds of times their time, depending on how the
    scheduler hands out slices. The other programs' CPU time says whether a smaller team
    has room to grow: it cannot tell a program that yields from one that does not (a
    program at nice 19 fills whatever core butter leaves idle), so a smaller team tries
    the full one every few seconds, and the same readings then tell. Without the team's
    thread ids (butter's team extension not built) the other programs' time decides."""

    def __init__(self, most: int, cpus: int, *, window: float | None = None,
                 retry: float = RETRY_SECONDS, most_retry: float = MOST_RETRY_SECONDS,
                 slack: float = SLACK_CORES, crowded: float = CROWDED_WAIT) -> None:
        """`most`: the threads asked for; `cpus`: how many CPUs this process may run on
        (the cores `CpuSample.busy` covers)."""
        self.most = max(1, most)
        self.cpus = max(1, cpus)
        self.window = window if window is not None else max(
            WINDOW_SECONDS, WINDOW_SECONDS_PER_CPU * self.cpus)
        self.size = self.most
        self.last: Window | None = None  # the latest window's reading
        self.windows = 0  # windows that counted (mostly in_steps)
        self.shrinks = 0  # times the full team was made smaller
        self.tries = 0  # windows a smaller team ran full again, to see who yields
        self._retry_base, self._most_retry = retry, most_retry
        self._slack, self._crowded = slack, crowded
        self._retry = retry
        self._start: CpuSample | None = None
        self._in_steps = 0.0  # seconds in steps since the window started
        self._smaller_since: float | None = None  # when the team last became smaller
        self._trying = False  # this window runs the full team to see who yields
        self._pace_at: dict[int, float] = {}  # decode steps' pace lately, by team size
        self._quiet_pace: float | None = None  # the full team's, uncrowded

    def fits(self, others: float) -> int:
        """The team that fits beside `others` cores' worth of other programs."""
        free = self.cpus - others
        return max(1, min(self.most, math.floor(free + self._slack)))

    def uncrowded(self, waited: float) -> int:
        """A team smaller than this one, which waited `waited` for a CPU per second of
        steps: a core given up per half second of waiting, at least one."""
        return max(1, self.size - max(1, round(2 * waited)))

    def due(self, now: float) -> bool:
        """Whether a sample taken now would close a window (reading one costs tens of
        microseconds: a step of a small model takes a few milliseconds)."""
        return self._start is None or now - self._start.at >= self.window

    def restart(self, sample: CpuSample | None) -> None:
        """Start a new window at `sample` (taken after the team changed: a window's
        readings must cover one team's threads)."""
        self._start, self._in_steps = sample, 0.0

    def observe(self, sample: CpuSample | None, in_steps: float,
                pace: Callable[[], float | None] = lambda: None) -> int:
        """The size for the steps after this sample (the same until a window closes).
        `in_steps`: seconds spent in steps since the previous call. A window that was
        mostly idle says nothing: a program at low priority takes every core butter
        leaves idle, and gives them back as soon as steps want them. `pace`: called when
        a window closes, how many times slower than their fastest its decode steps ran
        (StepPace.close_window; None: no decode step)."""
        if sample is None:
            return self.size
        start = self._start
        if start is None or sample.at < start.at:
            self._start, self._in_steps = sample, 0.0
            return self.size
        self._in_steps += in_steps
        seconds = sample.at - start.at
        if seconds < self.window:
            return self.size
        self._start, stepped, self._in_steps = sample, self._in_steps, 0.0
        if stepped < MIN_IN_STEPS_SHARE * seconds:
            return self.size
        others = max(0.0, (sample.busy - start.busy) - (sample.ours - start.ours)) / seconds
        waited = None
        if sample.waited is not None and start.waited is not None:
            waited = max(0.0, sample.waited - start.waited) / stepped
        slow = pace()
        self._close_window(sample.at, self._decide(others, waited, slow))
        self.last = Window(seconds=seconds, others=others, waited=waited, pace=slow,
                           size=self.size)
        self.windows += 1
        return self.size

    def _decide(self, others: float, waited: float | None, pace: float | None) -> int:
        """The size the window's readings call for."""
        if waited is None:
            return self.fits(others)
        size, crowded = self.size, waited >= self._crowded
        if pace is not None:
            known = self._pace_at.get(size)
            self._pace_at[size] = pace if known is None else (known + pace) / 2
            if size == self.most and not crowded:
                self._quiet_pace = pace if self._quiet_pace is None else \
                    (self._quiet_pace + pace) / 2
        if crowded and size > 1:
            smaller = self.uncrowded(waited)
            # A crowded team can still be the faster one: steps behind a thread that waits
            # for its core now and then lose less than a thread fewer would.
            if pace is None or pace > self.slowest_worth_keeping(smaller):
                return smaller
            return size
        return max(size, self.fits(others)) if size < self.most else size

    def expected_pace(self, size: int) -> float:
        """How many times slower than their fastest decode steps ran on `size` threads
        lately, or, never measured, would run on a quiet machine (as if steps took time in
        proportion to the threads they lack)."""
        known = self._pace_at.get(size)
        if known is not None:
            return known
        quiet = self._quiet_pace if self._quiet_pace is not None else 1.0
        return quiet * self.most / size

    def slowest_worth_keeping(self, smaller: int) -> float:
        """The slowest pace at which a crowded team beats `smaller` threads: theirs, with a
        margin for the noise of one window once measured. A guess has none: the first
        shrink measures the smaller team, and the next try of the full team compares."""
        if smaller in self._pace_at:
            return self._pace_at[smaller] * MEASURED_MARGIN
        return self.expected_pace(smaller)

    def _close_window(self, now: float, fits: int) -> None:
        trying, self._trying = self._trying, False
        if fits >= self.most:  # room for the full team
            self._retry, self._smaller_since = self._retry_base, None
            self.size = self.most
            return
        if trying:  # the full team was crowded: wait longer before the next try
            self._retry = min(self._most_retry, self._retry * 2)
            self._smaller_since = now
        elif self._smaller_since is None:
            self.shrinks += 1
            self._smaller_since = now
        self.size = fits
        if now - self._smaller_since >= self._retry:
            self._trying = True
            self.tries += 1
            self.size = self.most  # for one window


class StepPace:
    """How much slower decode steps run than the fastest of their size seen so far: about
    1 on a quiet machine, far more when other programs take the team's cores."""

    def __init__(self) -> None:
        self._fastest: dict[int, float] = {}
        self._spent = self._expected = 0.0
        self.ratio: float | None = None  # over the latest window (None: no decode step yet)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds`."""
        fastest = self._fastest.get(rows)
        if fastest is None or seconds < fastest:
            self._fastest[rows] = fastest = seconds
        self._spent += seconds
        self._expected += fastest

    def close_window(self) -> float | None:
        """The window's ratio (None where it held no decode step), and a new window."""
        ratio = self._spent / self._expected if self._expected > 0 else None
        if ratio is not None:
            self.ratio = ratio
        self._spent = self._expected = 0.0
        return ratio
