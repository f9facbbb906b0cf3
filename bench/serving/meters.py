"""What a benchmark run measures beside the requests: a server's RSS, other processes' CPU."""
from __future__ import annotations

import threading
import time

import psutil


class CpuMeter:
    """Cores used by processes other than the server and this script while a scenario ran.

    Two estimates, the larger is reported: busy time in /proc/stat minus the server's and this
    script's CPU time, and the sum of every other process's CPU time (psutil; processes that exit
    during the scenario are missed). In a VM the two disagree: /proc/stat is tick-sampled.
    """

    def __init__(self, server: psutil.Process | None):
        self.server = server
        self.me = psutil.Process()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    @staticmethod
    def _tree(p: psutil.Process | None) -> list[psutil.Process]:
        if p is None:
            return []
        try:
            return [p] + p.children(recursive=True)
        except psutil.Error:
            return [p]

    def _proc_cpu(self, p: psutil.Process | None, tree: bool = True) -> float:
        total = 0.0
        for q in (self._tree(p) if tree else [p] if p is not None else []):
            try:
                c = q.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                pass
        return total

    @staticmethod
    def _all() -> dict[int, tuple[float, float]]:
        out = {}
        for q in psutil.process_iter():
            try:
                c = q.cpu_times()
                out[q.pid] = (q.create_time(), c.user + c.system)
            except psutil.Error:
                pass
        return out

    def start(self) -> None:
        self.t0, self.b0 = time.perf_counter(), self._busy()
        self.s0, self.m0 = self._proc_cpu(self.server), self._proc_cpu(self.me, tree=False)
        self.a0 = self._all()

    def stop(self) -> dict:
        dt = time.perf_counter() - self.t0
        a1 = self._all()
        busy = self._busy() - self.b0
        server = self._proc_cpu(self.server) - self.s0
        me = self._proc_cpu(self.me, tree=False) - self.m0  # the server is our child: not in here
        mine = {q.pid for q in self._tree(self.server)} | {self.me.pid}
        others = 0.0
        for pid, (created, cpu) in a1.items():
            if pid in mine:
                continue
            before = self.a0.get(pid)
            others += cpu - (before[1] if before and before[0] == created else 0.0)
        by_stat = max(0.0, (busy - server - me) / dt)
        by_proc = max(0.0, others / dt)
        return {"server_cores": server / dt, "bench_cores": me / dt, "other_cores": max(by_stat, by_proc),
                "other_cores_stat": by_stat, "other_cores_procs": by_proc}


class RssSampler(threading.Thread):
    """Samples the RSS of a process tree every 0.2 s; `peak` overall, `window_peak` since reset_window()."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.window_peak = 0
        self._stop = threading.Event()

    def sample(self) -> int:
        rss = 0
        try:
            for q in [self.proc] + self.proc.children(recursive=True):
                try:
                    rss += q.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return rss

    def run(self) -> None:
        while not self._stop.is_set():
            rss = self.sample()
            self.peak = max(self.peak, rss)
            self.window_peak = max(self.window_peak, rss)
            self._stop.wait(0.2)

    def reset_window(self) -> None:
        self.window_peak = self.sample()

    def stop(self) -> None:
        self._stop.set()

