"""CPU threads by step size and by the load beside the engine.

A decode-sized step runs on `cpu_threads`; 0 (the default) follows the load: every core of this rank that other
processes leave free, measured from /proc/stat over the last LOAD_WINDOW_SECONDS (`FreeCores`). A rank's cores are
its CPUs, or the whole cores of its cgroup's CPU quota where that is fewer (a container's CPU limit: see
engine/execution/cgroup.py), and there the load is the cgroup's own. With two OpenMP threads every op of a step
ends in a barrier, and a barrier whose other thread has lost its core to another process waits for a time slice,
so a step of many small ops collapses on a busy machine (measured on 2 cores: 802 tok/s on one thread, 323 on two
beside one busy process); on an idle machine two threads stream the weights ~1.4x faster.
Under `ferry serve` the others are the front end and its clients: a lone stream of a large model leaves the second
core free, while 32 streams of the demo model keep the front end busy on it.

A step of PREFILL_STEP_TOKENS or more runs on `cpu_prefill_threads`, and so does a step of a few sequences with a
prompt chunk of SHORT_PREFILL_TOKENS or more (the front end has little to stream then: its first token is what it
waits for). Such steps are long and compute-bound, each op big beside a barrier's wait, and while one runs the
front end waits for its tokens; by default (None) they take every core but those that processes other than the
front end keep busy (PREFILL_SHARED_LOAD)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.execution.cgroup import cpu_quota, quota_cores
from engine.kernels.library import set_linear_helper

PREFILL_STEP_TOKENS = 256
"""A CPU step of at least this many tokens runs on `cpu_prefill_threads` (measured on the demo model: 256 and 512
gave the same TTFT; below, decode steps with a short new prompt would take the second core from the front end)."""
SHORT_PREFILL_TOKENS = 64
FEW_SEQS = 4
"""A step of at most FEW_SEQS sequences and at least SHORT_PREFILL_TOKENS tokens also runs on the prefill threads:
one 136-token prompt alone on the demo model takes 6.2 ms on two threads against 11.3 on one (in process), so
a lone user's first token comes sooner; at concurrency 8 or more the rule above decides as before."""

HELPER_MIN_TOKENS = 4
"""A step of at least this many tokens on fewer threads than the rank's cores lets the linears' helper thread
(engine/kernels/helping.h) take blocks in the idle time of the cores left out. A helper preempted by the process
it shares its core with holds up the step until it runs again, for one chunk: amortised over a long step's
products, not a lone stream's. Served on 2 cores (AVX2 EPYC, demo model): 32 streams 2,262-2,281 against
1,878-1,920 tok/s without it, one stream 397-411 against 491-566."""

LOAD_WINDOW_SECONDS = 0.25
"""How often the load beside the engine is measured: /proc/stat counts in 10 ms ticks, so a quarter second
resolves a twentieth of a core, and the count follows a change of load within a few hundred decode steps."""
DECODE_SHARED_LOAD = 0.3
"""Other processes' load, in cores, that leaves every core free to a decode step: the rest of it, rounded up, takes
cores away. Measured on 2 cores serving the demo model to a local client at concurrency 1, the front end and the
client took 0.42 of a core, and two decode threads there were no faster than one (743 / 529 against 761 / 564 tok/s
in two pairs); a lone stream of a 280M model costs them a few hundredths."""
PREFILL_SHARED_LOAD = 0.6
"""The same for a prefill-sized step, of the load of processes other than the engine's parent (under `ferry serve`
its front end, which waits for the prefill's tokens). At concurrency 32 on the demo model (2 cores) the front end
took a third of a core to half of one, its client as much, and a second prefill thread there cut TTFT p99 665 ->
409 ms; beside a process spinning on a core, a 136-token prompt of the 280M bfloat16 model came sooner on one
thread than on two (TTFT p50 491 / 546 against 866 / 1,037 ms), and that process keeps two thirds of a core even
while both threads compete with it."""


