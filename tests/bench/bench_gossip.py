"""Gossip at scale on one machine: N dsagent processes on loopback (default
50, --gossip-profile lan), every one --join the first.  Prints

  - how long after the last start every agent sees all N alive
    (convergence; acceptance: <= 10 s for 50 agents),
  - gossip traffic per node (bytes in + out per second, from each agent's
    GET /v1/cluster/members stats) while converging and in steady state
    over --window seconds (acceptance: < 20 KB/s per node),
  - the same figures as one markdown table row for docs/benchmarks.md.

Usage:  DS_BUILD=build .venv/bin/python tests/bench/bench_gossip.py [--nodes 50]
        [--profile lan|test] [--window 60]
Needs models/default.gguf (`make model`): each agent loads it (mmap'd, shared).
Each agent runs with --threads 1 --kv-cache-mb 8; logs go to a temporary
directory that is removed at the end (kept with --keep).
"""
import argparse
import http.client
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = ROOT / os.environ.get("DS_BUILD", "build")
sys.path.insert(0, str(ROOT))
from tests.fixtures.net import free_port  # noqa: E402
from tests.fixtures.agent import AgentProcess  # noqa: E402


class Agent:
    def __init__(self, tmp, name, key, seed_port, profile, port):
        self.name = name
        d = tmp / name
        (d / "data").mkdir(parents=True)
        self.data = d / "data"
        cmd = ["--name", name, "--bind", "127.0.0.1",
               "--control-port", "0", "--api-port", "0", "--data-dir", str(self.data),
               "--backend", "cpu", "--threads", "1", "--kv-cache-mb", "8",
               "--cluster-key", str(key), "--gossip-bind", "127.0.0.1",
               "--gossip-port", str(port), "--gossip-profile", profile,
               "--join", f"127.0.0.1:{seed_port}", "--log-level", "warn"]
        self.agent = AgentProcess(BUILD / "dsagent", cmd, log_dir=d)
        self.proc, self.started = self.agent.proc, self.agent.started
        self.ctl = None
        self.conn = None

    def wait_listening(self, timeout=60):
        self.ctl = self.agent.wait_listening(timeout).control_port
        self.token = self.agent.token()

    def members(self):
        for attempt in range(3):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.ctl, timeout=20)
                self.conn.request("GET", "/v1/cluster/members",
                                  headers={"Authorization": f"Bearer {self.token}"})
                r = self.conn.getresponse()
                return json.loads(r.read())
            except (http.client.HTTPException, ConnectionError):
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


def traffic(agents):
    return {a.name: a.members()["stats"] for a in agents}


def per_node_rate(s0, s1, dt, which=("bytes_in", "bytes_out")):
    """bytes/s per node between two snapshots (in + out by default)."""
    return [sum(s1[n][k] - s0[n][k] for k in which) / dt for n in s0]


