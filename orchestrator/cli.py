"""The ``orch`` command line. Each subcommand parses its arguments and calls one library function.

Errors derived from OrchError print as one line on stderr and exit with their code (2: bad input,
1: a failed run); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional

from orchestrator import __version__
from orchestrator.errors import OrchError
from orchestrator.lifecycle.cli import LAUNCH_FLAGS, add_launch_options, add_lifecycle_parsers


def _launch_epilog() -> str:
    from orchestrator.config.compose import list_groups, list_presets

    groups = "\n".join(f"  {name:<11} {', '.join(options)}" for name, options in list_groups().items())
    return (f"presets (conf=NAME):\n  {', '.join(list_presets())}\n\n"
            f"config groups (GROUP=OPTION) and their built-in options:\n{groups}\n\n"
            "other keys: backend.*, ddp.*, amp.*, checkpoint.*, cluster.*, rendezvous.*, trainer.*, data.*,\n"
            "  entrypoint.*, preemption.*, launcher, run.dir  (see docs/configuration.md)\n\n"
            "examples:\n  orch launch conf=cpu_gloo\n  orch launch conf=cpu_gloo cluster.nnodes=1:2 trainer.max_steps=100\n"
            "  orch launch conf=bert8gpu --dry-run")


def cmd_launch(args: argparse.Namespace) -> int:
    from orchestrator.lifecycle.cli import start_agent_ahead

    if not (args.detach or args.dry_run or args.multirun or args.cfg):
        start_agent_ahead(args.overrides)  # before composing: its torch import overlaps the driver's start
    from orchestrator.config.compose import split_preset
    from orchestrator.lifecycle.cli import run_launch

    preset, overrides = split_preset(args.overrides)
    return run_launch(preset, overrides, detach=args.detach, dry_run=args.dry_run, multirun=args.multirun,
                      cfg=args.cfg, command_t=args.command_t)


def cmd_doctor(args: argparse.Namespace) -> int:
    from orchestrator.doctor import main_doctor

    return main_doctor(json_out=args.json)


def cmd_chaos_kill_node(args: argparse.Namespace) -> int:
    from orchestrator.chaos import kill_node

    pids = kill_node(args.run_dir, args.node)
    print(f"killed node {args.node}: {len(pids)} process(es) {pids}")
    return 0


def cmd_chaos_preempt(args: argparse.Namespace) -> int:
    from orchestrator.chaos import preempt_node

    result = preempt_node(args.run_dir, args.node, args.grace)
    if "left_in_s" in result:
        print(f"node {args.node} saved and left {result['left_in_s']:.1f} s after the notice")
    else:
        print(f"node {args.node} was still alive after {args.grace} s: killed {result['killed_pids']}")
    return 0


def cmd_ckpt_list(args: argparse.Namespace) -> int:
    from orchestrator.checkpoint import format_checkpoint_list

    print(format_checkpoint_list(args.run_or_url))
    return 0


def cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    from orchestrator.checkpoint.inspect import inspect_checkpoint
    from orchestrator.errors import UserError

    text, problem = inspect_checkpoint(args.url)
    print(text)
    if problem is not None:
        raise UserError(f"{text.splitlines()[0].removeprefix('checkpoint ')} is not a valid checkpoint: {problem}; "
                        "load() skips it. Fix: resume from another step (`orch ckpt list` marks the valid ones)")
    return 0


def cmd_ckpt_export(args: argparse.Namespace) -> int:
    from orchestrator.checkpoint.export import export_weights

    step, count = export_weights(args.run_or_url, args.output, args.format, args.step)
    print(f"wrote {args.output}: {count} tensors of the model at step {step}")
    return 0


def cmd_bench_ckpt(args: argparse.Namespace) -> int:
    from orchestrator.bench.ckpt import main_ckpt_bench

    main_ckpt_bench(out=args.out, size_mb=args.size_mb)
    return 0


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from orchestrator.bench.memory import main_memory_bench

    world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    main_memory_bench(out=args.out, preset=args.preset, world_sizes=world_sizes, steps=args.steps)
    return 0


def cmd_bench_recovery(args: argparse.Namespace) -> int:
    from orchestrator.bench.recovery import main_recovery_bench

    main_recovery_bench(out=args.out, kill_at_step=args.kill_at_step, mode=args.mode)
    return 0


def cmd_bench_replay(args: argparse.Namespace) -> int:
    from orchestrator.bench.replay import main_replay_bench

    main_replay_bench(out=args.out, trace_path=args.trace, systems=args.systems, seed=args.seed,
                      max_steps=args.max_steps, plot_path=args.plot, workdir=args.workdir)
    return 0


def cmd_bench_hang(args: argparse.Namespace) -> int:
    from orchestrator.bench.hang import main_hang_bench

    result = main_hang_bench(out=args.out, quiet_s=args.quiet_s)
    return 0 if result["detected"] and result["status"] == "succeeded" else 1


def cmd_bench_goodput(args: argparse.Namespace) -> int:
    from orchestrator.bench.goodput import main_goodput_bench

    main_goodput_bench(out=args.out, every_s=args.every, max_steps=args.max_steps, mode=args.mode)
    return 0


def cmd_bench_scaling(args: argparse.Namespace) -> int:
    from orchestrator.bench.scaling import main_scaling_bench

    main_scaling_bench(args.overrides, out=args.out, run_root=args.run_root, warmup_steps=args.warmup_steps,
                       repeats=args.repeats)
    return 0


def cmd_bench_ckpt_interval(args: argparse.Namespace) -> int:
    from orchestrator.bench.ckpt_interval import main_ckpt_interval_bench

    main_ckpt_interval_bench(out=args.out, seeds=args.seeds)
    return 0


def cmd_bench_overhead(args: argparse.Namespace) -> int:
    if args.mode == "per_step":
        from orchestrator.bench.overhead_modes import main_modes_overhead

        main_modes_overhead(out=args.out, repeats=args.repeats or 8, steps=args.steps or 200,
                            large_steps=args.large_steps)
        return 0
    from orchestrator.bench.overhead import main_overhead_bench

    main_overhead_bench(out=args.out, repeats=args.repeats or 4, steps=args.steps or 150, timing_steps=args.timing_steps)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from orchestrator.report.report import write_report
    from orchestrator.report.summary import format_summary

    report = write_report(args.run_dir, baseline=args.baseline, warmup_steps=args.warmup_steps)
    if report["kind"] == "run":
        print(format_summary(report["summary"], report["run_dir"]).rsplit("\nrun dir:", 1)[0])
        if report["efficiency"] and args.baseline:
            base = report["efficiency"]["baseline"]
            effs = ", ".join(f"{v:.2f} at world size {k}" for k, v in report["efficiency"]["by_world_size"].items())
            print(f"  scaling efficiency {effs} (against world size {base['world_size']} of {base['run_dir']})")
    print("written: " + ", ".join(report["files"]))
    for name, why in (report.get("plots_skipped") or {}).items():
        print(f"not drawn: {name}: {why}")
    return 0


def cmd_k8s_render(args: argparse.Namespace) -> int:
    from orchestrator.config.compose import split_preset
    from orchestrator.errors import UserError
    from orchestrator.k8s import render, write

    preset, overrides = split_preset(args.overrides)
    if args.output and os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UserError(f"-o {args.output!r} is a file; -o names a directory (orch writes DIR/<format>.yaml into it). "
                        f"Fix: -o {os.path.dirname(os.path.abspath(args.output))}, or another directory")
    rendered = render(preset, overrides, args.format)
    for warning in rendered.warnings:
        print(f"orch: warning: {warning}", file=sys.stderr)
    if args.output:
        path = write(rendered, args.output)
        print(f"wrote {path}: {rendered.summary()}")
        if rendered.secret_command:
            print(f"before kubectl apply, create the run's Secret: {rendered.secret_command}")
    else:
        sys.stdout.write(rendered.text())
    return 0


def cmd_rendezvous_store(args: argparse.Namespace) -> int:
    from orchestrator.errors import ConfigError
    from orchestrator.k8s.store import serve_store

    if not 0 <= args.port <= 65535:
        raise ConfigError("--port", args.port, "use 0 (a free port) to 65535", "is not a TCP port")
    try:
        return serve_store(args.port, say=lambda line: print(line, flush=True), host=args.host)
    except OSError as e:
        raise ConfigError("--port", args.port, "stop what holds it or pick another port (0: a free one)",
                          f"cannot be bound on {args.host} ({e.strerror or e})") from None


def cmd_quorum_service(args: argparse.Namespace) -> int:
    from orchestrator.errors import ConfigError
    from orchestrator.k8s.quorum import serve_quorum

    if not 0 <= args.port <= 65535:
        raise ConfigError("--port", args.port, "use 0 (a free port) to 65535", "is not a TCP port")
    for flag in ("min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')}", getattr(args, flag), "use a positive number",
                              "is not positive")
    try:
        return serve_quorum(args.port, args.min_replicas, args.join_timeout_ms, args.quorum_tick_ms,
                            args.heartbeat_timeout_ms, say=lambda line: print(line, flush=True), host=args.host)
    except OSError as e:
        raise ConfigError("--port", args.port, "stop what holds it or pick another port (0: a free one)",
                          f"cannot be bound on {args.host} ({e.strerror or e})") from None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw text, and an epilog given as a function is called only when help is printed: listing the presets and
    config groups reads conf/, which every command would otherwise pay for at its start."""

    def add_text(self, text: Optional[str | Callable[[], str]]) -> None:
        super().add_text(text() if callable(text) else text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orch", formatter_class=_HelpFormatter,
        description="Elastic distributed training for PyTorch: Hydra configs -> torchrun agents -> checkpoints.",
        epilog=_launch_epilog)  # type: ignore[arg-type]
    parser.add_argument("--version", action="version", version=f"orch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="compose a preset with overrides and run it (or --dry-run)",
                       formatter_class=_HelpFormatter, epilog=_launch_epilog,  # type: ignore[arg-type]
                       usage="orch launch conf=NAME [key=value ...] [--dry-run] [--detach] [-m] [--cfg job]")
    p.add_argument("overrides", nargs="*", metavar="conf=NAME | key=value",
                   help="the preset, then Hydra overrides (key=value, +key=value, ~key)")
    add_launch_options(p)
    p.set_defaults(func=cmd_launch)
    add_lifecycle_parsers(sub)

    p = sub.add_parser("report", help="report.md, report.json and PNG plots of a run dir (or a bench scaling dir)")
    p.add_argument("run_dir", help="a run dir (or the directory `orch bench scaling` wrote)")
    p.add_argument("--baseline", metavar="RUN_DIR", help="a run of the same config at a smaller world size (usually 1): "
                   "scaling efficiency against its throughput")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="steps after each attempt's first logged step left out of throughput (default 0)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("doctor", help="check torch, CUDA/NCCL/gloo, shared memory, Ray and free ports")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_doctor)

    chaos = sub.add_parser("chaos", help="fault-injection drills against a running launch").add_subparsers(
        dest="chaos_command", required=True)
    p = chaos.add_parser("kill-node", help="kill one node of a running launch: its agent and every worker under it")
    p.add_argument("run_dir", help="the run dir of a running launch")
    p.add_argument("--node", type=int, required=True, help="the node index (see the run dir's nodes.json)")
    p.set_defaults(func=cmd_chaos_kill_node)
    p = chaos.add_parser("preempt", help="deliver a preemption notice to a node; kill it after --grace s if alive")
    p.add_argument("run_dir", help="the run dir of a running launch")
    p.add_argument("--node", type=int, required=True, help="the node index (see the run dir's nodes.json)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds before the hard kill (default 30)")
    p.set_defaults(func=cmd_chaos_preempt)

    ckpt = sub.add_parser("ckpt", help="list and inspect checkpoints at any fsspec URL").add_subparsers(
        dest="ckpt_command", required=True)
    p = ckpt.add_parser("list", help="steps, validity, reasons, sizes, engines and config fingerprints of a run's "
                        "checkpoints (orch's and HF Trainer's checkpoint-N)")
    p.add_argument("run_or_url", metavar="RUN_OR_URL", help="a run dir or a checkpoint URL")
    p.set_defaults(func=cmd_ckpt_list)
    p = ckpt.add_parser("inspect", help="files, checksums and metadata of URL/step_N (or the newest under URL or a "
                        "run dir); exits 2 when load() would skip it")
    p.add_argument("url")
    p.set_defaults(func=cmd_ckpt_inspect)
    p = ckpt.add_parser("export", help="the model weights alone of a run's (or URL's) newest valid checkpoint, "
                        "as one safetensors file")
    p.add_argument("run_or_url", metavar="RUN_OR_URL", help="a run dir or a checkpoint URL")
    p.add_argument("--format", default="safetensors", help="safetensors (the only one)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write")
    p.add_argument("--step", type=int, help="this step instead of the newest valid one")
    p.set_defaults(func=cmd_ckpt_export)

    bench = sub.add_parser("bench", help="side-by-side measurements that print ratios").add_subparsers(
        dest="bench_command", required=True)
    p = bench.add_parser("ckpt", help="training stall per checkpoint: sync vs async save of the same state")
    p.add_argument("--out", help="write the result as JSON to this file")
    p.add_argument("--size-mb", type=float, default=100.0, help="model + optimizer state size (default 100)")
    p.set_defaults(func=cmd_bench_ckpt)
    p = bench.add_parser("memory", help="per-rank parameter + gradient + optimizer bytes, peak RSS and throughput: "
                                        "ddp vs fsdp2 at each world size")
    p.add_argument("--out", help="write the rows and fsdp2_over_ddp_state_bytes_per_rank as JSON to this file")
    p.add_argument("--preset", default="cpu_fsdp", help="the preset whose model is measured (default cpu_fsdp)")
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4)")
    p.set_defaults(func=cmd_bench_memory)
    p = bench.add_parser("scaling", help="throughput, scaling efficiency and comm fraction at each world size",
                         usage="orch bench scaling conf=NAME world_sizes=[1,2,...] [key=value ...] [--out FILE.json]")
    p.add_argument("overrides", nargs="*", metavar="conf=NAME | world_sizes=[..] | key=value",
                   help="the preset, the world sizes, then Hydra overrides for every run")
    p.add_argument("--out", help="write the rows as JSON to this file")
    p.add_argument("--run-root", help="where the runs go (default runs/bench-scaling/<preset>-<timestamp>)")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="steps after each run's first logged step left out of throughput (default 5)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per world size, in alternating order; rows hold medians (default 1)")
    p.set_defaults(func=cmd_bench_scaling)
    p = bench.add_parser("overhead", help="orch vs a plain torchrun script of the same DDP job; per-step timing cost")
    p.add_argument("--out", help="write {throughput_ratio, first_step_ratio, ...} as JSON to this file")
    p.add_argument("--steps", type=int, help="training steps per run (default 150; --mode per_step: 200)")
    p.add_argument("--repeats", type=int,
                   help="runs of each, alternating (default 4; --mode per_step: 8 of cpu_elastic, shorter: back-to-back "
                        "runs of it differ by up to 25%% on a shared machine, and its pairs' median needs more of them)")
    p.add_argument("--timing-steps", type=int, default=300,
                   help="alternating steps with and without per-step timing (default 300)")
    p.add_argument("--mode", choices=("restart", "per_step"), default="restart",
                   help="per_step: fault_tolerance.mode=per_step against restart instead, fault-free, on cpu_elastic "
                        "and on its model at 54M parameters; the JSON has per_step_over_restart_throughput")
    p.add_argument("--large-steps", type=int, default=24,
                   help="--mode per_step: training steps of each run of the 54M-parameter model (3 runs per mode; "
                        "default 24)")
    p.set_defaults(func=cmd_bench_overhead)
    p = bench.add_parser("goodput", help="goodput with a preempted node every T seconds vs. no preemption")
    p.add_argument("--out", help="write the result as JSON to this file")
    p.add_argument("--every", type=float, default=60.0, help="seconds between preemptions (default 60)")
    p.add_argument("--max-steps", type=int, default=6000, help="training steps of each run (default 6000)")
    p.add_argument("--mode", choices=("restart", "per_step"), default="restart",
                   help="per_step: both fault-tolerance modes in one run; the JSON has one object per mode under "
                        "'restart' and 'per_step'")
    p.set_defaults(func=cmd_bench_goodput)
    p = bench.add_parser("hang", help="a SIGSTOPped worker detected and recovered from; false alarms over a quiet run")
    p.add_argument("--out", help="write {detected, recovery_s, false_alarms, ...} as JSON to this file")
    p.add_argument("--quiet-s", type=float, default=300.0, help="seconds of fault-free training watched (default 300)")
    p.set_defaults(func=cmd_bench_hang)
    p = bench.add_parser("recovery", help="time to recover from a lost node: bare torchrun vs orch, same job and kill")
    p.add_argument("--out", help="write {orch_mttr_s, torchrun_mttr_s, ratio} as JSON to this file")
    p.add_argument("--kill-at-step", type=int, default=10, help="kill node 1 once this step completed (default 10)")
    p.add_argument("--mode", choices=("restart", "per_step"), default="restart",
                   help="per_step: 1 of 3 nodes, bare torchrun vs orch restart vs orch per_step in one run; the JSON "
                        "has one object per mode under 'restart' and 'per_step'")
    p.set_defaults(func=cmd_bench_recovery)
    p = bench.add_parser("replay", help="one failure trace against bare torchrun, orch restart, orch per_step and Ray "
                                        "Train, same job, one after another")
    p.add_argument("--out", help="write {rows: [{system, wall_s, wall_s_fault_free, time_to_train_ratio, lost_steps, "
                                 "mttr_s, steps_completed}]} as JSON (and the plot beside it, .png)")
    p.add_argument("--trace", metavar="FILE", help='a JSON list of {"t", "kind": kill|preempt|return, "node"} '
                                                   "(default: a seeded trace of a few minutes)")
    p.add_argument("--seed", type=int, default=0, help="the default trace's seed (default 0)")
    p.add_argument("--systems", help="comma-separated subset of torchrun,orch-restart,orch-per_step,ray-train")
    p.add_argument("--max-steps", type=int, default=300, help="training steps of every run (default 300)")
    p.add_argument("--plot", metavar="FILE", help="the steps-over-time PNG (default: beside --out)")
    p.add_argument("--workdir", help="keep every run's files here (default: a temporary dir)")
    p.set_defaults(func=cmd_bench_replay)

    p = bench.add_parser("ckpt-interval", help="simulated goodput of every_n_steps=auto vs the best fixed interval, "
                                                "failure intervals from 30 s to 24 h")
    p.add_argument("--out", help="write {rows: [{mtbf_s, best_fixed_interval, best_fixed_goodput, auto_goodput}]} as JSON")
    p.add_argument("--seeds", type=int, default=4, help="seeds per failure interval (default 4)")
    p.set_defaults(func=cmd_bench_ckpt_interval)

    from orchestrator.simulate.cli import add_simulate_parsers
    from orchestrator.testcluster.cli import add_testcluster_parser

    add_simulate_parsers(sub)
    add_testcluster_parser(sub)

    k8s = sub.add_parser("k8s", help="Kubernetes manifests from the same config as launch").add_subparsers(
        dest="k8s_command", required=True)
    p = k8s.add_parser("render", help="render a preset with overrides as Kubernetes objects (YAML)",
                       usage="orch k8s render conf=NAME [key=value ...] [--format job|jobset|trainjob|pytorchjob|rayjob] "
                             "[-o DIR]",
                       description="job: plain Kubernetes (store Deployment + Indexed Job); jobset: a JobSet with the "
                                   "store as a replicated job; trainjob: Kubeflow Trainer v2 TrainJob + its "
                                   "ClusterTrainingRuntime; pytorchjob: Kubeflow PyTorchJob; rayjob: KubeRay RayJob. "
                                   "See docs/kubernetes.md.")
    p.add_argument("overrides", nargs="*", metavar="conf=NAME | key=value",
                   help="the preset, then Hydra overrides, as for orch launch (k8s.* shape the manifests)")
    p.add_argument("--format", default="job", help="job (default), jobset, trainjob, pytorchjob or rayjob")
    p.add_argument("-o", "--output", metavar="DIR", help="write DIR/<format>.yaml instead of printing")
    p.set_defaults(func=cmd_k8s_render)

    p = sub.add_parser("rendezvous-store", help="host the c10d rendezvous store on its own (a Kubernetes job's store pod)",
                       description="Host the c10d rendezvous store until SIGTERM. With ORCH_RUN_SECRET in the environment "
                                   "(k8s.run_secret) it admits only clients that prove the secret (orch's agents, "
                                   "through orch's tunnel).")
    p.add_argument("--port", type=int, default=29400, help="TCP port (default 29400; 0: a free one)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every IPv4 interface of "
                                                     "the store pod, which the Service routes to; :: for IPv6)")
    p.set_defaults(func=cmd_rendezvous_store)

    p = sub.add_parser("quorum-service", help="host per_step's quorum service on its own (a Kubernetes job's Lighthouse pod)",
                       description="Host the quorum service of fault_tolerance.mode=per_step (torchft's Lighthouse "
                                   "rules) until SIGTERM, admitting only clients that prove the run's secret "
                                   "(ORCH_RUN_SECRET, required). Nodes dial it with "
                                   "fault_tolerance.quorum_endpoint=HOST:PORT. See docs/kubernetes.md.")
    p.add_argument("--port", type=int, default=29401, help="TCP port (default 29401; 0: a free one)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every IPv4 interface of "
                                                     "the pod, which the Service routes to; :: for IPv6)")
    p.add_argument("--min-replicas", type=int, default=1, help="replica groups a quorum needs (cluster.nnodes MIN)")
    p.add_argument("--join-timeout-ms", type=int, default=1000, help="fault_tolerance.join_timeout_ms")
    p.add_argument("--quorum-tick-ms", type=int, default=50, help="fault_tolerance.quorum_tick_ms")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="fault_tolerance.heartbeat_timeout_ms")
    p.set_defaults(func=cmd_quorum_service)
    return parser


