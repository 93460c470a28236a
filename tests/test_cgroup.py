"""A container's CPU limit read from its cgroup files, v2 and v1, laid out as the kernel shows them; and, where this
machine lets a test make a cgroup, an engine started under a real CFS quota takes that quota's cores."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engine.execution.cgroup import CpuQuota, cpu_quota, quota_cores


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _tree(tmp_path: Path, groups: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup of `groups` and a cgroup file system of `files` (path under the root -> text)."""
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    _write(proc, groups)
    for name, text in files.items():
        _write(root / name, text)
    return root, proc


def test_v2_takes_the_tightest_limit_on_the_groups_path(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "fs"
    _write(root / "cpu.stat", "usage_usec 1\n")  # the host's root group has no cpu.max
    _write(root / "kubepods/cpu.max", "max 100000\n")
    _write(root / "kubepods/cpu.stat", "usage_usec 9000000\n")
    _write(root / "kubepods/pod1/cpu.max", "250000 100000\n")
    _write(root / "kubepods/pod1/cpu.stat", "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    _write(root / "kubepods/pod1/ctr/cpu.stat", "usage_usec 1000000\n")
    quota = cpu_quota(root, proc)
    assert quota == CpuQuota(2.5, root / "kubepods/pod1/cpu.stat"), "the pod's limit binds its container"
    assert quota.usage_seconds() == 2.5 and quota_cores(quota) == 2
    _write(root / "kubepods/pod1/ctr/cpu.max", "150000 100000\n")
    assert cpu_quota(root, proc) == CpuQuota(1.5, root / "kubepods/pod1/ctr/cpu.stat"), "a tighter one below"


def test_v2_inside_a_cgroup_namespace_reads_its_root(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n", "cpu.stat": "usage_usec 42\n"})
    quota = cpu_quota(root, proc)
    assert quota is not None and quota.cores == 0.5 and quota_cores(quota) == 1, "at least one core"


def test_no_limit_no_files_or_no_proc_is_none(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    assert cpu_quota(root, proc) is None, "no /proc/self/cgroup (not Linux)"
    _write(proc, "0::/user.slice\n")
    assert cpu_quota(root, proc) is None, "no cgroup files"
    _write(root / "user.slice/cpu.max", "max 100000\n")
    _write(root / "user.slice/cpu.stat", "usage_usec 7\n")
    assert cpu_quota(root, proc) is None, "'max': no limit"
    assert quota_cores(None) is None


def test_v1_separate_and_joint_mounts_and_a_containers_own_view(tmp_path: Path) -> None:
    # As on this project's machines: cpu and cpuacct mounted apart, the process in the root group.
    groups = "9:name=systemd:/\n4:memory:/x\n2:cpuacct:/\n1:cpu:/\n0::/\n"
    files = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n", "cpuacct/cpuacct.usage": "3\n"}
    root, proc = _tree(tmp_path, groups, files)
    assert cpu_quota(root, proc) is None, "-1: no limit"
    _write(root / "cpu/cpu.cfs_quota_us", "300000\n")
    assert cpu_quota(root, proc) == CpuQuota(3.0, None), "cpuacct's groups apart: none counts the limited one"
    # Docker on v1: /proc/self/cgroup names the host's path, the mount is the container's own group.
    joint = tmp_path / "joint"
    _write(proc, "3:cpu,cpuacct:/docker/abc\n")
    _write(joint / "cpu,cpuacct/cpu.cfs_quota_us", "200000\n")
    _write(joint / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    _write(joint / "cpu,cpuacct/cpuacct.usage", "5000000000\n")
    quota = cpu_quota(joint, proc)
    assert quota == CpuQuota(2.0, joint / "cpu,cpuacct/cpuacct.usage") and quota.usage_seconds() == 5.0
    # The host's view: the group under the mount.
    _write(joint / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "100000\n")
    _write(joint / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    _write(joint / "cpu,cpuacct/docker/abc/cpuacct.usage", "6\n")
    assert cpu_quota(joint, proc) == CpuQuota(1.0, joint / "cpu,cpuacct/docker/abc/cpuacct.usage")


def _writable_cpu_cgroup() -> tuple[Path, Path] | None:
    """A fresh cgroup with the cpu controller, and its quota file, where this process may make one (root, v1's cpu
    mount or v2 with the cpu controller delegated); None elsewhere."""
    name = f"ferry-test-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "cpu.cfs_quota_us").exists():
            group = v1 / name
            group.mkdir()
            return group, group / "cpu.cfs_quota_us"
        if "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            group = v2 / name
            group.mkdir()
            return group, group / "cpu.max"
    except OSError:
        return None
    return None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: a one-core quota changes nothing")
def test_an_engine_under_a_real_one_core_quota_takes_one_core(tiny_llama: Path) -> None:
    """In a cgroup limited to one core's time on a machine of more, the engine's cores are one: its decode threads
    start at one and no count follows the load (there is nothing to choose)."""
    made = _writable_cpu_cgroup()
    if made is None:
        pytest.skip("this machine does not let the test make a cgroup with the cpu controller")
    group, quota_file = made
    try:
        quota_file.write_text("100000 100000\n" if quota_file.name == "cpu.max" else "100000\n")
        script = (
            "import torch;"
            "from engine.config import EngineConfig;"
            "from engine.execution.cpu_threads import node_cores, decode_threads, step_threads;"
            f"config = EngineConfig.of(model={str(tiny_llama)!r});"
            "print(node_cores(), decode_threads(config), step_threads(config, torch.device('cpu')))"
        )
        # The shell joins the group, then becomes Python: every thread it starts is inside the quota.
        joined = f'echo $$ > {group / "cgroup.procs"} && exec {sys.executable} -c "{script}"'
        out = subprocess.run(["sh", "-c", joined], capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.split() == ["1", "1", "None"], out.stdout + out.stderr
    finally:
        group.rmdir()