def free_cores(others: float, cores: int, rank_cores: int, shared_load: float = DECODE_SHARED_LOAD) -> int:
    """Threads for this rank, of the `cores` it shares with its node's other ranks (`rank_cores` its own share), when
    other processes keep `others` cores busy: the free cores, at least one, at most the rank's share. A core is
    taken by each whole core of load beyond `shared_load`."""
    taken = math.ceil(max(0.0, others - shared_load))
    return max(1, min(rank_cores, cores - taken))


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""/proc's time unit: ticks a second."""


def busy_ticks(proc_stat: str, cpus: set[int] | None = None) -> int:
    """The ticks the CPUs `cpus` (None: every CPU) spent busy (not idle, not waiting for I/O), from the text of
    /proc/stat. Stolen ticks count as busy: the hypervisor gave that time to someone else."""
    busy = 0
    for line in proc_stat.splitlines():
        name, _, counts = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(count) for count in counts.split()[:8])
        busy += user + nice + system + irq + softirq + steal
    return busy


def machine_busy_seconds(cpus: set[int] | None = None) -> float:
    """The CPU time the CPUs `cpus` (None: every CPU) have spent busy, in seconds, from /proc/stat."""
    with open("/proc/stat") as file:
        return busy_ticks(file.read(), cpus) / CLOCK_TICKS


