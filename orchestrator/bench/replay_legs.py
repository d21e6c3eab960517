"""The systems ``orch bench replay`` compares, each as a leg that runs the job once without faults and once under
the trace, on simulated nodes of this machine, and stops everything it started (by PID) when it ends.

- ``torchrun``: one bare torchrun agent per node (``--max-restarts``, c10d rendezvous, the plain
  snapshot-resume script ``replay_job.py``). The rendezvous store is a TCPStore in this process, on a host no
  trace event touches, as orch's store lives in its driver and Ray's state on its head node. A node's machine is
  its agent and the agent's workers; a notice reaches nothing (the tutorial's script has no notice channel).
- ``orch-restart`` / ``orch-per_step``: ``orch launch conf=cpu_elastic launcher=ray cluster.address=...`` with that
  ``fault_tolerance.mode``, on a ``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's side) and one
  1-CPU Ray node per simulated node, so each node agent gets a Ray node of its own. A notice goes where orch
  reads one (the ``chaos`` notice source: the agent's notice file, as ``orch chaos preempt`` gives it).
- ``ray-train``: Ray Train v2 on the same kind of cluster (``replay_ray.py``). A notice is what Ray gives a
  preempted node: GCS's DrainNode with reason ``DRAIN_NODE_REASON_PREEMPTION`` and the deadline, as Ray's
  autoscaler does for a preempted instance and as Ray's own release tests simulate one
  (``EC2InstanceTerminatorWithGracePeriod``: drain, then stop the node at the deadline). Ray Train's
  PreemptionWatcher polls those drains and ``ray.train.get_preemption_info()`` tells the training loop.

On a Ray cluster a node's machine is its Ray node: killing it SIGKILLs the raylet and every process under it
(workers, agents, torchrun, training processes); a returning node is a new Ray node. For every system a
``preempt`` kills the machine at its deadline, whatever still runs there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from orchestrator.bench.recovery import _free_port
from orchestrator.bench.replay_job import Job
from orchestrator.bench.replay_trace import TraceEvent
from orchestrator.processes import NodeProcess, kill_tree, terminate_tree
from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, EventName, read_jsonl

PRESET = "cpu_elastic"
POLL_S = 0.2


@dataclass
class RunResult:
    """One run of a system: unix times, rank 0's completed steps ``(t, step)`` in order, and the trace events
    applied to it (``{"t": unix time, "trace_t", "kind", "node"}``; events due after it finished are not)."""

    start_t: float
    end_t: float
    steps: list[tuple[float, int]]
    events: list[dict] = field(default_factory=list)
    finished: bool = True


class TracePlayer:
    """Plays a trace against ``machines``, ``t`` counted from ``first_step_t()`` (None until the system's first
    step): ``tick()`` runs every action that is due. A preempt is a notice at ``t`` and a kill at
    ``t + grace_s``. It runs on the caller's thread, as Ray starts a node only from the main thread."""

    def __init__(self, trace: list[TraceEvent], machines, first_step_t: Callable[[], Optional[float]]):
        actions = [(e.t, i, "event") for i, e in enumerate(trace)]
        actions += [(e.t + (e.grace_s or 0.0), i, "deadline") for i, e in enumerate(trace) if e.kind == "preempt"]
        self.trace, self.machines, self.first_step_t = trace, machines, first_step_t
        self.pending = sorted(actions)
        self.applied: list[dict] = []
        self.errors: list[str] = []
        self._anchor: Optional[float] = None

    def done(self) -> bool:
        """Every action played."""
        return not self.pending

    def tick(self) -> None:
        if self._anchor is None:
            self._anchor = self.first_step_t() if self.pending else None
        while self._anchor is not None and self.pending and self._anchor + self.pending[0][0] <= time.time():
            at, i, what = self.pending.pop(0)
            e = self.trace[i]
            try:
                if what == "deadline":
                    self.machines.kill(e.node)
                    continue
                t = time.time()
                {"kill": lambda: self.machines.kill(e.node), "return": lambda: self.machines.restore(e.node),
                 "preempt": lambda: self.machines.notice(e.node, e.grace_s or 0.0)}[e.kind]()
                self.applied.append({"t": t, "trace_t": e.t, "kind": e.kind, "node": e.node})
            except Exception as exc:  # noqa: BLE001 - a failed action is reported, the trace goes on
                self.errors.append(f"{what} {e.kind} node {e.node} at t={at:g}: {type(exc).__name__}: {exc}")