def kb(rates):
    return f"{statistics.mean(rates) / 1024:.2f} KB/s mean, {max(rates) / 1024:.2f} max"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--profile", default="lan", choices=["lan", "test"])
    ap.add_argument("--window", type=float, default=60.0,
                    help="steady-state measurement, seconds (lan push-pull: 60 s at 50 nodes)")
    ap.add_argument("--keep", action="store_true", help="keep the logs")
    a = ap.parse_args()
    if not (ROOT / "models" / "default.gguf").exists():
        sys.exit("models/default.gguf is missing: run `make model`")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-gossip-"))
    key = tmp / "cluster.key"
    r = subprocess.run([str(BUILD / "dsctl"), "cluster", "init", "--key-file", str(key)],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr)
    agents = []
    try:
        seed = free_port()
        t_first = time.monotonic()
        for i in range(a.nodes):
            agents.append(Agent(tmp, f"n{i:02d}", key, seed, a.profile, seed if i == 0 else 0))
        last_start = agents[-1].started
        for ag in agents:
            ag.wait_listening()
        # The join phase: every agent's counters once a second until 10 s
        # after the last start (counters start at zero when an agent starts).
        converged_at = None
        samples = []                 # (time, {name: stats})
        phase_end = last_start + 10.0
        reported = False
        while time.monotonic() < max(phase_end, last_start + 1) or converged_at is None:
            if converged_at is None and not reported and time.monotonic() > last_start + 10:
                reported = True          # say who is missing what (and keep waiting)
                for ag in agents:
                    odd = [f"{m['name']}:{m['state']}" for m in ag.members()["members"]
                           if m["state"] != "alive"]
                    known = len(ag.members()["members"])
                    if odd or known != a.nodes:
                        print(f"  not converged at +10 s: {ag.name} knows {known}, not alive: "
                              f"{' '.join(odd) or '-'}", flush=True)
            if time.monotonic() > last_start + 60:
                views = []
                for ag in agents:
                    ms = ag.members()["members"]
                    alive = sum(1 for m in ms if m["state"] == "alive")
                    views.append(f"{ag.name}:{alive}/{len(ms)}")
                sys.exit(f"not converged within 60 s of the last start ({a.nodes} agents); "
                         f"alive/known per agent: {' '.join(views)}")
            t = time.monotonic()
            snap, ok = {}, True
            for ag in agents:
                body = ag.members()
                snap[ag.name] = body["stats"]
                ms = body["members"]
                ok &= len(ms) == a.nodes and all(m["state"] == "alive" for m in ms)
            samples.append((t, snap))
            if ok and converged_at is None:
                converged_at = time.monotonic()
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t)) if converged_at else 0.1)
        conv = converged_at - last_start
        # The worst window of at least one second of any node: each node's
        # series starts at its own start (counters zero), then every sample;
        # each sample is paired with the first one >= 1 s later.
        started = {ag.name: ag.started for ag in agents}
        peak_out = peak_all = 0.0
        peak_who = ""
        for name in started:
            zero = {k: 0 for k in samples[0][1][name]}
            series = [(started[name], zero)] + [(t, snap[name]) for t, snap in samples]
            j = 0
            for i, (t0_, a0) in enumerate(series):
                j = max(j, i + 1)
                while j < len(series) and series[j][0] - t0_ < 1.0:
                    j += 1
                if j == len(series):
                    break
                t1_, a1 = series[j]
                out = (a1["bytes_out"] - a0["bytes_out"]) / (t1_ - t0_)
                both = out + (a1["bytes_in"] - a0["bytes_in"]) / (t1_ - t0_)
                peak_out = max(peak_out, out)
                if both > peak_all:
                    tcp = sum(a1[k] - a0[k] for k in ("tcp_bytes_in", "tcp_bytes_out"))
                    peak_all = both
                    peak_who = (f"{name}, {t0_ - last_start:+.1f} s from the last start, "
                                f"TCP {tcp / (t1_ - t0_) / 1024:.1f} KB/s")
        t_end, s_end = samples[-1]
        join_out = [s_end[n]["bytes_out"] / (t_end - started[n]) for n in s_end]
        join_all = [(s_end[n]["bytes_out"] + s_end[n]["bytes_in"]) / (t_end - started[n])
                    for n in s_end]
        # Where the busiest node's join-phase bytes went: TCP (push-pull) or UDP.
        busiest = max(s_end, key=lambda n: s_end[n]["bytes_out"] + s_end[n]["bytes_in"])
        b = s_end[busiest]
        span = t_end - started[busiest]
        split = (f"{busiest}: TCP sent {b['tcp_bytes_out'] / span / 1024:.2f} + received "
                 f"{b['tcp_bytes_in'] / span / 1024:.2f} KB/s, UDP sent "
                 f"{(b['bytes_out'] - b['tcp_bytes_out']) / span / 1024:.2f} + received "
                 f"{(b['bytes_in'] - b['tcp_bytes_in']) / span / 1024:.2f} KB/s, "
                 f"{b['push_pulls']} push-pulls")
        time.sleep(1.0)              # let the join broadcasts drain
        s0 = traffic(agents)
        t0 = time.monotonic()
        time.sleep(a.window)
        s1 = traffic(agents)
        dt = time.monotonic() - t0
        rates = per_node_rate(s0, s1, dt)
        outs = per_node_rate(s0, s1, dt, ("bytes_out",))
        pkts = [(s1[n]["packets_in"] - s0[n]["packets_in"] + s1[n]["packets_out"]
                 - s0[n]["packets_out"]) / dt for n in s0]
        drop_kinds = {k: sum(s1[n][k] for n in s1) for k in s1[agents[0].name]
                      if k.startswith("drop_")}
        drops = sum(drop_kinds.values())
        dead = sum(1 for ag in agents for m in ag.members()["members"] if m["state"] != "alive")
        print(f"gossip bench: {a.nodes} agents, profile {a.profile}, "
              f"started over {last_start - t_first:.1f} s")
        print(f"  converged {conv:.2f} s after the last start")
        print(f"  join phase (each agent's start .. {t_end - last_start:.0f} s after the last "
              f"start), per node: sent {kb(join_out)}; sent + received {kb(join_all)}")
        print(f"  busiest node in the join phase, {split}")
        print(f"  worst one-second rate of any node in the join phase: sent "
              f"{peak_out / 1024:.2f} KB/s, sent + received {peak_all / 1024:.2f} KB/s "
              f"({peak_who})")
        print(f"  steady state over {dt:.0f} s: per node sent {kb(outs)}; sent + received "
              f"{kb(rates)}; {statistics.mean(pkts):.1f} packets/s (in + out) mean")
        print(f"  drops {drops} ({', '.join(f'{k} {v}' for k, v in drop_kinds.items() if v)}), "
              f"members not alive at the end {dead}; joins referred "
              f"{sum(s1[n]['joins_referred'] for n in s1)}")
        print(f"| gossip, {a.nodes} agents on loopback ({a.profile}) | converged {conv:.2f} s "
              f"after the last start | steady ({dt:.0f} s), per node sent + received: "
              f"{kb(rates)} | join phase, per node sent + received: {kb(join_all)}; worst "
              f"second {peak_all / 1024:.2f} KB/s |")
    finally:
        for ag in agents:               # all at once, then wait for each
            ag.agent.send(signal.SIGTERM)
        for ag in agents:
            ag.agent.stop(None, timeout=10)
        if a.keep:
            print(f"logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
