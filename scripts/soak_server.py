"""The fault soak's server side (``scripts/fault_soak.py``): starting ``verispec serve``, the
``kill -9`` and restart on the same port and suffix cache file (or, with ``--replicas``, one Ray
Serve replica's process killed), the RSS of the server's process tree over time, its plot and
figures, and what the server's log and files say (suffix cache entries, ``/metrics``). The
clients, the faults and the report are ``fault_soak.py``'s; the counting is ``verispec.server.soak_checks``'s."""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from pathlib import Path

import httpx
import psutil
from load_bench import Server

from verispec.server.soak_checks import Outage, kill_check, process_trends, rss_growth_mib, rss_trend_mib

LOADED = re.compile(r"suffix cache: (\d+) past requests from")
KILL_WAIT_S = 5.5  # a little over the 5 s the requests of a kill have to end


class ServerSide:
    """The server half of :class:`fault_soak.Soak` (a mixin: it uses the soak's ``args``,
    ``command``, ``port``, ``out``, ``generation``, ``kills``, ``outages``, ``rss``, ``stop``,
    ``now()`` and ``in_flight()``)."""

    def start_server(self) -> Server:
        server = Server("verispec", self.command, self.port, "/health", self.out / f"server-{self.generation}.log")
        server.wait_ready()
        return server

    def kill(self) -> None:
        """kill -9 the server, check the requests it had, restart it on the same port and file."""
        in_flight, kill_s = self.in_flight(), self.now()
        self.server.process.kill()
        self.server.process.wait()
        self.server.log.close()
        snapshot_entries = snapshot_size(self.args.suffix_cache, self.out / f"suffix-at-kill-{len(self.kills)}.cache")
        time.sleep(KILL_WAIT_S)
        check = kill_check(in_flight, kill_s)
        self.generation += 1
        self.server = self.start_server()
        ready_s = self.now()
        self.generation_start.append(ready_s)
        self.outages.append(Outage(kill_s, ready_s))
        restored = loaded_entries(Path(self.server.log.name))
        self.kills.append(
            {
                **check,
                "restart_s": round(ready_s - kill_s, 1),
                "snapshot_entries": snapshot_entries,
                "restored_entries": restored,
                "snapshot_ok": snapshot_entries is None or (restored or 0) >= snapshot_entries,
            }
        )

    def kill_replica(self) -> None:
        """kill -9 one Ray Serve replica's process (Ray restarts it); its requests must fail fast."""
        victims = replica_processes(self.server.process.pid)
        in_flight, kill_s = self.in_flight(), self.now()
        if not victims:
            self.kills.append({"kill_s": round(kill_s, 2), "ok": False, "late": ["no replica process found"]})
            return
        victims[0].kill()
        time.sleep(KILL_WAIT_S)
        deadline = time.monotonic() + 180
        while len(replica_processes(self.server.process.pid)) < len(victims) and time.monotonic() < deadline:
            time.sleep(1.0)
        self.outages.append(Outage(kill_s, self.now()))
        # the requests on the replicas that lived go on for a while: judged once all have ended
        self.kills.append(
            {
                "kill_s": round(kill_s, 2),
                "in_flight_outcomes": in_flight,
                "replica_pid": victims[0].pid,
                "replica_back_s": round(self.now() - kill_s, 1),
            }
        )

    def judge_replica_kills(self) -> None:
        """After the soak: each replica kill's check (:func:`verispec.server.soak_checks.kill_check`, requests
        answered in full by the other replicas allowed)."""
        for kill in self.kills:
            in_flight = kill.pop("in_flight_outcomes", None)
            if in_flight is not None:
                kill.update(kill_check(in_flight, kill["kill_s"], others_may_answer=True))

    def sample_rss(self) -> None:
        while not self.stop.wait(self.args.rss_every):
            try:
                processes = tree_rss_by_process(self.server.process.pid)
            except psutil.Error:
                continue  # killed a moment ago
            now = self.now()
            self.rss.append((now, sum(processes.values()), self.generation))
            self.rss_processes.append((now, processes))