def steps_of(records: list[dict]) -> list[tuple[float, int]]:
    return [(float(r["t"]), int(r["step"])) for r in records]


def play(system, machines, trace: Optional[list[TraceEvent]], timeout_s: float) -> RunResult:
    """Run ``system`` (``start()``, ``steps()``, ``poll()``, ``done(player)``, ``stop()``) with the trace played
    against ``machines``; stop it whatever happens. ``finished``: it ended by itself before ``timeout_s``."""
    start_t = time.time()
    player = TracePlayer(trace or [], machines, lambda: next(iter(system.steps()), (None,))[0])
    finished = False
    try:
        system.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not finished:
            player.tick()
            system.poll()
            finished = system.done(player)
            time.sleep(POLL_S)
    finally:
        system.stop()
    for error in player.errors:
        print(f"  replay: trace action failed: {error}", file=sys.stderr)
    return RunResult(start_t, time.time(), system.steps(), player.applied, finished)


# --- bare torchrun ---------------------------------------------------------------------------------------------

class AgentMachines:
    """Simulated nodes as bare torchrun agents: a node's machine is its agent's process tree."""

    def __init__(self, argv: list[str], env: dict[str, str], logdir: Path):
        self.argv, self.env, self.logdir = argv, env, logdir
        self.agents: dict[int, NodeProcess] = {}
        self._starts = 0

    def restore(self, node: int) -> None:
        self._starts += 1
        self.agents[node] = NodeProcess(node, tuple(self.argv), self.env,
                                        self.logdir / f"node{node}.{self._starts}.log", echo=None)

    def kill(self, node: int) -> None:
        agent = self.agents.pop(node, None)
        if agent is not None:
            kill_tree(agent.pid)

    def notice(self, node: int, grace_s: float) -> None:
        """Nothing: bare torchrun and the tutorial's script read no preemption notice."""

    def live(self) -> list[NodeProcess]:
        return [a for a in self.agents.values() if a.poll() is None]

    def stop_all(self) -> None:
        for agent in self.agents.values():
            terminate_tree(agent.pid, grace_s=5)


class TorchrunRun:
    """One bare torchrun job over ``nodes`` agents against the store at ``port``."""

    def __init__(self, job: Job, nodes: int, port: int, max_restarts: int, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "job.json").write_text(job.to_json())
        self.job, self.nodes, self.steps_file = job, nodes, workdir / "steps.jsonl"
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{nodes}", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=replay-{workdir.name}",
                "--rdzv-conf=is_host=false", f"--max-restarts={max_restarts}",
                "-m", "orchestrator.bench.replay_job", "--job", str(workdir / "job.json"),
                "--snapshot", str(workdir / "snapshot.pt"), "--steps-file", str(self.steps_file)]
        # torch 2.13's torchrun keeps rank 0's bootstrap address from its first round and never republishes it,
        # so a node that joins a later round waits 60 s for it and both agents fail (measured here): the
        # opt-out below is the known fix, which orch's agents use too (orchestrator/rendezvous/args.py).
        env = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        self.machines = AgentMachines(argv, env, workdir / "logs")

    def start(self) -> None:
        for node in range(self.nodes):
            self.machines.restore(node)

    def steps(self) -> list[tuple[float, int]]:
        return steps_of(read_jsonl(self.steps_file))

    def poll(self) -> None:
        """Nothing between actions."""

    def done(self, player: TracePlayer) -> bool:
        # The last step is done (an agent the trace brings back later would only find the final snapshot), or
        # no agent is left and the trace brings none back.
        return any(s >= self.job.max_steps for _, s in self.steps()) or (not self.machines.live() and player.done())

    def stop(self) -> None:
        self.machines.stop_all()


@contextmanager
def torchrun_store() -> Iterator[int]:
    """The c10d rendezvous store on a stable host (this process); yields its port."""
    from torch.distributed import TCPStore

    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        yield port
    finally:
        del store


def run_torchrun(job: Job, nodes: int, max_restarts: int, workdir: Path, trace: list[TraceEvent],
                 timeout_s: float) -> tuple[RunResult, RunResult]:
    """The fault-free run, then the run under ``trace``."""
    results = []
    with torchrun_store() as port:
        for name, events in (("fault-free", None), ("trace", trace)):
            run = TorchrunRun(job, nodes, port, max_restarts, workdir / name)
            results.append(play(run, run.machines, events, timeout_s))
    return results[0], results[1]