def options_last(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """Move ``FLAG VALUE`` / ``FLAG=VALUE`` pairs after the positional overrides, which argparse wants together."""
    rest, moved, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if token in flags and i + 1 < len(argv):
            moved += argv[i:i + 2]
            i += 2
            continue
        (moved if token.split("=", 1)[0] in flags and "=" in token else rest).append(token)
        i += 1
    return rest + moved


def main(argv: Optional[list[str]] = None) -> int:
    # The command's clock: this process's start for the real command line (interpreter and imports count), the
    # call for an argv given in process. A launch's wall_s and goodput count from it.
    command_t = _process_start() if argv is None else time.time()
    command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    _say_what_starts(argv)
    if argv[:1] == ["launch"]:  # `--dry-run`, `--detach`, `-m`, `--cfg job` may stand anywhere among the overrides
        argv = options_last([a for a in argv if a not in LAUNCH_FLAGS] + [a for a in argv if a in LAUNCH_FLAGS],
                            ("--cfg",))
    if argv[:1] == ["resume"]:
        argv = [a for a in argv if a != "--detach"] + [a for a in argv if a == "--detach"]
    if argv[:2] == ["k8s", "render"]:  # options may stand anywhere among the overrides, too
        argv = options_last(argv, ("--format", "-o", "--output"))
    args = build_parser().parse_args(argv)
    args.command_t = command_t
    code = _run(args)
    ray_launcher = sys.modules.get("launchers.ray")
    if ray_launcher is not None and ray_launcher.ABANDONED:
        # Ray's core worker cannot be torn down once its head's address vanished (a test cluster taken down
        # under the run): its exit hooks crash. Everything orch owed is written; leave with the run's code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if command_line and "torch" in sys.modules:
        _leave(code)
    return code


def _leave(code: int) -> None:
    """Exit now that everything is written: non-daemon threads are joined and the exit hooks run (Ray's shutdown,
    logging's flush), as at any exit; the interpreter's teardown does not. torch's takes seconds (its native
    destructors) after the run has ended, which the command's wall time would show and ``wall_s`` would not."""
    import atexit
    import threading

    for thread in threading.enumerate():  # as the interpreter's own exit does first: non-daemon threads finish
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _process_start() -> float:
    """When this process started, to 10 ms: its start in clock ticks since boot (``/proc/self/stat``) against
    the time since boot now (psutil's create_time goes through the boot time in whole seconds: up to 1 s early)."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: the call's own clock
        return time.time()


def _say_what_starts(argv: list[str]) -> None:
    """A launch's first line, before the imports and checks that take seconds (Hydra, torch, Ray): on a terminal
    and through a pipe alike, something says what is being done within a second of the command."""
    if argv[:1] not in (["launch"], ["resume"]) or {"--dry-run", "--cfg", "-h", "--help"} & set(argv):
        return
    what = " ".join(a for a in argv[1:] if a.startswith("conf=")) or " ".join(argv[1:2])
    print(f"[orch] {argv[0]} {what}: composing the config, checking this machine, then starting the nodes ...",
          flush=True)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except BrokenPipeError:  # `orch ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except OrchError as exc:
        print(f"orch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("orch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