def snapshot_size(path: Path, copy_to: Path) -> int | None:
    """Entries of the suffix cache file a kill left (copied aside); None when there is none."""
    from verispec.proposers.suffix import SuffixCache

    if not path.exists():
        return None
    shutil.copy(path, copy_to)
    return SuffixCache().load(copy_to)


def loaded_entries(log: Path) -> int | None:
    """The entries a server said it loaded from its suffix cache at start (None: no file loaded)."""
    found = LOADED.findall(log.read_text(errors="replace"))
    return int(found[-1]) if found else None


def process_label(process: psutil.Process) -> str:
    """A short name for one process of the server's tree: ``serve`` (the process started),
    ``ServeReplica``, ``ServeController``, ``ProxyActor``, ``raylet``, ``gcs_server``, ``dashboard``
    or the executable's base name, followed by ``:pid``."""
    command = " ".join(process.cmdline())
    for role in ("ServeReplica", "ServeController", "ProxyActor", "raylet", "gcs_server", "dashboard", "log_monitor"):
        if role in command:
            return f"{role}:{process.pid}"
    return f"{Path(process.cmdline()[0]).name if process.cmdline() else process.name()}:{process.pid}"


def tree_rss_by_process(pid: int) -> dict[str, int]:
    """RSS (bytes) of a process and each of its descendants, by :func:`process_label` (the root is
    ``serve:pid``); a process that ends while being read is left out."""
    root = psutil.Process(pid)
    found = {f"serve:{pid}": root.memory_info().rss}
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            found[process_label(child)] = child.memory_info().rss
    return found


def replica_processes(pid: int) -> list[psutil.Process]:
    """The Ray Serve replica worker processes under ``pid`` (their title names ServeReplica)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "ServeReplica" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return sorted(found, key=lambda p: p.pid)


def metric(url: str, name: str) -> float | None:
    """A sample of /metrics without labels (summed over replicas by the server), or None."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    found = re.findall(rf"^{name} ([0-9.eE+-]+)$", text, flags=re.M)
    return float(found[0]) if found else None


def plot_rss(rss: list[tuple[float, int, int]], outages: list[Outage], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for generation in sorted({g for _, _, g in rss}):
        points = [(t, b / 2**20) for t, b, g in rss if g == generation]
        ax.plot([t for t, _ in points], [m for _, m in points], marker=".", label=f"server process {generation}")
    for outage in outages:
        ax.axvline(outage.kill_s, color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since the soak started (red: kill)")
    ax.set_ylabel("RSS (MiB, process tree)")
    ax.set_title("verispec serve under the fault soak")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rss_figures(soak) -> dict:
    """RSS first/max/last (MiB), the growth after each server process's first minute (last sample
    minus the first; and the median of its last minute minus the median of the minute after its
    first, :func:`verispec.server.soak_checks.rss_trend_mib`) and every sample."""
    figures: dict = {"samples": len(soak.rss)}
    if soak.rss:
        figures["first_mib"], figures["last_mib"] = round(soak.rss[0][1] / 2**20, 1), round(soak.rss[-1][1] / 2**20, 1)
        figures["max_mib"] = round(max(b for _, b, _ in soak.rss) / 2**20, 1)
    per_process = [
        [(t - soak.generation_start[g], b) for t, b, gen in soak.rss if gen == g] for g in range(soak.generation + 1)
    ]
    figures["growth_after_first_minute_mib"] = {
        str(g): rss_growth_mib(samples) for g, samples in enumerate(per_process)
    }
    figures["median_growth_after_first_minute_mib"] = {
        str(g): rss_trend_mib(samples) for g, samples in enumerate(per_process)
    }
    figures["median_growth_by_process_mib"] = process_trends(soak.rss_processes)
    figures["samples_s_mib_process"] = [(round(t, 1), round(b / 2**20, 1), g) for t, b, g in soak.rss]
    return figures