# --- a Ray cluster of simulated nodes --------------------------------------------------------------------------

class RayMachines:
    """Simulated nodes as 1-CPU Ray nodes of a ``ray.cluster_utils.Cluster`` whose head has no CPUs.
    ``notifier(node, ray_node_id, grace_s)`` delivers a notice the way the system running now reads one;
    ``on_kill(ray_node_id, pids)`` hears of each kill."""

    def __init__(self, cluster, nodes: int):
        self.cluster, self.nodes = cluster, nodes
        self.up: dict[int, object] = {}
        self.created: list = []  # every Ray node started, for the way out
        self.notifier: Callable[[int, str, float], None] = lambda node, ray_node, grace_s: None
        self.on_kill: Callable[[str, list[int]], None] = lambda ray_node, pids: None
        self.top_up()

    def top_up(self) -> None:
        """Every node up again (between runs)."""
        for node in range(self.nodes):
            if node not in self.up:
                self.restore(node)
        self.cluster.wait_for_nodes()

    def restore(self, node: int) -> None:
        self.up[node] = self.cluster.add_node(num_cpus=1)
        self.created.append(self.up[node])

    def kill(self, node: int) -> None:
        ray_node = self.up.pop(node, None)
        if ray_node is None:
            return
        killed = [pid for infos in ray_node.all_processes.values() for info in infos
                  for pid in kill_tree(info.process.pid)]
        self.cluster.remove_node(ray_node, allow_graceful=False)
        self.on_kill(ray_node.node_id, killed)

    def notice(self, node: int, grace_s: float) -> None:
        ray_node = self.up.get(node)
        if ray_node is not None:
            self.notifier(node, ray_node.node_id, grace_s)

    def all_pids(self) -> list[int]:
        nodes = [self.cluster.head_node, *self.up.values()]
        return [info.process.pid for n in nodes if n is not None
                for infos in n.all_processes.values() for info in infos]


