"""The commands that run one point (megapipe/study/__init__.py): pure text, nothing started here.

Every launcher runs the same training command, `train.py --config BASE --section.key=value ...
--log.profile=true` (the run writes its own profile: study_profile.json, megapipe/train/
profile.py), under torchrun with c10d rendezvous: one agent per node, each starting
devices_per_node workers.

- local: `nodes` agents on this machine, all meeting at 127.0.0.1:PORT, stand in for nodes.
- slurm: one sbatch script per point: one task per node (`python -m megapipe.cli.launch`: the
  config checked, then the torchrun agent, the run's stop signals passed on to the workers),
  the rendezvous on the job's first node, the environment, output paths under the point's
  dir. The devices are GPUs (`launcher.devices: gpu`, the default: one GPU request line, NCCL)
  or CPUs (`cpu`: no GPU request, CUDA hidden, gloo); train.py picks the backend by what it
  sees.
- command: the user's template with the point's values filled in (TEMPLATE_KEYS).
"""

from __future__ import annotations

import shlex
from typing import Any

from megapipe.study.spec import Point, Study, StudyError

# slurm: the c10d store's port on the job's first node, from the job id unless the study gives
# one, so that jobs sharing a host (a small cluster's nodes, tools/slurm/local_cluster.sh) differ
RDZV_PORT = "$((20000 + SLURM_JOB_ID % 10000))"
HEAD_ADDR = (  # NodeAddr (the node's name where none is set: most clusters)
    'HEAD=$(scontrol show node "$FIRST" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")'
    "; HEAD=${HEAD:-$FIRST}"
)
DEVICES = ("gpu", "cpu")  # launcher.devices
GPU_REQUEST = "--gpus-per-node={devices_per_node}"  # launcher.gpu_request: e.g. --gres=gpu:{..}
PROFILE = "--log.profile=true"  # the run writes study_profile.json (and trace.json)
TEMPLATE_KEYS = ("nodes", "devices_per_node", "world", "name", "point_dir", "run_dir", "python",
                 "script_args", "torchrun")  # fmt: skip