def process_seconds(pid: int) -> float:
    """The CPU time process `pid` has spent (its user and system time, from /proc); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return 0.0
    # The command name, in parentheses, may hold spaces: the fields after it are space-separated.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class FreeCores:
    """The cores of this rank that other processes leave free: each LOAD_WINDOW_SECONDS (checked when asked), the
    busy time of the process's CPUs less its own CPU time gives the others' load, and less its parent's too the
    load of those that do not wait for the engine."""

    def __init__(
        self,
        cores: int,
        rank_cores: int,
        busy_seconds: Callable[[], float],
        fewest: int = 1,
        clock: Callable[[], float] = time.monotonic,
        own_seconds: Callable[[], float] = time.process_time,
        parent_seconds: Callable[[], float] = lambda: process_seconds(os.getppid()),
    ) -> None:
        self.cores = cores
        """The cores the process may use, shared with the node's other ranks: its CPUs, or its cgroup's quota."""
        self.rank_cores = rank_cores
        self._busy_seconds = busy_seconds
        """The CPU time spent so far on those cores by every process (`machine_busy_seconds`, or the cgroup's)."""
        self.fewest = fewest
        """The fewest threads it gives, however busy the machine."""
        self.pinned: int | None = None
        """A count it gives every step while set (the compile warm-up's, one graph per count)."""
        self.others = (0.0, 0.0)
        """Cores that other processes kept busy over the last two windows, the last last: none until measured."""
        self.parent = 0.0
        """Of the last window's, the cores the parent process kept busy."""
        self._clock = clock
        self._own_seconds, self._parent_seconds = own_seconds, parent_seconds
        self._since = self._sample()

    def counts(self) -> range:
        """Every count it may give, most first."""
        return range(self.rank_cores, self.fewest - 1, -1)

    def count(self, large: bool) -> int:
        """Threads for a decode-sized step (by the busier of the last two windows: fewer at once, more after two
        quiet windows), or a prefill-sized one (`large`, by the last; see DECODE_SHARED_LOAD and
        PREFILL_SHARED_LOAD); the load is measured anew once a window has passed since the last measurement."""
        if self.pinned is not None:
            return self.pinned
        now = self._clock()
        if now - self._since[0] >= LOAD_WINDOW_SECONDS:
            (then, busy_then, own_then, parent_then), sample = self._since, self._sample()
            now, busy, own, parent = sample
            others = max(0.0, ((busy - busy_then) - (own - own_then)) / (now - then))
            self.others = (self.others[1], others)
            self.parent = min(others, max(0.0, (parent - parent_then) / (now - then)))
            self._since = sample
        if large:
            count = free_cores(self.others[1] - self.parent, self.cores, self.rank_cores, PREFILL_SHARED_LOAD)
        else:
            # The busier of two windows: a window spent mostly on prefills, while the front end waited for them,
            # would otherwise hand the next one's decodes a core the front end then wants back.
            count = free_cores(max(self.others), self.cores, self.rank_cores, DECODE_SHARED_LOAD)
        return max(self.fewest, count)

    def _sample(self) -> tuple[float, float, float, float]:
        return self._clock(), self._busy_seconds(), self._own_seconds(), self._parent_seconds()


class StepThreads(NamedTuple):
    small: int
    """Threads for a decode-sized step; 0: the free cores."""
    large: int
    """Threads for a prefill-sized step (see the module's docstring); 0: the free cores."""
    free: FreeCores | None
    """Where a count follows the load: the measurement."""

    def use_for(self, num_tokens: int, num_seqs: int) -> int:
        """Set the count for a step of `num_tokens` over `num_seqs` sequences, and return it. Per thread in torch:
        call it on the thread that runs the step (the runner's own under async scheduling)."""
        large = num_tokens >= PREFILL_STEP_TOKENS or (num_seqs <= FEW_SEQS and num_tokens >= SHORT_PREFILL_TOKENS)
        count = self.large if large else self.small
        helper = False
        if count == 0 and self.free is not None:
            count = self.free.count(large)
            # The cores left out may still be idle much of the time: a helper thread takes linears' blocks while
            # they are.
            helper = num_tokens >= HELPER_MIN_TOKENS and count < self.free.rank_cores
        torch.set_num_threads(count)
        set_linear_helper(helper)
        return count


def node_cores() -> int:
    """The cores this process may use: its CPUs, or fewer where its cgroup's CPU quota allows fewer."""
    cpus = len(os.sched_getaffinity(0))
    quota = quota_cores(cpu_quota())
    return cpus if quota is None else min(cpus, quota)


def rank_cores(config: EngineConfig) -> int:
    """The cores this process may use, shared among the tensor-parallel ranks of its node."""
    ranks_here = config.parallel.tensor_parallel_size // config.parallel.nnodes
    return max(1, node_cores() // ranks_here)


def load_source() -> tuple[int, Callable[[], float]] | None:
    """The cores the load is measured over and the CPU time spent on them: under a cgroup CPU quota, the quota's
    cores and the cgroup's own time (its other processes are what take from the quota); otherwise this process's
    CPUs from /proc/stat. None where neither can be read (not Linux): a count that follows the load then takes the
    rank's cores, as on an idle machine."""
    quota, cpus = cpu_quota(), os.sched_getaffinity(0)
    if quota is not None and quota.usage is not None and (cores := quota_cores(quota)) < len(cpus):
        return cores, quota.usage_seconds
    # The machine's CPUs: also under a quota that no cpuacct group counts alone (v1's controllers mounted apart),
    # which still caps the rank's cores (`node_cores`) while the load that takes them is the machine's.
    return (len(cpus), lambda: machine_busy_seconds(cpus)) if os.path.exists("/proc/stat") else None


def decode_threads(config: EngineConfig) -> int | None:
    """The decode threads to start with: `cpu_threads`, or this rank's cores where it follows the load (0); None
    leaves torch's setting alone."""
    threads = config.execution.cpu_threads
    return rank_cores(config) if threads == 0 else threads


def step_threads(config: EngineConfig, device: torch.device) -> StepThreads | None:
    """The thread counts of small and large steps on CPU; None where every step keeps one count (a GPU,
    cpu_threads None, or fixed counts with no more prefill threads than decode threads)."""
    execution = config.execution
    if device.type != "cpu" or execution.cpu_threads is None:
        return None
    cores = rank_cores(config)
    small, large = execution.cpu_threads, execution.cpu_prefill_threads or 0
    if 0 in (small, large) and cores > 1 and (load := load_source()) is not None:
        # A compiled graph is specialized to its thread count, and the warm-up compiles one for each count that
        # can come: two, every core or one fewer (a core left to a busy front end).
        fewest = 1 if execution.compile == "none" else cores - 1
        return StepThreads(small, large, FreeCores(load[0], cores, load[1], fewest))
    small, large = small or cores, large or cores
    return StepThreads(small, large, None) if large > small else None