@contextmanager
def ray_cluster(nodes: int) -> Iterator[RayMachines]:
    """A head with no CPUs and ``nodes`` 1-CPU Ray nodes; on the way out every process of every node is killed
    by PID (whatever runs under it too), then the cluster is shut down."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    machines = None
    try:
        machines = RayMachines(cluster, nodes)
        yield machines
    finally:
        if machines is not None:
            for pid in machines.all_pids()[::-1]:  # worker nodes first, the head (GCS) last
                kill_tree(pid)
        cluster.shutdown()
        for node in [cluster.head_node, *(machines.created if machines else [])]:
            if node is not None and not hasattr(node, "all_processes"):
                node.all_processes = {}  # Ray's exit hook for each node it started reads it after removal


class ProcessRun:
    """A system driven by one process (``orch launch``, the Ray Train driver) whose exit ends the run."""

    def __init__(self, argv: list[str], log: Path, env: Optional[dict] = None):
        self.argv, self.log, self.env = argv, log, env
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, **(self.env or {})})

    def done(self, player: TracePlayer) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def notify(self, node: int, ray_node: str, grace_s: float) -> None:
        """Give ``node`` (on Ray node ``ray_node``) a preemption notice the way this system reads one."""

    def poll(self) -> None:
        """Called between trace actions, on the same thread."""

    def killed(self, ray_node: str, pids: list[int]) -> None:
        """Ray node ``ray_node`` was just killed (``pids``)."""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # orch stops its agents; Ray's driver ends its job
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        terminate_tree(self.proc.pid, grace_s=5)


class OrchRun(ProcessRun):
    """``orch launch`` on the cluster in one fault-tolerance mode; its timeline is metrics.jsonl (every step)."""

    def __init__(self, mode: str, address: str, overrides: list[str], workdir: Path):
        self.run_dir = workdir / "run"
        self._noticed: dict[str, float] = {}  # Ray node -> its notice's deadline (unix time)
        self._told: set[tuple[int, int]] = set()  # (node, agent pid) given a notice
        super().__init__([sys.executable, "-m", "orchestrator.cli", "launch", f"conf={PRESET}", *overrides,
                          "launcher=ray", f"cluster.address={address}", f"fault_tolerance.mode={mode}",
                          f"run.dir={self.run_dir}"], workdir / "orch.log")

    def steps(self) -> list[tuple[float, int]]:
        return steps_of(read_jsonl(self.run_dir / METRICS_FILE))

    def agent_on(self, ray_node: str) -> Optional[tuple[int, int]]:
        """(orch node, agent pid) of the latest agent placed on that Ray node, if any."""
        joined = [e for e in read_jsonl(self.run_dir / EVENTS_FILE)
                  if e["event"] == EventName.NODE_JOINED and e.get("ray_node") == ray_node and e.get("pid")]
        return (joined[-1]["node"], joined[-1]["pid"]) if joined else None

    def notify(self, node: int, ray_node: str, grace_s: float) -> None:
        """A cloud's notice is the machine's: an agent orch starts there before the deadline reads it too (as a
        replacement placed on a noticed machine would find it in the metadata), with the grace that is left."""
        self._noticed[ray_node] = time.time() + grace_s
        self.poll()

    def poll(self) -> None:
        from orchestrator.events import ChaosPreempt
        from orchestrator.preemption.notices import deliver_notice
        from orchestrator.rundir import EventLog

        for ray_node, deadline in list(self._noticed.items()):
            agent, left = self.agent_on(ray_node), deadline - time.time()
            if left <= 0:
                del self._noticed[ray_node]
            elif agent is not None and agent not in self._told:
                self._told.add(agent)
                deliver_notice(self.run_dir, agent[0], agent[1], left, source="chaos",
                               detail=f"orch bench replay (grace {left:.1f} s)")
                EventLog(self.run_dir).write(ChaosPreempt(node=agent[0], grace_s=round(left, 2), agent_pid=agent[1]))

    def killed(self, ray_node: str, pids: list[int]) -> None:
        from orchestrator.events import ChaosKill
        from orchestrator.rundir import EventLog

        self._noticed.pop(ray_node, None)
        agent = self.agent_on(ray_node)
        if agent is not None and agent[1] in pids:
            EventLog(self.run_dir).write(ChaosKill(node=agent[0], pids=pids, signal="SIGKILL"))

    def stop(self) -> None:
        super().stop()
        for e in read_jsonl(self.run_dir / EVENTS_FILE):  # agents on Ray nodes are not this process's children
            if e["event"] == EventName.NODE_JOINED and e.get("pid"):
                kill_tree(e["pid"])


class RayTrainRun(ProcessRun):
    """The Ray Train driver (``replay_ray.py``); rank 0 writes the timeline."""

    def __init__(self, job: Job, address: str, nodes: int, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "job.json").write_text(job.to_json())
        self.steps_file, self.address = workdir / "steps.jsonl", address
        super().__init__([sys.executable, "-m", "orchestrator.bench.replay_ray", "--address", address,
                          "--job", str(workdir / "job.json"), "--storage", str(workdir / "storage"),
                          "--steps-file", str(self.steps_file), "--max-workers", str(nodes)],
                         workdir / "driver.log", {"RAY_TRAIN_V2_ENABLED": "1"})

    def steps(self) -> list[tuple[float, int]]:
        return steps_of(read_jsonl(self.steps_file))

    def notify(self, node: int, ray_node: str, grace_s: float) -> None:
        """Drain the Ray node for preemption with the deadline, as Ray's autoscaler does."""
        import ray._raylet
        from ray.core.generated import autoscaler_pb2

        deadline_ms = int((time.time() + grace_s) * 1000)
        accepted, why = ray._raylet.GcsClient(address=self.address).drain_node(
            ray_node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "orch bench replay: preemption notice", deadline_ms)
        if not accepted:
            raise RuntimeError(f"Ray refused to drain node {ray_node}: {why}")


def run_on_ray(make_run: Callable[[Path, str], ProcessRun], nodes: int, workdir: Path, trace: list[TraceEvent],
               timeout_s: float) -> tuple[RunResult, RunResult]:
    """The fault-free run, then the run under ``trace``, on one Ray cluster (topped up in between);
    ``make_run(workdir, cluster address)``."""
    results = []
    with ray_cluster(nodes) as machines:
        for name, events in (("fault-free", None), ("trace", trace)):
            machines.top_up()
            run = make_run(workdir / name, machines.cluster.address)
            machines.notifier = run.notify
            machines.on_kill = run.killed
            results.append(play(run, machines, events, timeout_s))
    return results[0], results[1]