# what a multi-node job usually needs set (tools/slurm/train.sbatch explains each), by devices
SLURM_ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
DEVICE_ENV = {
    "gpu": {"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
    "cpu": {"CUDA_VISIBLE_DEVICES": ""},  # gloo, even on a node with GPUs
}


def script_args(study: Study, point: Point, run_dir: str, script: str) -> list[str]:
    """The training command after the interpreter: train.py (`script`), config, overrides, and
    the profile the report reads (log.profile: megapipe/train/profile.py)."""
    overrides = study.point_overrides(point, run_dir)
    return [script, "--config", study.base, *(f"--{o}" for o in overrides), PROFILE]


def torchrun_args(point: Point, endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's options for one agent of the point (the same on every node: c10d numbers them)."""
    return [
        f"--nnodes={point.nodes}",
        f"--nproc-per-node={point.devices_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]


def local_commands(
    study: Study, point: Point, run_dir: str, python: str, script: str, port: int
) -> list[list[str]]:
    """One torchrun agent per node, all on localhost, meeting at 127.0.0.1:port."""
    agent = [python, "-m", "torch.distributed.run",
             *torchrun_args(point, f"127.0.0.1:{port}", point.name)]  # fmt: skip
    return [[*agent, *script_args(study, point, run_dir, script)] for _ in range(point.nodes)]


def _sbatch_lines(opts: dict[str, Any], point: Point, point_dir: str) -> list[str]:
    lines = [
        f"#SBATCH --job-name={opts.get('job_name', 'study')}-{point.name}",
        f"#SBATCH --nodes={point.nodes}",
        "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the workers",
        f"#SBATCH --output={point_dir}/slurm-%j.out",
        f"#SBATCH --time={opts.get('time', '01:00:00')}",
    ]
    if opts.get("devices", "gpu") == "gpu":
        request = str(opts.get("gpu_request", GPU_REQUEST))
        lines.insert(3, "#SBATCH " + request.format(devices_per_node=point.devices_per_node))
    for key in ("partition", "account", "qos", "cpus_per_task", "mem"):
        if key in opts:
            lines.append(f"#SBATCH --{key.replace('_', '-')}={opts[key]}")
    lines += [f"#SBATCH {extra}" for extra in opts.get("sbatch", [])]
    if opts.get("exclusive", True):
        lines.append("#SBATCH --exclusive")
    return lines


def sbatch_script(
    study: Study,
    point: Point,
    point_dir: str,
    run_dir: str,
    root: str,
    script: str,
    python: str = "python",
) -> str:
    """The point's job: launcher options from the study's `launcher:` (devices: gpu | cpu,
    gpu_request, partition, account, qos, time, cpus_per_task, mem, sbatch: [extra lines],
    setup: [shell lines], env: {K: V}, python, port, exclusive); `root` the checkout, `script`
    the training script in it, `python` the interpreter unless the study names one."""
    opts = study.launcher
    python = str(opts.get("python", python))
    port = opts.get("port", RDZV_PORT)
    devices = opts.get("devices", "gpu")
    env = {**SLURM_ENV, **DEVICE_ENV[devices]}
    env.update({str(k): str(v) for k, v in (opts.get("env") or {}).items()})
    # one line per group: the launcher and its options (the rendezvous left for the shell to
    # expand), the script and its config, then one override per line
    args = script_args(study, point, run_dir, script)
    groups = [
        f"{shlex.quote(python)} -m megapipe.cli.launch "
        + " ".join(torchrun_args(point, "$HEAD:$PORT", "$SLURM_JOB_ID")),
        shlex.join(args[:3]),
        *(shlex.quote(a) for a in args[3:]),
    ]
    quoted = " \\\n    ".join(groups)
    lines = [
        "#!/bin/bash",
        f"# scaling study {study.name!r}, point {point.name}: {point.nodes} node(s) × "
        f"{point.devices_per_node} {opts.get('devices', 'gpu')}(s), mesh {point.mesh}",
        "# written by tools/scaling_study.py; `collect` reads the run dir when the job is done",
        *_sbatch_lines(opts, point, point_dir),
        "set -euo pipefail",
        f"cd {shlex.quote(root)}  # the checkout, on a file system every node sees",
        *[str(line) for line in opts.get("setup", [])],
        *[f"export {k}={shlex.quote(v)}" for k, v in env.items()],
        "# srun does not pass the job's --cpus-per-task on to its step by itself (SLURM 22.05)",
        '[ -z "${SLURM_CPUS_PER_TASK:-}" ] || export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK',
        "# the c10d rendezvous on the job's first node, at the address SLURM reaches it by",
        'FIRST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        HEAD_ADDR,
        f"PORT={port}",
        "export MASTER_ADDR=$HEAD",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {quoted}",
        "",
    ]
    return "\n".join(lines)


def command_text(
    study: Study, point: Point, point_dir: str, run_dir: str, python: str, script: str
) -> str:
    """The `command` launcher's template with the point's values (TEMPLATE_KEYS): `{torchrun}`
    is `python -m torch.distributed.run --nnodes=N --nproc-per-node=D` (the rendezvous is the
    template's to add), `{script_args}` the training script and its arguments, quoted."""
    values = {
        "nodes": point.nodes,
        "devices_per_node": point.devices_per_node,
        "world": point.world,
        "name": point.name,
        "point_dir": shlex.quote(point_dir),
        "run_dir": shlex.quote(run_dir),
        "python": python,
        "script_args": shlex.join(script_args(study, point, run_dir, script)),
        "torchrun": f"{python} -m torch.distributed.run --nnodes={point.nodes} "
        f"--nproc-per-node={point.devices_per_node}",
    }
    try:
        return study.launcher["template"].format(**values)
    except (KeyError, IndexError) as e:
        raise StudyError(
            f"{study.path}: launcher.template: unknown placeholder {e}; use "
            + ", ".join(f"{{{k}}}" for k in TEMPLATE_KEYS)
        ) from None
