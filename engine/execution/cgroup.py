"""The CPU quota of the cgroup the process runs in (a container's CPU limit), and the CPU time spent under it.

A Kubernetes pod with `resources.limits.cpu: 2` on a 64-core node sees 64 CPUs in its affinity mask, but the
kernel's CFS bandwidth control lets the pod run only 2 cores' worth of time per period: 64 OpenMP threads there use
the quota up early in each 100 ms period and then all wait, throttled, for the next one, and every barrier of a
step waits with them. So the cores a rank may use are the whole cores of the tightest quota on its cgroup's path
(`cpu.max` under cgroup v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` under v1), rounded down as Go's automaxprocs
does: a fractional core would be a thread throttled for the rest of every period. The load that competes for that
quota is that of the cgroup's other processes, measured from its own CPU time (`cpu.stat`'s `usage_usec`, v1's
`cpuacct.usage`), not the machine's /proc/stat, where other pods' load does not take from this one's quota."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


class CpuQuota(NamedTuple):
    cores: float
    """The quota over its period: 1.5 lets the group run one and a half cores' worth of time."""
    usage: Path | None
    """The file that counts the limited group's CPU time (`cpu.stat` under v2, `cpuacct.usage` under v1); None
    where v1 mounts cpuacct apart and groups it otherwise, so that no group counts exactly the limited one."""

    def usage_seconds(self) -> float:
        """The CPU time every process of the limited group has spent, in seconds."""
        assert self.usage is not None
        text = self.usage.read_text()
        if self.usage.name == "cpu.stat":
            fields = dict(line.split() for line in text.splitlines() if line.strip())
            return int(fields["usage_usec"]) / 1e6
        return int(text) / 1e9


def _ancestors(root: Path, path: str) -> list[Path]:
    """The group directories from the process's own up to the hierarchy's root: a limit set on a parent (a pod's,
    above its containers') binds too. Inside a cgroup namespace the process's path is "/": its group is the root."""
    parts = [part for part in path.strip("/").split("/") if part]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CpuQuota | None:
    """The tightest CPU quota on this process's cgroup path, v2 or v1; None where no quota is set, or the cgroup
    files cannot be read (not Linux, no cgroup mounted)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    paths = {}  # controller (v2's unified hierarchy: "") -> the process's group in its hierarchy
    for line in lines:
        _, controllers, path = line.split(":", 2)
        paths.update(dict.fromkeys(controllers.split(","), path))
    found: list[CpuQuota] = []
    if "" in paths:
        found += [CpuQuota(c, d / "cpu.stat") for d in _ancestors(root, paths[""]) if (c := _v2_quota(d)) is not None]
    if "cpu" in paths:
        # v1 mounts cpu alone or beside cpuacct. Inside a container the mount is the container's own group, which the
        # host path of /proc/self/cgroup is not under: so the groups on that path and the mount itself.
        mount = next((root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / name).is_dir()), None)
        if mount is not None:
            for directory in dict.fromkeys([*_ancestors(mount, paths["cpu"]), mount]):
                if (cores := _v1_quota(directory)) is not None:
                    usage = directory / "cpuacct.usage"  # where cpuacct shares the mount
                    found.append(CpuQuota(cores, usage if usage.exists() else None))
    return min(found, default=None, key=lambda quota: quota.cores)


def quota_cores(quota: CpuQuota | None) -> int | None:
    """The whole cores a quota gives, at least one; None without a quota."""
    return None if quota is None else max(1, int(quota.cores))
